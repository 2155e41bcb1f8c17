#!/bin/bash
#$ -l rt_F=2
#$ -l h_rt=24:00:00
#$ -j y
#$ -cwd
#$ -o $JOB_NAME.o$JOB_ID
# Multi-node pretraining on ABCI (Grid Engine): one MPI rank per GPU, ranks discovered by
# megatron_ru from Open MPI's variables (no --use-mpi). Submit from the repository root:
#
#   qsub -g GROUP scripts/abci/submit_multinode.sh
#   qsub -g GROUP -l rt_F=8 -v TP=4,PP=8,MICRO_BATCH_SIZE=1 scripts/abci/submit_multinode.sh
#   DRY_RUN=1 JOB_ID=1 SGE_JOB_HOSTLIST=hosts.txt bash scripts/abci/submit_multinode.sh  # print only
#
# rt_F = one node with 4 x V100 16 GB. For A100 nodes (8 GPUs each) change the line above to
# `#$ -l rt_AF=2`; GPUS_PER_NODE follows the resource type. The job saves a checkpoint and
# exits before h_rt (--exit-duration-in-mins); resubmitting the same script resumes from it.
set -euo pipefail

PROJECT_DIR="${PROJECT_DIR:-${SGE_O_WORKDIR:-${PWD}}}"  # -cwd: where qsub ran
JOB_SCRIPT_PATH="${BASH_SOURCE[0]}"

# Settings (model, layout, data, checkpoints; each overridable from the environment):
# scripts/abci/settings.sh, shared with the other ABCI script.

[ -f "${PROJECT_DIR}/pretrain_gpt.py" ] ||
  { echo "error: ${PROJECT_DIR} is not the megatron_ru checkout: submit from the repository root or set PROJECT_DIR" >&2; exit 2; }
# shellcheck source=scripts/abci/settings.sh
source "${PROJECT_DIR}/scripts/abci/settings.sh"
# shellcheck source=scripts/abci/common.sh
source "${PROJECT_DIR}/scripts/abci/common.sh"
run_abci_job
