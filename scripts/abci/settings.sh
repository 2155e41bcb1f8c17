# Settings shared by scripts/abci/submit_single_node.sh and submit_multinode.sh (sourced by
# both after PROJECT_DIR is set), so a model or layout is changed in one place.
# shellcheck shell=bash disable=SC2034
# Every value can be overridden from the environment (`qsub -v NAME=VALUE,...` or `qsub -V`);
# an empty value (FFN_HIDDEN_SIZE= MODEL_ARGS=) means "none".
# Model: GPT 345M (Megatron-LM's reference GPT-2 medium).
: "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=1024}" "${NUM_ATTENTION_HEADS:=16}" "${FFN_HIDDEN_SIZE=}"
: "${SEQ_LENGTH:=1024}" "${MAX_POSITION_EMBEDDINGS:=${SEQ_LENGTH}}"
: "${MODEL_ARGS=}"
# LLaMA-2 7B on V100 16 GB (rt_F=4: 16 GPUs):
#   NUM_LAYERS=32 HIDDEN_SIZE=4096 FFN_HIDDEN_SIZE=11008 NUM_ATTENTION_HEADS=32 SEQ_LENGTH=4096
#   TP=4 PP=4 MICRO_BATCH_SIZE=1 GLOBAL_BATCH_SIZE=1024
#   MODEL_ARGS="--swiglu --normalization RMSNorm --position-embedding-type rope
#     --untie-embeddings-and-output-weights --disable-bias-linear --recompute-granularity full"
# LLaMA-2 13B on V100 16 GB (rt_F=8: 32 GPUs; needs micro batch 1, TP 4, PP 8, recomputation):
#   NUM_LAYERS=40 HIDDEN_SIZE=5120 FFN_HIDDEN_SIZE=13824 NUM_ATTENTION_HEADS=40 SEQ_LENGTH=4096
#   TP=4 PP=8 MICRO_BATCH_SIZE=1 GLOBAL_BATCH_SIZE=1024 (MODEL_ARGS as for 7B)
# Layout and optimisation (V100 has no bf16: fp16 with dynamic loss scaling).
# Layout: with TP and PP unset (the default) pretrain_gpt.py --auto-layout chooses TP, PP, CP, sequence
# parallelism, the micro batch, recomputation and the ZeRO stage at start-up for the job's GPUs (the
# planner, docs/planner.md), again on every resubmission, whatever the node count; MICRO_BATCH_SIZE or
# ZERO_STAGE, if set, are kept. Set TP and PP to fix the layout (MICRO_BATCH_SIZE then defaults to 4,
# ZERO_STAGE to 1).
: "${TP=}" "${PP=}" "${ZERO_STAGE=}" "${MICRO_BATCH_SIZE=}" "${FIXED_LAYOUT_MICRO_BATCH_SIZE:=4}"
: "${PRECISION:=fp16}"
: "${GLOBAL_BATCH_SIZE:=256}" "${TRAIN_ITERS:=500000}" "${SEED:=1234}"
: "${LR:=3.0e-4}" "${MIN_LR:=3.0e-5}" "${LR_DECAY_STYLE:=cosine}" "${LR_WARMUP_ITERS:=2000}"
: "${WEIGHT_DECAY:=0.1}" "${CLIP_GRAD:=1.0}"
# Data and tokenizer (DATA_PATH may be a blend: "0.7 prefix_a 0.3 prefix_b").
: "${DATA_PATH:=${PROJECT_DIR}/data/corpus_text_document}" "${SPLIT:=949,50,1}"
: "${TOKENIZER_ARGS=--tokenizer-type GPT2BPETokenizer --vocab-file ${PROJECT_DIR}/data/gpt2-vocab.json --merge-file ${PROJECT_DIR}/data/gpt2-merges.txt}"
# Checkpoints: resume from SAVE_DIR when it has one, else start from INIT_CHECKPOINT (if set).
# INIT_CHECKPOINT (e.g. a Hugging Face model imported by tools/convert_checkpoint.py import-hf) fixes the
# model: its shape flags come from it (--use-checkpoint-args; NUM_LAYERS, HIDDEN_SIZE, NUM_ATTENTION_HEADS,
# FFN_HIDDEN_SIZE and MAX_POSITION_EMBEDDINGS are not passed) and TOKENIZER_ARGS= (empty) uses its tokenizer.
: "${SAVE_DIR:=${PROJECT_DIR}/checkpoints/gpt_345m}" "${INIT_CHECKPOINT=}" "${SAVE_INTERVAL:=1000}"
: "${EXIT_MARGIN_SECONDS:=900}"  # stop training this long before h_rt to save and exit
# After a SIGTERM reaches mpirun itself, it passes it on and SIGKILLs the ranks this long later
# (Open MPI's odls_base_sigkill_timeout, default 1 s: too short to save). mpirun waits about twice
# this long on every abort, also after a rank failed, so keep it modest. (The job shell turns
# the scheduler's signals into SIGUSR1 for mpirun, which kills nothing: no grace needed there.)
: "${SAVE_GRACE_SECONDS:=60}"
: "${LOG_INTERVAL:=10}" "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}"
: "${EXTRA_ARGS=}"  # any further pretrain_gpt.py flags
# Cluster: modules (loaded only where `module` exists), GPUs per node (default: from rt_*).
: "${ABCI_MODULES:=python/3.11 cuda/12.1/12.1.1 cudnn/8.9/8.9.7 nccl/2.18/2.18.5-1 hpcx/2.12}"
: "${GPUS_PER_NODE=}" "${MASTER_IFACE:=bond0}" "${MPIRUN_ARGS=}"
: "${MPI_EXPORT_VARS:=VIRTUAL_ENV PYTHONPATH OMP_NUM_THREADS DS_ACCELERATOR CUDA_DEVICE_MAX_CONNECTIONS NCCL_IB_DISABLE NCCL_DEBUG MEGATRON_RU_LOG_LEVEL TORCH_EXTENSIONS_DIR}"
