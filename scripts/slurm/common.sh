# shellcheck shell=bash
# Slurm parts shared by submit_pyxis.sbatch and submit_torchrun.sbatch (sourced).
# Needs PROJECT_DIR and the settings block of the job script.
# shellcheck source=scripts/lib/launch.sh
source "${PROJECT_DIR}/scripts/lib/launch.sh"

# Seconds left in this job (Slurm's own count, so --time on the sbatch command line counts);
# empty when unlimited or unknown. TIME_LIMIT (H:M:S) overrides. squeue gets SQUEUE_TIMEOUT_SECONDS
# (default 10): a Slurm client that cannot reach a controller (a login node of another cluster, a
# laptop with slurm-client) retries for about two minutes.
slurm_time_left() {
  local left status=0 bound=()
  if [ -n "${TIME_LIMIT:-}" ]; then to_seconds "${TIME_LIMIT}"; return 0; fi
  [ -n "${SLURM_JOB_ID:-}" ] && command -v squeue >/dev/null 2>&1 || return 0
  if command -v timeout >/dev/null 2>&1; then bound=(timeout "${SQUEUE_TIMEOUT_SECONDS:-10}"); fi
  left="$("${bound[@]}" squeue -h -j "${SLURM_JOB_ID}" -o %L 2>/dev/null)" || status=$?
  if [ "${status}" -ne 0 ]; then
    if [ "${status}" -eq 124 ]; then
      launch_log "squeue did not answer within ${SQUEUE_TIMEOUT_SECONDS:-10} s: no time limit from Slurm (set TIME_LIMIT=H:M:S)"
    else
      launch_log "squeue failed (status ${status}): no time limit from Slurm (set TIME_LIMIT=H:M:S)"
    fi
    return 0
  fi
  case "${left}" in
    "" | UNLIMITED | INVALID | NOT_SET) return 0 ;;
    *) to_seconds "${left}" ;;
  esac
}

# The hosts of a node list ("gpu-[001-004]"), one per line: `scontrol show hostnames` where
# it works, else megatron_ru's own expander (megatron_ru/parallel/hostlist.py, standard library
# only), so DRY_RUN=1 also works where scontrol is missing or finds no Slurm configuration
# (a laptop, CI, the login node of another cluster).
expand_nodelist() {
  local list="$1" out err py
  if command -v scontrol >/dev/null 2>&1; then
    err="$(mktemp)"
    if out="$(scontrol show hostnames "${list}" 2>"${err}")" && [ -n "${out}" ]; then
      rm -f "${err}"
      printf '%s\n' "${out}"
      return 0
    fi
    launch_log "scontrol cannot expand ${list} ($(tail -n 1 "${err}")); using megatron_ru's expander"
    rm -f "${err}"
  fi
  for py in "${PYTHON:-}" python3 python; do
    if [ -n "${py}" ] && command -v "${py}" >/dev/null 2>&1; then
      # -I: only the standard library (the script's own directory is not put on sys.path)
      "${py}" -I "${PROJECT_DIR}/megatron_ru/parallel/hostlist.py" "${list}"
      return
    fi
  done
  launch_die "cannot expand SLURM_JOB_NODELIST=${list}: neither scontrol nor python3 is available"
}

slurm_setup() {
  local hosts
  [ -n "${SLURM_JOB_NODELIST:-}" ] || launch_die "SLURM_JOB_NODELIST is not set: submit with sbatch (or fake it for DRY_RUN=1)"
  mapfile -t hosts < <(expand_nodelist "${SLURM_JOB_NODELIST}")
  [ -n "${hosts[0]:-}" ] || launch_die "cannot expand SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST} (see the message above)"
  NNODES="${SLURM_JOB_NUM_NODES:-${#hosts[@]}}"
  HEAD_NODE="${hosts[0]}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}"
  export MASTER_ADDR="${MASTER_ADDR:-${HEAD_NODE}}"
  # one port per job id: two jobs sharing a node never collide
  export MASTER_PORT="${MASTER_PORT:-$(job_master_port "${SLURM_JOB_ID:-0}")}"
  build_train_args "$(slurm_time_left)"
  launch_log "job ${SLURM_JOB_ID:-?}: ${NNODES} node(s) x ${GPUS_PER_NODE} GPU(s), head ${HEAD_NODE}, master ${MASTER_ADDR}:${MASTER_PORT}"
}

# CPUs for each task when TASKS tasks share a node.
cpus_per_task() {
  local cpus="${SLURM_CPUS_ON_NODE:-1}" per
  per=$(( cpus / $1 ))
  echo $(( per > 0 ? per : 1 ))
}
