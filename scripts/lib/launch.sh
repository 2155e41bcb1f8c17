# shellcheck shell=bash
# Shared by the job scripts in scripts/abci and scripts/slurm (sourced, not run). It turns the
# settings block at the top of a job script into pretrain_gpt.py's arguments, decides between
# resuming and starting from an initial checkpoint, and derives --exit-duration-in-mins from
# the job's time limit so the job saves before the scheduler kills it.

# Print a message on stderr, prefixed so it stands out in the job log.
launch_log() { printf '[launch] %s\n' "$*" >&2; }
launch_die() { printf '[launch] error: %s\n' "$*" >&2; exit 2; }

# A time limit as seconds: accepts SECONDS, M:S, H:M:S and Slurm's D-H:M:S / D-H.
to_seconds() {
  local value="$1" days=0 rest h=0 m=0 s=0
  case "${value}" in
    *-*) days="${value%%-*}"; rest="${value#*-}" ;;
    *) rest="${value}" ;;
  esac
  IFS=: read -r -a parts <<<"${rest}"
  case "${#parts[@]}" in
    1) if [ "${value}" != "${rest}" ]; then h="${parts[0]}"; else s="${parts[0]}"; fi ;;
    2) m="${parts[0]}"; s="${parts[1]}" ;;
    3) h="${parts[0]}"; m="${parts[1]}"; s="${parts[2]}" ;;
    *) launch_die "cannot read the time limit '${value}' (expected H:M:S)" ;;
  esac
  for v in "${days}" "${h}" "${m}" "${s}"; do
    [[ "${v}" =~ ^[0-9]+$ ]] || launch_die "cannot read the time limit '${value}' (expected H:M:S)"
  done
  echo $(( ((10#${days} * 24 + 10#${h}) * 60 + 10#${m}) * 60 + 10#${s} ))
}

# Minutes of training to allow in a job of LIMIT seconds, keeping MARGIN seconds to save and
# exit. Short jobs (debug queues, tests) keep at least a tenth of their time for training.
exit_duration_mins() {
  local limit="$1" margin="$2" usable
  usable=$(( limit - margin ))
  if [ "${usable}" -lt $(( limit / 10 )) ]; then usable=$(( limit / 10 )); fi
  awk -v s="${usable}" 'BEGIN { printf "%.2f\n", s / 60 }'
}

# Activate the project's virtual environment when there is one (a container brings its own).
activate_project_env() {
  local venv="${VENV:-${PROJECT_DIR}/.venv}"
  if [ -f "${venv}/bin/activate" ]; then
    # shellcheck disable=SC1091
    source "${venv}/bin/activate"
    launch_log "python environment: ${venv}"
  else
    launch_log "no virtual environment at ${venv}; using $(command -v "${PYTHON:-python}" || echo "${PYTHON:-python}")"
  fi
}

# MASTER_PORT of a job id: 15000 + id % 16384 (15000-31383), below Linux's ephemeral port range
# (32768-60999) so the port is never already taken by an outgoing connection, and distinct for
# jobs whose ids differ by less than 16384. Slurm and ABCI jobs both use it, and so does
# megatron_ru/parallel/env.py (SLURM_PORT_BASE, SLURM_PORT_SPAN) for a task started without MASTER_PORT.
job_master_port() { echo $(( 15000 + $1 % 16384 )); }

has_checkpoint() { [ -f "$1/latest_checkpointed_iteration.txt" ]; }

# Fill the array TRAIN_ARGS from the settings variables. Argument: the job's time limit in
# seconds (empty when unknown: no --exit-duration-in-mins).
build_train_args() {
  local limit_s="${1:-}" words
  TRAIN_ARGS=(
    --seq-length "${SEQ_LENGTH}"
    --global-batch-size "${GLOBAL_BATCH_SIZE}"
    --train-iters "${TRAIN_ITERS}"
    --lr "${LR}"
    --min-lr "${MIN_LR}"
    --lr-decay-style "${LR_DECAY_STYLE}"
    --lr-warmup-iters "${LR_WARMUP_ITERS}"
    --weight-decay "${WEIGHT_DECAY}"
    --clip-grad "${CLIP_GRAD}"
    --seed "${SEED}"
    --split "${SPLIT}"
    --log-interval "${LOG_INTERVAL}"
    --eval-interval "${EVAL_INTERVAL}"
    --eval-iters "${EVAL_ITERS}"
    --save "${SAVE_DIR}"
    --save-interval "${SAVE_INTERVAL}"
    --exit-signal-handler
  )
  if [ -z "${TP}${PP}" ]; then
    # no layout given: the planner chooses one for this job's GPUs at start-up (and again on a resubmission
    # with another node count); a micro batch or ZeRO stage that is set is kept
    TRAIN_ARGS+=(--auto-layout)
    if [ -n "${MICRO_BATCH_SIZE}" ]; then TRAIN_ARGS+=(--micro-batch-size "${MICRO_BATCH_SIZE}"); fi
    if [ -n "${ZERO_STAGE}" ]; then TRAIN_ARGS+=(--zero-stage "${ZERO_STAGE}"); fi
  else
    TRAIN_ARGS+=(--tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
                 --micro-batch-size "${MICRO_BATCH_SIZE:-${FIXED_LAYOUT_MICRO_BATCH_SIZE:-1}}"
                 --zero-stage "${ZERO_STAGE:-1}")
  fi
  if [ -n "${INIT_CHECKPOINT}" ]; then
    # the model's shape (and, with TOKENIZER_ARGS empty, its tokenizer) is the initial checkpoint's,
    # e.g. a Hugging Face model imported by tools/convert_checkpoint.py; also when resuming from SAVE_DIR
    TRAIN_ARGS+=(--use-checkpoint-args)
  else
    TRAIN_ARGS+=(--num-layers "${NUM_LAYERS}" --hidden-size "${HIDDEN_SIZE}"
                 --num-attention-heads "${NUM_ATTENTION_HEADS}" --max-position-embeddings "${MAX_POSITION_EMBEDDINGS}")
    if [ -n "${FFN_HIDDEN_SIZE}" ]; then TRAIN_ARGS+=(--ffn-hidden-size "${FFN_HIDDEN_SIZE}"); fi
  fi
  case "${PRECISION}" in
    bf16) TRAIN_ARGS+=(--bf16) ;;
    fp16) TRAIN_ARGS+=(--fp16) ;;
    fp32) ;;
    *) launch_die "PRECISION must be bf16, fp16 or fp32 (got '${PRECISION}')" ;;
  esac
  # DATA_PATH may be a blend ("0.7 ja_text_document 0.3 en_text_document"): one word each
  read -r -a words <<<"${DATA_PATH}"
  TRAIN_ARGS+=(--data-path "${words[@]}")
  read -r -a words <<<"${TOKENIZER_ARGS}"
  TRAIN_ARGS+=("${words[@]}")
  read -r -a words <<<"${MODEL_ARGS}"
  TRAIN_ARGS+=("${words[@]}")
  if [ -n "${limit_s}" ]; then
    TRAIN_ARGS+=(--exit-duration-in-mins "$(exit_duration_mins "${limit_s}" "${EXIT_MARGIN_SECONDS}")")
  fi
  # resume-aware: our own checkpoint first, else the initial one (e.g. a converted HF model)
  if has_checkpoint "${SAVE_DIR}"; then
    launch_log "resuming from ${SAVE_DIR} (iteration $(cat "${SAVE_DIR}/latest_checkpointed_iteration.txt"))"
    TRAIN_ARGS+=(--load "${SAVE_DIR}")
  elif [ -n "${INIT_CHECKPOINT}" ]; then
    has_checkpoint "${INIT_CHECKPOINT}" || launch_die "INIT_CHECKPOINT=${INIT_CHECKPOINT} has no latest_checkpointed_iteration.txt"
    launch_log "starting from the initial checkpoint ${INIT_CHECKPOINT} (--finetune)"
    TRAIN_ARGS+=(--load "${INIT_CHECKPOINT}" --finetune)
  else
    launch_log "no checkpoint in ${SAVE_DIR}: training from scratch"
  fi
  read -r -a words <<<"${EXTRA_ARGS}"
  TRAIN_ARGS+=("${words[@]}")
}

