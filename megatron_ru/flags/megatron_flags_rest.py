"""The rest of the Megatron-LM / Megatron-DeepSpeed vocabulary that ``megatron_flags.TABLE`` classifies: the
flags without effect here and the refused ones that need no code, grouped by the one line that says why (refused:
and what to use instead). Each flag: (flag, arity, parents). ``megatron_flags`` turns every row into a
``MegatronFlag``; tests/fixtures/megatron_vocabulary.tsv lists the whole vocabulary and
tests/unit/test_megatron_vocabulary.py checks that every flag of it that concerns a dense GPT/LLaMA model has one class.

Standard library only (config/ imports nothing above it).
"""
from __future__ import annotations

from typing import Union

NO_EFFECT, REFUSED = "no effect", "refused"

#: (class, why, ((flag, arity, parents), ...))
GROUPS: tuple[tuple[str, str, tuple[tuple[str, Union[int, str], str], ...]], ...] = (
    (REFUSED,
     "see --cpu-offload", (
        ("--activation-offload-fraction", 1, "LM"), ("--checkpoint-in-cpu", 0, "DS"),
        ("--cpu-offloading-num-layers", 1, "LM"), ("--cpu-offloading-retain-pinned-cpu-buffers", 0, "LM"),
        ("--cpu-optimizer", 0, "DS"), ("--cpu_torch_adam", 0, "DS"), ("--delay-offload-until-cuda-graph", 0, "LM"),
        ("--delta-offload-bytes-across-pp-ranks", 1, "LM"), ("--fine-grained-activation-offloading", 0, "LM"),
        ("--fine-grained-offloading-max-inflight-offloads", 1, "LM"), ("--min-offloaded-tensor-size", 1, "LM"),
        ("--offload-modules", "+", "LM"), ("--optimizer-offload-fraction", 1, "LM"),
    )),
    (NO_EFFECT,
     "DeepSpeed activation checkpointing's memory layout: the same result", (
        ("--contigious-checkpointing", 0, "DS"),
    )),
    (NO_EFFECT,
     "a profiling or debugging aid: use torch.profiler or nsys around pretrain_gpt.py", (
        ("--config-logger-dir", 1, "LM"), ("--memory-snapshot-path", 1, "LM"), ("--nvtx-ranges", 0, "LM"),
        ("--profile-backward", 0, "DS"), ("--profile-ranks", "+", "LM, DS"), ("--profile_steps", 1, "DS"),
        ("--pytorch-profiler-collect-callstack", 0, "LM"), ("--pytorch-profiler-collect-chakra", 0, "LM"),
        ("--pytorch-profiler-collect-shapes", 0, "LM"), ("--record-memory-history", 0, "LM"),
        ("--record-shapes", 0, "LM"),
    )),
    (NO_EFFECT,
     "a synchronisation point for debugging: the same result", (
        ("--synchronize-each-layer", 0, "DS"),
    )),
    (REFUSED,
     "ADLR autoresume is not available: use --exit-signal-handler (save and exit on SIGTERM) and resume with "
     "--load", (
        ("--adlr-autoresume", 0, "LM, DS"), ("--adlr-autoresume-interval", 1, "LM, DS"),
    )),
    (REFUSED,
     "loading a checkpoint by DeepSpeed tag is not available: use --ckpt-step N (iteration N of --load)", (
        ("--load-tag", 1, "DS"),
    )),
    (REFUSED,
     "loading a checkpoint without its learning-rate state is not available: use "
     "--override-opt-param-scheduler (the schedule of the flags) or --no-load-optim", (
        ("--no-load-lr-state", 0, "DS"),
    )),
    (REFUSED,
     "Azure ML data download is not available: give local --data-path files", (
        ("--aml-data-download-path", 1, "DS"),
    )),
    (REFUSED,
     "curriculum learning / data-efficiency sampling is not available: order the data in --data-path's blend", (
        ("--data-efficiency-curriculum-learning", 0, "DS"), ("--return-data-index", 0, "DS"),
    )),
    (REFUSED,
     "repeating the data loader is not available: samples are read in one pass per epoch over the shuffled "
     "index", (
        ("--repeated-dataloader", 0, "DS"),
    )),
    (REFUSED,
     "a fixed number of data epochs is not available: use --train-samples or --train-iters", (
        ("--train-data-exact-num-epochs", 1, "DS"),
    )),
    (REFUSED,
     "precomputed index files are not read: the indices are built once and cached in --data-cache-path", (
        ("--train-desc-path", 1, "DS"), ("--train-doc-idx-path", 1, "DS"), ("--train-idx-path", 1, "DS"),
        ("--train-sample-idx-path", 1, "DS"), ("--train-shuffle-idx-path", 1, "DS"),
    )),
    (REFUSED,
     "Hugging Face tokenizers with remote code are not loaded: convert the tokenizer to tokenizer.json and "
     "use --tokenizer-type HuggingFaceTokenizer", (
        ("--trust-remote-code", 0, "LM, DS"),
    )),
    (REFUSED,
     "knowledge distillation is not available: train the model on the data alone", (
        ("--hidden-size-teacher", 1, "DS"), ("--kd", 0, "DS"), ("--kd-alpha-ce", 1, "DS"), ("--kd-beta-ce", 1, "DS"),
        ("--kd-temp", 1, "DS"), ("--load-teacher", 1, "DS"), ("--logits-load-decode-threads", 1, "LM"),
        ("--logits-load-dir", 1, "LM"), ("--logits-load-ignore-errors", 0, "LM"),
        ("--logits-load-kd-loss-alpha", 1, "LM"), ("--logits-load-msc-prefetch-depth", 1, "LM"),
        ("--logits-load-prefetch-factor", 1, "LM"), ("--logits-save-dir", 1, "LM"), ("--logits-save-dtype", 1, "LM"),
        ("--logits-save-top-k", 1, "LM"), ("--logits-save-top-p", 1, "LM"), ("--logits-save-top-p-min-k", 1, "LM"),
        ("--mos", 0, "DS"), ("--num-attention-heads-teacher", 1, "DS"), ("--num-layers-teacher", 1, "DS"),
        ("--reset-iteration", 0, "DS"),
    )),
    (NO_EFFECT,
     "how data-parallel gradients are reduced (Megatron's local DDP or torch DDP): DeepSpeed reduces them "
     "here; the same result", (
        ("--DDP-impl", 1, "DS"),
    )),
    (NO_EFFECT,
     "how or when communication runs (overlap, buffers, streams, transport): the same result", (
        ("--create-all-gather-group", 0, "LM"), ("--ddp-average-in-collective", 0, "LM"),
        ("--ddp-bucket-size", 1, "LM"), ("--ddp-num-buckets", 1, "LM"),
        ("--ddp-pad-buckets-for-high-nccl-busbw", 0, "LM"), ("--defer-embedding-wgrad-compute", 0, "LM"),
        ("--delay-wgrad-compute", 0, "LM"), ("--disable-align-grad-reduce", 0, "LM"),
        ("--disable-symmetric-registration", 0, "LM"), ("--disable-tp-comm-bulk-dgrad", 0, "LM"),
        ("--disable-tp-comm-bulk-wgrad", 0, "LM"), ("--disable-tp-comm-overlap-ag", 0, "LM"),
        ("--disable-tp-comm-overlap-rs", 0, "LM"), ("--disable-tp-comm-split-ag", 0, "LM"),
        ("--disable-tp-comm-split-rs", 0, "LM"), ("--gtp-remat-nccl-ub", 0, "LM"),
        ("--high-priority-stream-groups", "+", "LM"), ("--nccl-communicator-config-path", 1, "LM"),
        ("--no-align-grad-reduce", 0, "LM"), ("--no-align-param-gather", 0, "LM"),
        ("--no-contiguous-buffers-in-local-ddp", 0, "DS"), ("--no-overlap-p2p-communication", 0, "LM"),
        ("--no-tp-comm-bulk-dgrad", 0, "LM"), ("--no-tp-comm-bulk-wgrad", 0, "LM"),
        ("--no-tp-comm-overlap-ag", 0, "LM"), ("--no-tp-comm-overlap-rs", 0, "LM"),
        ("--no-tp-comm-split-ag", 0, "LM"), ("--no-tp-comm-split-rs", 0, "LM"),
        ("--no-use-layer-wise-param-layout", 0, "LM"), ("--overlap-p2p-communication", 0, "DS"),
        ("--overlap-p2p-communication-warmup-flush", 0, "LM"),
        ("--overlap-param-gather-with-optimizer-step", 0, "LM"), ("--pipeline-model-parallel-comm-backend", 1, "LM"),
        ("--sharp-enabled-group", 1, "LM"), ("--symmetric-ar-type", 1, "LM"),
        ("--tp-comm-bootstrap-backend", 1, "LM"), ("--tp-comm-overlap", 0, "LM"), ("--tp-comm-overlap-cfg", 1, "LM"),
        ("--tp-comm-overlap-rs-dgrad", 0, "LM"), ("--train-sync-interval", 1, "LM"), ("--use-nccl-ub", 0, "LM"),
        ("--use-ring-exchange-p2p", 0, "LM, DS"), ("--use-sharp", 0, "LM"), ("--wgrad-deferral-limit", 1, "LM"),
    )),
    (REFUSED,
     "the model here is built when pretrain_gpt.py starts; deferred model-parallel initialisation is a "
     "library hook, not available", (
        ("--lazy-mpu-init", "?", "LM, DS"),
    )),
    (REFUSED,
     "--model-parallel-size was removed from Megatron too: use --tensor-model-parallel-size", (
        ("--model-parallel-size", 1, "LM, DS"),
    )),
    (REFUSED,
     "uneven or hand-placed pipeline stages are not available: layers are split evenly over "
     "--pipeline-model-parallel-size stages (the planner shows the split)", (
        ("--account-for-embedding-in-pipeline-split", 0, "LM"), ("--account-for-loss-in-pipeline-split", 0, "LM"),
        ("--decoder-first-pipeline-num-layers", 1, "LM"), ("--decoder-last-pipeline-num-layers", 1, "LM"),
        ("--pipeline-model-parallel-layout", 1, "LM"), ("--standalone-embedding-stage", 0, "DS"),
    )),
    (NO_EFFECT,
     "weights here are drawn on the CPU from a generator seeded by (--seed, the parameter's name): the same "
     "values on any device and layout", (
        ("--init-model-with-meta-device", 0, "LM"), ("--use-cpu-initialization", 0, "LM, DS"),
    )),
    (REFUSED,
     "different weights per data-parallel replica are not available: every replica starts from the same "
     "weights", (
        ("--data-parallel-random-init", 0, "LM, DS"),
    )),
    (REFUSED,
     "Xavier-uniform initialisation is not available: weights are drawn from N(0, --init-method-std)", (
        ("--init-method-xavier-uniform", 0, "LM, DS"),
    )),
    (REFUSED,
     "--warmup was removed from Megatron too: use --lr-warmup-iters, --lr-warmup-samples or "
     "--lr-warmup-fraction", (
        ("--warmup", 1, "LM, DS"),
    )),
    (NO_EFFECT,
     "a logging switch: it changes nothing that is computed; this scalar is not written here (the train line,"
     " TensorBoard, W&B and metrics.jsonl have what docs/training.md lists)", (
        ("--log-device-memory-used", 0, "LM"), ("--log-energy", 0, "LM"), ("--log-max-attention-logit", 0, "LM"),
        ("--log-memory-interval", 1, "LM"), ("--log-optimizer-states-to-tensorboard", 0, "DS"),
    )),
    (NO_EFFECT,
     "Megatron's timers' barrier: step time is logged here already", (
        ("--no-barrier-with-level-1-timing", 0, "LM, DS"), ("--timing-log-option", 1, "LM, DS"),
    )),
    (NO_EFFECT,
     "the learning rate is written at every --log-interval here (a logging switch)", (
        ("--no-log-learnig-rate-to-tensorboard", 0, "DS"),
    )),
    (NO_EFFECT,
     "the loss scale is written at every --log-interval here (a logging switch)", (
        ("--disable-log-loss-scale-to-tensorboard", 0, "LM"), ("--no-log-loss-scale-to-tensorboard", 0, "LM, DS"),
    )),
    (NO_EFFECT,
     "TensorBoard is written at every --log-interval here (a logging switch)", (
        ("--tensorboard-log-interval", 1, "LM, DS"), ("--tensorboard-queue-size", 1, "LM, DS"),
    )),
    (NO_EFFECT,
     "writes a progress file for job chaining: a logging switch; the train line says the iteration", (
        ("--log-progress", 0, "LM"),
    )),
    (NO_EFFECT,
     "a monitoring or telemetry service: it changes nothing that is computed; not sent here", (
        ("--app-tag-run-name", 1, "LM"), ("--app-tag-run-version", 1, "LM"),
        ("--disable-straggler-on-startup", 0, "LM"), ("--log-straggler", 0, "LM"), ("--no-one-logger", 0, "LM"),
        ("--one-logger-async", 0, "LM"), ("--one-logger-project", 1, "LM"), ("--one-logger-run-name", 1, "LM"),
        ("--otel-enabled", 0, "LM"), ("--otel-service-name", 1, "LM"), ("--otel-span-groups", 1, "LM"),
        ("--run-workload-inspector-server", 0, "LM"), ("--straggler-ctrlr-port", 1, "LM"),
        ("--straggler-minmax-count", 1, "LM"),
    )),
    (REFUSED,
     "DeepSpeed's tiled / scattered memory optimisations are not available: use --zero-stage 3 or recompute", (
        ("--memory-centric-tiled-linear", 0, "DS"), ("--scattered-embeddings", 0, "DS"),
        ("--split-transformers", 0, "DS"), ("--tile-factor", 1, "DS"),
    )),
    (REFUSED,
     "a lower-precision cross entropy is not available: the loss is computed in fp32", (
        ("--fp16-lm-cross-entropy", 0, "LM, DS"),
    )),
    (REFUSED,
     "an fp32 residual stream is not available: the residual is kept in the training precision", (
        ("--fp32-residual-connection", 0, "LM, DS"),
    )),
    (REFUSED,
     "fp32 embedding weights under fp16/bf16 are not available: use fp32 training or --bf16", (
        ("--embedding-weights-in-fp32", 0, "DS"),
    )),
    (REFUSED,
     "this architecture variant is not available: megatron_ru's GPT/LLaMA block (docs/model.md) "
     "(pre-LayerNorm residuals)", (
        ("--apply-residual-connection-post-layernorm", 0, "LM, DS"),
    )),
    (NO_EFFECT,
     "a LayerNorm kernel choice: the same result", (
        ("--disable-mem-efficient-ln", 0, "DS"),
    )),
    (REFUSED,
     "a kill-switch file is not available: use --exit-signal-handler (SIGTERM/SIGUSR1 save and exit)", (
        ("--kill-switch-file", 1, "DS"),
    )),
    (NO_EFFECT,
     "an ONNX export switch (how GELU is written for export): the same training", (
        ("--onnx-safe", 1, "LM, DS"),
    )),
    (REFUSED,
     "this architecture variant is not available: megatron_ru's GPT/LLaMA block (docs/model.md) (GELU, or "
     "SwiGLU with --swiglu)", (
        ("--activation-func-clamp-value", 1, "LM"), ("--attention-output-gate", 0, "LM"),
        ("--no-rope-freq", 1, "LM"), ("--no-yarn-correction-range-round-to-int", 0, "LM"),
        ("--openai-gelu", 0, "LM, DS"), ("--qk-l2-norm", 0, "LM"),
        ("--quick-geglu", 0, "LM"), ("--rotary-interleaved", 0, "LM"),
        ("--rotary-seq-len-interpolation-factor", 1, "LM"), ("--squared-relu", 0, "LM, DS"),
        ("--window-size", 1, "LM"), ("--yarn-beta-fast", 1, "LM"),
        ("--yarn-beta-slow", 1, "LM"), ("--yarn-correction-range-round-to-int", 0, "LM"),
        ("--yarn-original-max-position-embeddings", 1, "LM"),
    )),
    (REFUSED,
     "weight decay on the --qk-layernorm weights is not available: they take none, as every norm weight", (
        ("--apply-wd-to-qk-layernorm", 0, "LM"),
    )),
    (REFUSED,
     "a weight-decay schedule is not available: weight decay is the constant --weight-decay", (
        ("--end-weight-decay", 1, "LM, DS"), ("--start-weight-decay", 1, "LM, DS"),
    )),
    (REFUSED,
     "--batch-size was removed from Megatron too: use --micro-batch-size", (
        ("--batch-size", 1, "LM, DS"),
    )),
    (NO_EFFECT,
     "read only with CPU offload, which is refused", (
        ("--no-pin-cpu-grads", 0, "LM"), ("--no-pin-cpu-params", 0, "LM"),
        ("--overlap-cpu-optimizer-d2h-h2d", 0, "LM"), ("--use-pin-memory", 0, "DS"),
        ("--use-torch-optimizer-for-cpu-offload", 0, "LM"),
    )),
    (NO_EFFECT,
     "a fused Adam kernel: the same update (--adam-implementation chooses torch's)", (
        ("--ds_fused_adam", 0, "DS"),
    )),
    (REFUSED,
     "DeepSpeed's FPDT (chunked, offloaded Ulysses) is not available: --ds-sequence-parallel-size N (Ulysses: "
     "--context-parallel-size N --cp-comm-type a2a) or the ring (--context-parallel-size N) runs", (
        ("--ds-sequence-parallel-fpdt", 0, "DS"), ("--ds-sequence-parallel-fpdt-chunk-size", 1, "DS"),
        ("--ds-sequence-parallel-fpdt-offloading", 0, "DS"), ("--force-ds-sequence-parallel", 0, "DS"),
    )),
    (REFUSED,
     "zero-bubble pipeline schedules are not available: DeepSpeed's 1F1B schedule runs here", (
        ("--enable-zbh1-exact-semantics", 0, "DS"), ("--enable-zbh1-pipeline", 0, "DS"),
    )),
    (REFUSED,
     "random layerwise token dropping is not available: every token runs through every layer", (
        ("--random-ltd", 0, "DS"),
    )),
    (REFUSED,
     "building only the dataset is not available: tools/preprocess_data.py builds .bin/.idx and the first "
     "training run caches the indices", (
        ("--use-dataset-only", 1, "DS"),
    )),
    (NO_EFFECT,
     "see --use-flash-attn", (
        ("--flash-attention-version", 1, "LM"), ("--use-flash-attn-builder", 0, "DS"),
        ("--use-flash-attn-triton", 0, "DS"), ("--use-flash-attn-v1", 0, "DS"),
    )),
    (REFUSED,
     "this low-precision setting (FP4, MXFP8, TransformerEngine's delayed FP8 scaling and its knobs) is not "
     "available: use --fp8-format with --fp8-recipe tensorwise or rowwise (torchao), or --bf16", (
        ("--disable-fp8-wgrad", 0, "LM"), ("--first-last-layers-bf16", 0, "LM"), ("--fp4-format", 1, "LM"),
        ("--fp4-param-gather", 0, "LM"), ("--fp4-quantizer-factory", 1, "LM"), ("--fp4-recipe", 1, "LM"),
        ("--fp8-amax-compute-algo", 1, "LM, DS"), ("--fp8-amax-history-len", 1, "LM, DS"),
        ("--fp8-interval", 1, "LM, DS"), ("--fp8-margin", 1, "LM, DS"),
        ("--fp8-output-proj", 0, "LM"), ("--fp8-quantizer-factory", 1, "LM"),
        ("--keep-fp8-transpose-cache", 0, "LM"), ("--kitchen-attention-backend", 1, "LM"),
        ("--no-fp8-wgrad", 0, "LM, DS"), ("--num-layers-at-end-in-bf16", 1, "LM"),
        ("--num-layers-at-start-in-bf16", 1, "LM"), ("--reuse-grad-buf-for-mxfp8-param-ag", 0, "LM"),
        ("--te-precision-config-file", 1, "LM"), ("--use-kitchen-attention", 0, "LM"),
    )),
    (REFUSED,
     "evaluation without training is not available: evaluate a checkpoint with tools/ (docs/adaptation.md, "
     "bits per byte)", (
        ("--skip-train", 0, "LM, DS"), ("--test-mode", 0, "LM"),
    )),
    (REFUSED,
     "validation here runs --eval-iters micro batches of the training batch size on the one validation split", (
        ("--eval-global-batch-size", 1, "LM"), ("--eval-micro-batch-size", 1, "LM"), ("--full-validation", 0, "LM"),
        ("--multiple-validation-sets", 0, "LM"), ("--start-eval-at-iter", 1, "LM"),
        ("--validation-set-names", "+", "LM"),
    )),
    (NO_EFFECT,
     "DeepSpeed's ZeRO communication buckets: how gradients travel, the same result (set them in "
     "--deepspeed-config)", (
        ("--zero-allgather-bucket-size", 1, "DS"), ("--zero-contigious-gradients", 0, "DS"),
        ("--zero-reduce-bucket-size", 1, "DS"), ("--zero-reduce-scatter", 0, "DS"),
    )),
    (REFUSED,
     "ZeRO offload to CPU or NVMe is not available: use --zero-stage 3 on the devices", (
        ("--remote-device", 1, "DS"),
    )),
    (REFUSED,
     "in-process restart is not available: a failed job exits and resumes from its latest checkpoint with "
     "--load (--exit-signal-handler saves before a scheduler's kill)", (
        ("--inprocess-active-world-size", 1, "LM"), ("--inprocess-barrier-timeout", 1, "LM"),
        ("--inprocess-completion-timeout", 1, "LM"), ("--inprocess-empty-cuda-cache", 0, "LM"),
        ("--inprocess-granularity", 1, "LM"), ("--inprocess-hard-timeout", 1, "LM"),
        ("--inprocess-heartbeat-interval", 1, "LM"), ("--inprocess-heartbeat-timeout", 1, "LM"),
        ("--inprocess-last-call-wait", 1, "LM"), ("--inprocess-max-iterations", 1, "LM"),
        ("--inprocess-monitor-process-interval", 1, "LM"), ("--inprocess-monitor-thread-interval", 1, "LM"),
        ("--inprocess-progress-watchdog-interval", 1, "LM"), ("--inprocess-restart", 0, "LM"),
        ("--inprocess-soft-timeout", 1, "LM"), ("--inprocess-termination-grace-time", 1, "LM"),
    )),
    (REFUSED,
     "NVIDIA's fault-tolerance package is not available: resume from the latest checkpoint with --load", (
        ("--calc-ft-timeouts", 0, "LM"), ("--enable-ft-package", 0, "LM"), ("--ft-num-warmup-iters", 1, "LM"),
    )),
    (REFUSED,
     "fault injection is not available: the fault matrix in docs/training.md tests megatron_ru's recovery", (
        ("--fault-injector-delay-start-iteration", 1, "LM"), ("--fault-injector-fault-delay", 1, "LM"),
        ("--fault-injector-fault-probabilities", 1, "LM"), ("--fault-injector-fault-types", 1, "LM"),
        ("--fault-injector-mtti-seconds", 1, "LM"), ("--fault-injector-num-ranks", 1, "LM"),
        ("--fault-injector-offset-seconds", 1, "LM"), ("--fault-injector-ranks", 1, "LM"),
        ("--fault-injector-seed", 1, "LM"),
    )),
    (REFUSED,
     "the Multi-Storage Client (object-storage paths) is not available: give local or shared file-system "
     "paths", (
        ("--enable-msc", 0, "LM"), ("--object-storage-cache-path", 1, "LM"),
    )),
    (NO_EFFECT,
     "turns off the Multi-Storage Client, which is never used here", (
        ("--disable-msc", 0, "LM"),
    )),
    (NO_EFFECT,
     "which dropout RNG tracker implementation: megatron_ru keeps its own tensor-parallel RNG states", (
        ("--te-rng-tracker", 0, "LM"),
    )),
    (NO_EFFECT,
     "checkpoints are written synchronously here: the same files, later", (
        ("--async-ckpt-cpu-priority", 1, "LM"), ("--async-ckpt-io-priority", 1, "LM"),
        ("--async-ckpt-use-cpu-shm", 0, "LM"), ("--async-save", 0, "LM"), ("--async-strategy", 1, "LM"),
        ("--use-persistent-ckpt-worker", 0, "LM"),
    )),
    (NO_EFFECT,
     "how checkpoint files are written or read: megatron_ru has one format, written by each rank for its "
     "slices", (
        ("--auto-detect-ckpt-format", 0, "LM"), ("--ckpt-assume-constant-structure", 0, "LM"),
        ("--ckpt-drop-redundant-extra-state", 0, "LM"), ("--ckpt-fully-parallel-load", 0, "LM"),
        ("--ckpt-fully-parallel-load-exchange-algo", 1, "LM"),
        ("--ckpt-fully-parallel-load-per-rank-objects", 0, "LM"),
        ("--ckpt-fully-parallel-load-process-group", 1, "LM"), ("--ckpt-fully-parallel-save", 0, "LM"),
        ("--ckpt-fully-parallel-save-process-group", 1, "LM"), ("--ckpt-pg-tensors-cache-create", 0, "LM"),
        ("--ckpt-pg-tensors-cache-path", 1, "LM"), ("--disable-ckpt-load-validate-sharding-integrity", 0, "LM"),
        ("--dist-ckpt-format", 1, "LM"), ("--dist-ckpt-optim-fully-reshardable", 0, "LM"),
        ("--dist-ckpt-save-pre-mcore-014", 0, "LM"), ("--dist-ckpt-workers", 1, "LM"),
        ("--distrib-optim-fully-reshardable-mem-efficient", 0, "LM"), ("--no-ckpt-fully-parallel-save", 0, "LM"),
        ("--no-ckpt-load-validate-sharding-integrity", 0, "LM"), ("--use-dist-ckpt", 0, "LM"),
    )),
    (NO_EFFECT,
     "loading here is strict whatever is asked: a missing or unexpected tensor is an error", (
        ("--dist-ckpt-strictness", 1, "LM"),
    )),
    (NO_EFFECT,
     "read only with --use-megatron-fsdp / --use-torch-fsdp2, which are refused", (
        ("--disable-strict-fsdp-dtensor-load", 0, "LM"), ("--enable-full-sharding-in-hsdp", 0, "LM"),
        ("--fsdp-db-use-persist-buf-on-alloc-fail", 0, "LM"), ("--fsdp-double-buffer", 0, "LM"),
        ("--fsdp-manual-registration", 0, "LM"), ("--megatron-fsdp-enable-fine-grained-param-gather", 0, "LM"),
        ("--megatron-fsdp-grad-comm-dtype", 1, "LM"), ("--megatron-fsdp-main-grads-dtype", 1, "LM"),
        ("--megatron-fsdp-main-params-dtype", 1, "LM"), ("--megatron-fsdp-max-pool-double-buffer", 0, "LM"),
        ("--megatron-fsdp-version", 1, "LM"), ("--no-strict-fsdp-dtensor-load", 0, "LM"),
        ("--outer-dp-sharding-strategy", 1, "LM"), ("--suggested-communication-unit-size", 1, "LM"),
        ("--torch-fsdp2-no-reshard-after-forward", 0, "LM"),
    )),
    (NO_EFFECT,
     "copies tokenizer files into the checkpoint: the checkpoint's metadata here records the tokenizer "
     "instead", (
        ("--disable-save-tokenizer-assets", 0, "LM"), ("--no-save-tokenizer-assets", 0, "LM"),
    )),
    (REFUSED,
     "--use-checkpoint-args here takes the tokenizer recorded with the checkpoint; to use another give it "
     "without --use-checkpoint-args", (
        ("--disable-use-tokenizer-model-from-checkpoint-args", 0, "LM"),
        ("--no-use-tokenizer-model-from-checkpoint-args", 0, "LM"),
    )),
    (REFUSED,
     "converting checkpoints inside a training job is not available: use tools/convert_checkpoint.py", (
        ("--ckpt-convert-format", 1, "LM"), ("--ckpt-convert-save", 1, "LM"),
        ("--ckpt-convert-update-legacy-dist-opt-format", 0, "LM"),
    )),
    (REFUSED,
     "loading fp32 master weights separately is not available: a megatron_ru checkpoint holds them and --load"
     " reads them", (
        ("--load-main-params-from-ckpt", 0, "LM"),
    )),
    (REFUSED,
     "non-persistent (local) checkpoints are not available: use --save with --save-interval", (
        ("--non-persistent-ckpt-type", 1, "LM"), ("--non-persistent-global-ckpt-dir", 1, "LM"),
        ("--non-persistent-local-ckpt-algo", 1, "LM"), ("--non-persistent-local-ckpt-dir", 1, "LM"),
        ("--non-persistent-save-interval", 1, "LM"), ("--persistent-save-interval", 1, "LM"),
    )),
    (REFUSED,
     "overriding the loaded iteration is not available: use --finetune (iteration 0) or --ckpt-step", (
        ("--override-ckpt-iteration", 1, "LM"),
    )),
    (REFUSED,
     "a separate pretrained checkpoint is not available: use --load DIR with --finetune", (
        ("--pretrained-checkpoint", 1, "LM"),
    )),
    (REFUSED,
     "checkpoint replication across nodes is not available: write --save to a shared file system", (
        ("--replication", 0, "LM"), ("--replication-factor", 1, "LM"), ("--replication-jump", 1, "LM"),
    )),
    (REFUSED,
     "dumping tensors during training is not available: load a checkpoint with tools/ to inspect weights", (
        ("--dump-param-to-param-group-map", 1, "LM"), ("--save-activations-interval", 1, "LM"),
        ("--save-dgrads-interval", 1, "LM"), ("--save-params-interval", 1, "LM"),
        ("--save-retain-interval", 1, "LM"), ("--save-wgrads-interval", 1, "LM"),
    )),
    (REFUSED,
     "taking the parallel sizes from a checkpoint is not available: give them; --load reads a checkpoint at "
     "any layout", (
        ("--use-mp-args-from-checkpoint-args", 0, "LM"),
    )),
    (REFUSED,
     "a checkpoint integrity check on load is not available: the latest pointer is written last, atomically", (
        ("--verify-integrity", 0, "LM"),
    )),
    (REFUSED,
     "pad tokens are not used here: samples are packed without padding", (
        ("--allow-ambiguous-pad-tokens", 0, "LM"),
    )),
    (NO_EFFECT,
     "how the cached index files are read: the same samples", (
        ("--dataloader-defer-npy-index-mmap", 0, "LM"), ("--dataloader-fast-cache-load", 0, "LM"),
        ("--num-dataset-builder-threads", 1, "LM"),
    )),
    (REFUSED,
     "fill-in-the-middle data transforms are not available: train on the documents as written", (
        ("--fim-data", 0, "LM"), ("--fim-eod-token", 1, "LM"), ("--fim-fragment-rate", 1, "LM"),
        ("--fim-middle-token", 1, "LM"), ("--fim-no-prefix", 1, "LM"), ("--fim-pad-token", 1, "LM"),
        ("--fim-prefix-token", 1, "LM"), ("--fim-rate", 1, "LM"), ("--fim-split-sample", 1, "LM"),
        ("--fim-spm-rate", 1, "LM"), ("--fim-suffix-token", 1, "LM"),
    )),
    (REFUSED,
     "changing the blend's oversampling margin is not available: the blend is built with Megatron's default "
     "margin", (
        ("--mid-level-dataset-surplus", 1, "LM"),
    )),
    (REFUSED,
     "precomputed per-dataset sequence counts are not read: the indices are built and cached in "
     "--data-cache-path", (
        ("--per-dataset-sequences-path", 1, "LM"),
    )),
    (REFUSED,
     "data phases are not available: one blend per run; continue from a checkpoint with another --data-path", (
        ("--phase-transition-iterations", 1, "LM"),
    )),
    (REFUSED,
     "hierarchical and hybrid context parallelism are not available: one CP group per sample with "
     "--cp-comm-type p2p or a2a", (
        ("--hierarchical-context-parallel-sizes", "+", "LM"), ("--hybrid-context-parallel", 0, "LM"),
        ("--max-seqlen-per-dp-cp-rank", 1, "LM"),
    )),
    (REFUSED,
     "gradient reduction in fp32 for chosen parameters is not available: gradients are reduced in fp32 under "
     "--bf16 (unless --grad-reduce-in-bf16)", (
        ("--ddp-param-name-patterns-for-fp32-local-accumulation", "+", "LM"),
        ("--ddp-reduce-scatter-with-fp32-accumulation", 0, "LM"),
        ("--gtp-remat-reduce-scatter-with-fp32-accumulation", 0, "LM"),
    )),
    (REFUSED,
     "generalized tensor-parallel weight rematerialisation is not available: use --tensor-model-parallel-size", (
        ("--gtp-remat-opt-in-modules", "+", "LM"), ("--tensor-parallel-num-weight-shards", 1, "LM"),
    )),
    (NO_EFFECT,
     "NCCL's flight recorder (a debugging dump on hangs): megatron_ru's own timeout names the stuck rank", (
        ("--disable-flight-recorder-dump-on-timeout", 0, "LM"),
        ("--disable-flight-recorder-extra-dump-on-exec", 0, "LM"),
        ("--disable-flight-recorder-include-only-active", 0, "LM"), ("--flight-recorder-dump-path", 1, "LM"),
        ("--flight-recorder-include-stack-trace", 0, "LM"), ("--flight-recorder-trace-buffer-size", 1, "LM"),
        ("--no-flight-recorder-dump-on-timeout", 0, "LM"), ("--no-flight-recorder-extra-dump-on-exec", 0, "LM"),
        ("--no-flight-recorder-include-only-active", 0, "LM"),
    )),
    (NO_EFFECT,
     "the process groups here use the one backend chosen for the device (NCCL on GPUs, gloo on CPU)", (
        ("--disable-gloo-process-groups", 0, "LM"),
    )),
    (NO_EFFECT,
     "a kernel or launch choice (fused, CUDA graphs, JIT, TE op fuser): the same result, computed another way", (
        ("--cross-entropy-fusion-impl", 1, "LM"), ("--cuda-graph-impl", 1, "LM"),
        ("--cuda-graph-warmup-steps", 1, "LM"), ("--disable-clone-scatter-output-in-embedding", 0, "LM"),
        ("--disable-jit-fuser", 0, "LM"), ("--enable-cuda-graph", 0, "LM"), ("--external-cuda-graph", 0, "LM"),
        ("--fused-residual-rmsnorm", 0, "LM"), ("--mlp-chunks-for-training", 1, "LM"),
        ("--no-clone-scatter-output-in-embedding", 0, "LM"), ("--no-gradient-reduce-div-fusion", 0, "LM"),
        ("--optimizer-cuda-graph", 0, "LM"), ("--use-grouped-gemm-for-dense-mlp", 0, "LM"),
        ("--use-te-activation-func", 0, "LM"), ("--use-transformer-engine-op-fuser", 0, "LM"),
    )),
    (REFUSED,
     "a different distributed-timeout after start-up is not available: use --distributed-timeout-minutes", (
        ("--distributed-timeout-seconds-after-init", 1, "LM"),
    )),
    (REFUSED,
     "a fake process group is not available: run on CPU with gloo ranks for tests", (
        ("--fake-process-group", 0, "LM"),
    )),
    (REFUSED,
     "see --num-layers-per-virtual-pipeline-stage", (
        ("--num-virtual-stages-per-pipeline-rank", 1, "LM"),
    )),
    (NO_EFFECT,
     "read only with virtual pipeline stages, which are refused", (
        ("--microbatch-group-size-per-virtual-pipeline-stage", 1, "LM"),
    )),
    (REFUSED,
     "partial optimizer sharding (several distributed-optimizer instances) is not available: use --zero-stage", (
        ("--num-distributed-optimizer-instances", 1, "LM"),
    )),
    (REFUSED,
     "rank order here is Megatron's default (tensor, data, pipeline): the tp-pp-dp order is not available", (
        ("--use-tp-pp-dp-mapping", 0, "LM"),
    )),
    (NO_EFFECT,
     "turns on Megatron's experimental code paths; none are switched by it here", (
        ("--enable-experimental", 0, "LM"),
    )),
    (REFUSED,
     "an optimizer state or master weights in another precision is not available: Adam's moments, the master "
     "weights and the main gradients are fp32 here", (
        ("--use-precision-aware-optimizer", 0, "LM"),
    )),
    (REFUSED,
     "a custom layer spec module is not available: the model is megatron_ru's GPT/LLaMA description", (
        ("--spec", "*", "LM"),
    )),
    (REFUSED,
     "a YAML configuration is not available: give the flags on the command line", (
        ("--yaml-cfg", 1, "LM"),
    )),
    (REFUSED,
     "freezing every layer is not available: use --freeze PATTERN (canonical names) or "
     "--train-only-embeddings", (
        ("--freeze-all-layers", 0, "LM"),
    )),
    (REFUSED,
     "the W&B entity (team) is taken from the W&B login here: set WANDB_ENTITY", (
        ("--wandb-entity", 1, "LM"),
    )),
    (REFUSED,
     "Python's logging level is not set by a flag here: rank 0 logs INFO; the banner's debug record needs "
     "MEGATRON_RU_LOG_LEVEL", (
        ("--logging-level", 1, "LM"),
    )),
    (REFUSED,
     "logits in another precision are not available: the loss is computed in fp32 from the training "
     "precision's logits", (
        ("--output-logit-dtype", 1, "LM"),
    )),
    (NO_EFFECT,
     "read only by an --optimizer megatron_ru does not offer (it offers adam and sgd; others are refused)", (
        ("--lion-beta1", 1, "LM"), ("--lion-beta2", 1, "LM"), ("--muon-coefficient-type", 1, "LM"),
        ("--muon-extra-scale-factor", 1, "LM"), ("--muon-fp32-matmul-prec", 1, "LM"), ("--muon-momentum", 1, "LM"),
        ("--muon-nesterov", 0, "LM"), ("--muon-no-split-qkv", 0, "LM"), ("--muon-num-ns-steps", 1, "LM"),
        ("--muon-scalar-optimizer", 1, "LM"), ("--muon-scale-mode", 1, "LM"), ("--muon-tp-mode", 1, "LM"),
        ("--muon-use-syrk", 0, "LM"),
    )),
    (REFUSED,
     "choosing which parameters get weight decay is not available: biases and norm weights get none, every "
     "other weight --weight-decay (Megatron's default)", (
        ("--no-weight-decay-cond-type", 1, "LM"),
    )),
    (REFUSED,
     "Megatron's rerun state machine (result checks, error injection) is not available", (
        ("--error-injection-rate", 1, "LM"), ("--error-injection-type", 1, "LM"),
        ("--result-rejected-tracker-filename", 1, "LM"),
    )),
    (REFUSED,
     "a check that stops training on a suspicious loss or gradient is not available: NaN/Inf losses stop the "
     "run", (
        ("--check-for-large-grads", 0, "LM"), ("--check-for-spiky-loss", 0, "LM"),
    )),
    (NO_EFFECT,
     "the NaN/Inf check: a NaN or Inf loss stops the run here whatever is asked", (
        ("--no-check-for-nan-in-loss-and-grad", 0, "LM"),
    )),
    (REFUSED,
     "this tokenizer option is not available: the tokenizer is loaded as --tokenizer-type names it", (
        ("--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", 0, "LM"),
        ("--no-tokenizer-sentencepiece-ignore-extra-whitespaces", 0, "LM"), ("--null-tokenizer-eod-id", 1, "LM"),
        ("--null-tokenizer-pad-id", 1, "LM"), ("--tiktoken-num-special-tokens", 1, "LM"),
        ("--tokenizer-hf-no-include-special-tokens", 0, "LM"), ("--tokenizer-hf-no-use-fast", 0, "LM"),
        ("--tokenizer-metadata", 1, "LM"), ("--tokenizer-sentencepiece-legacy", 0, "LM"),
        ("--tokenizer-special-tokens", "+", "LM"), ("--use-gigatoken", 0, "LM"),
    )),
    (REFUSED,
     "the vocabulary is always padded here to a multiple of --make-vocab-size-divisible-by x TP: use that "
     "flag", (
        ("--disable-pad-vocab-size", 0, "LM"), ("--no-pad-vocab-size", 0, "LM"), ("--padded-vocab-size", 1, "LM"),
    )),
    (REFUSED,
     "a check of the data-parallel replicas' weights is not available: DeepSpeed keeps them equal", (
        ("--check-weight-hash-across-dp-replicas-interval", 1, "LM"),
    )),
    (REFUSED,
     "changing the batch size on its own is not available: give --global-batch-size and --micro-batch-size "
     "that divide", (
        ("--decrease-batch-size-if-needed", 0, "LM"),
    )),
    (REFUSED,
     "Megatron-LM's schedule of batch sizes at sample thresholds is not available: use --rampup-batch-size START "
     "INCREMENT SAMPLES (Megatron's linear ramp to --global-batch-size)", (
        ("--step-batch-size-schedule", 1, "LM"),
    )),
    (NO_EFFECT,
     "Python's garbage collector or the CUDA cache: when memory is freed, not what is computed", (
        ("--disable-manual-gc-eval", 0, "LM"), ("--no-manual-gc-eval", 0, "LM"),
    )),
    (REFUSED,
     "exit on another signal is not available: --exit-signal-handler saves and exits on SIGTERM and SIGUSR1", (
        ("--exit-signal", 1, "LM"),
    )),
    (REFUSED,
     "a GPU health test is not available", (
        ("--gpu-sniff-test-interval", 1, "LM"),
    )),
    (REFUSED,
     "skipping iterations is not available: the data order follows --seed; continue from a checkpoint", (
        ("--iterations-to-skip", "+", "LM"),
    )),
    (NO_EFFECT,
     "query-key layer scaling is a fp16 overflow guard that does not change the attention scores; it is not "
     "applied here", (
        ("--apply-query-key-layer-scaling", 0, "LM"),
    )),
    (REFUSED,
     "batch-invariant or deterministic kernels are not available: torch's kernels run as torch chooses", (
        ("--batch-invariant-backend", 1, "LM"), ("--batch-invariant-mode", 0, "LM"),
        ("--deterministic-mode", 0, "LM"),
    )),
    (REFUSED,
     "reduced-precision bf16 matmul reductions are torch's default here and not switched", (
        ("--disable-bf16-reduced-precision-matmul", 0, "LM"),
    )),
    (REFUSED,
     "recomputing a chosen list of modules is not available: --recompute-granularity selective recomputes the core "
     "attention, full every layer", (
        ("--recompute-modules", "+", "LM"),
    )),
    (REFUSED,
     "Megatron's manifold hyper-connections are not available: hyper-connections (several residual streams) "
     "are not available: one residual stream per layer", (
        ("--enable-mhc-connections", 0, "LM"), ("--mhc-init-gating-factor", 1, "LM"),
        ("--mhc-num-residual-streams", 1, "LM"), ("--mhc-recompute-layer-num", 1, "LM"),
        ("--mhc-sinkhorn-iterations", 1, "LM"),
    )),
    (REFUSED,
     "multi-token prediction heads are not available: next-token prediction only", (
        ("--mtp-detach-heads", 0, "LM"), ("--mtp-hsm", 0, "LM"), ("--mtp-hybrid-override-pattern", 1, "LM"),
        ("--mtp-loss-scaling-factor", 1, "LM"), ("--mtp-num-layers", 1, "LM"), ("--mtp-standalone", 0, "LM"),
        ("--mtp-use-repeated-layer", 0, "LM"),
    )),
    (REFUSED,
     "muP (maximal update parametrisation) is not available: use --init-method-std and --lr", (
        ("--mup-attn-scale-power", 1, "LM"), ("--mup-base-head-dim", 1, "LM"), ("--mup-base-hidden-size", 1, "LM"),
        ("--mup-embedding-mult", 1, "LM"), ("--mup-output-mult", 1, "LM"), ("--mup-width-mult", 1, "LM"),
        ("--use-mup", 0, "LM"),
    )),
    (REFUSED,
     "QK-clip (rescaling query/key weights after the step) is not available", (
        ("--qk-clip", 0, "LM"), ("--qk-clip-alpha", 1, "LM"), ("--qk-clip-threshold", 1, "LM"),
    )),
    (REFUSED,
     "document-aware attention over packed documents: see --reset-attention-mask", (
        ("--dataloader-inter-document-masking", 0, "LM"),
    )),
    (NO_EFFECT,
     "Megatron's rerun state machine re-runs a step whose loss is NaN to tell a fault from a bug; here a "
     "NaN/Inf loss stops the run", (
        ("--rerun-mode", 1, "LM"),
    )),
)
