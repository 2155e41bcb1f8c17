# shellcheck shell=bash
# ABCI (Grid Engine) parts shared by submit_single_node.sh and submit_multinode.sh (sourced).
# Needs PROJECT_DIR and scripts/abci/settings.sh (sourced by the job script); run_abci_job is the whole flow.
# shellcheck source=scripts/lib/launch.sh
source "${PROJECT_DIR}/scripts/lib/launch.sh"

# Environment modules only where the module system exists (ABCI), so the same script runs on
# a laptop, in CI, or on another Grid Engine site.
load_abci_modules() {
  if ! type module >/dev/null 2>&1 && [ -f /etc/profile.d/modules.sh ]; then
    set +u  # the modules init script reads unset variables
    # shellcheck disable=SC1091
    source /etc/profile.d/modules.sh
    set -u
  fi
  if ! type module >/dev/null 2>&1; then
    launch_log "no environment modules here: skipping 'module load ${ABCI_MODULES}'"
    return 0
  fi
  local m
  for m in ${ABCI_MODULES}; do
    set +u
    module load "${m}"
    set -u
  done
}

# GPUs per node of an ABCI resource type (V100: rt_F 4, rt_G.large 4, rt_G.small 1;
# A100: rt_AF 8, rt_AG.small 1).
gpus_for_resource_type() {
  case "$1" in
    rt_F | rt_G.large) echo 4 ;;
    rt_AF) echo 8 ;;
    rt_G.small | rt_AG.small) echo 1 ;;
    *) launch_die "unknown ABCI resource type '$1': set GPUS_PER_NODE explicitly" ;;
  esac
}

# The job's hard resource list ("rt_F=2,h_rt=3600"): from the running job itself (qsub -l on
# the command line overrides the #$ lines), else from this script's own #$ directives.
job_resource_list() {
  local line
  if [ -n "${JOB_ID:-}" ] && [ -n "${SGE_ROOT:-}" ] && command -v qstat >/dev/null 2>&1; then
    line="$(qstat -j "${JOB_ID}" 2>/dev/null | awk -F': *' '/^hard resource_list:/ {print $2; exit}')" || line=""
    if [ -n "${line}" ]; then echo "${line// /}"; return 0; fi
  fi
  sed -n 's/^#\$[[:space:]]*-l[[:space:]]*//p' "${JOB_SCRIPT_PATH}" | tr '\n' ',' | tr -d ' '
}

# value of NAME in a resource list "a=1,b=2" (empty when absent)
resource_value() {
  tr ',' '\n' <<<"$2" | awk -F= -v k="$1" '$1 == k {print $2; exit}'
}

resource_type_of() {
  tr ',' '\n' <<<"$1" | awk -F= '$1 ~ /^rt_/ {print $1; exit}'
}

# The hosts of this job, one each: ABCI's $SGE_JOB_HOSTLIST, else $PE_HOSTFILE, else this host.
job_hosts() {
  if [ -n "${SGE_JOB_HOSTLIST:-}" ]; then
    awk 'NF && !seen[$1]++ {print $1}' "${SGE_JOB_HOSTLIST}"
  elif [ -n "${PE_HOSTFILE:-}" ] && [ -r "${PE_HOSTFILE}" ]; then
    awk 'NF && !seen[$1]++ {print $1}' "${PE_HOSTFILE}"
  else
    hostname
  fi
}

# Rank 0 runs on the first host. On ABCI its InfiniBand bond (bond0) is the address the other
# nodes reach; elsewhere (or when this is not the first host) use the first host's name.
master_addr_for() {
  local first="$1" addr=""
  if [ "${first%%.*}" = "$(hostname -s)" ] && command -v ip >/dev/null 2>&1; then
    addr="$(ip -4 -o addr show dev "${MASTER_IFACE}" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')" || addr=""
  fi
  echo "${addr:-${first}}"
}

# Write "host slots=N" lines under a temporary name, then rename (never a half-written file).
write_hostfile() {
  local path="$1" slots="$2" host
  shift 2
  for host in "$@"; do printf '%s slots=%s\n' "${host}" "${slots}"; done >"${path}.tmp"
  mv -f "${path}.tmp" "${path}"
}

# Variables every rank needs, passed with -x: the required four plus those set here.
mpirun_exports() {
  local v
  MPI_EXPORTS=(-x MASTER_ADDR -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH)
  for v in ${MPI_EXPORT_VARS}; do
    if [ -n "${!v+set}" ]; then MPI_EXPORTS+=(-x "${v}"); fi
  done
}

run_abci_job() {
  local resources rt h_rt limit_s hosts nhosts hostfile extra_mpi
  load_abci_modules
  activate_project_env
  resources="$(job_resource_list)"
  rt="${RESOURCE_TYPE:-$(resource_type_of "${resources}")}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-$(gpus_for_resource_type "${rt:-rt_F}")}"
  h_rt="${H_RT:-$(resource_value h_rt "${resources}")}"
  limit_s=""
  if [ -n "${h_rt}" ]; then limit_s="$(to_seconds "${h_rt}")"; fi

  if [ -n "${SGE_JOB_HOSTLIST:-}" ] && [ ! -r "${SGE_JOB_HOSTLIST}" ]; then
    launch_die "SGE_JOB_HOSTLIST=${SGE_JOB_HOSTLIST} is not readable"
  fi
  mapfile -t hosts < <(job_hosts)
  nhosts="${#hosts[@]}"
  [ "${nhosts}" -gt 0 ] || launch_die "no hosts in ${SGE_JOB_HOSTLIST:-${PE_HOSTFILE:-the job}}"
  export MASTER_ADDR="${MASTER_ADDR:-$(master_addr_for "${hosts[0]}")}"
  # one port per job id: two jobs sharing a node never collide
  export MASTER_PORT="${MASTER_PORT:-$(job_master_port "${JOB_ID:-0}")}"
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
  hostfile="${HOSTFILE:-${SGE_LOCALDIR:-${TMPDIR:-/tmp}}/hostfile.${JOB_ID:-local}}"
  write_hostfile "${hostfile}" "${GPUS_PER_NODE}" "${hosts[@]}"
  build_train_args "${limit_s}"
  mpirun_exports
  read -r -a extra_mpi <<<"${MPIRUN_ARGS}"

  launch_log "job ${JOB_ID:-?}: ${nhosts} node(s) x ${GPUS_PER_NODE} GPU(s) (${rt:-?}), h_rt=${h_rt:-unknown}, master ${MASTER_ADDR}:${MASTER_PORT}"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "MASTER_ADDR=${MASTER_ADDR}"
    echo "MASTER_PORT=${MASTER_PORT}"
    echo "# hostfile ${hostfile}"
    cat "${hostfile}"
    echo "# command"
  fi
  run_or_print mpirun -np "$((nhosts * GPUS_PER_NODE))" -npernode "${GPUS_PER_NODE}" \
    --hostfile "${hostfile}" "${MPI_EXPORTS[@]}" --mca odls_base_sigkill_timeout "${SAVE_GRACE_SECONDS}" \
    -bind-to none -map-by slot "${extra_mpi[@]}" \
    "${PYTHON:-python}" "${PROJECT_DIR}/pretrain_gpt.py" "${TRAIN_ARGS[@]}"
}