# The exact command, one shell-quoted line (what DRY_RUN=1 prints and what the log records).
quoted_command() {
  local word out=""
  for word in "$@"; do
    if [[ "${word}" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="${word} "; else out+="$(printf '%q' "${word}") "; fi
  done
  printf '%s\n' "${out% }"
}

# Identity of the checkpoint pointer in SAVE_DIR (content and modification time), "none" without one.
checkpoint_stamp() {
  local pointer="${SAVE_DIR:-}/latest_checkpointed_iteration.txt"
  if [ -n "${SAVE_DIR:-}" ] && [ -f "${pointer}" ]; then
    printf '%s@%s\n' "$(cat "${pointer}")" "$(stat -c %y "${pointer}")"
  else
    echo none
  fi
}

# Run the command, or print it when DRY_RUN=1. The command runs in the background so that this
# shell can turn the scheduler's warning signals (SIGTERM, SIGUSR1, SIGUSR2) into SIGUSR1 for it:
# mpirun passes SIGUSR1 on to every rank (a SIGTERM would make it kill the ranks after
# odls_base_sigkill_timeout), srun to every task (torchrun, told to handle it, to its workers),
# and pretrain_gpt.py --exit-signal-handler then saves a checkpoint and exits 0.
# The job's status is the launcher's, with one exception: torchrun exits 1 after any signal it
# handled (and mpirun after a SIGTERM it got directly) even when every rank saved and exited 0.
# So when this shell passed a signal on and the launcher then failed, but a new checkpoint was
# completed in SAVE_DIR after the signal (its pointer is written last), the job ends 0.
run_or_print() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    quoted_command "$@"
    return 0
  fi
  launch_log "running: $(quoted_command "$@")"
  "$@" &
  LAUNCH_CHILD=$!
  LAUNCH_STAMP_AT_SIGNAL=""
  trap 'on_launch_signal' TERM USR1 USR2
  local rc=0
  # wait returns early (status > 128) when a trapped signal arrives; wait again until it exits
  while :; do
    rc=0
    wait "${LAUNCH_CHILD}" || rc=$?
    kill -0 "${LAUNCH_CHILD}" 2>/dev/null || break
  done
  trap - TERM USR1 USR2
  if [ "${rc}" -ne 0 ] && [ -n "${LAUNCH_STAMP_AT_SIGNAL}" ] && [ "$(checkpoint_stamp)" != none ] &&
    [ "$(checkpoint_stamp)" != "${LAUNCH_STAMP_AT_SIGNAL}" ]; then
    launch_log "the launcher exited with status ${rc} after the signal, but the ranks saved iteration" \
      "$(cat "${SAVE_DIR}/latest_checkpointed_iteration.txt") in ${SAVE_DIR} after it: ending with status 0"
    rc=0
  fi
  return "${rc}"
}

on_launch_signal() {
  launch_log "signal received: asking every rank to save and exit"
  if [ -z "${LAUNCH_STAMP_AT_SIGNAL}" ]; then LAUNCH_STAMP_AT_SIGNAL="$(checkpoint_stamp)"; fi
  kill -USR1 "${LAUNCH_CHILD}" 2>/dev/null || true
}
