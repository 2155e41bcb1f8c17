"""Training, optimizer, checkpoint and logging configuration (Megatron flag names).

Each concern is its own dataclass; ``problems()`` reports what is wrong inside one config,
rules that need several configs live in ``megatron_ru/flags/arguments.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg


@dataclass
class TrainingConfig:
    """Training: batch sizes, length, precision, ZeRO, exit conditions."""

    micro_batch_size: int = arg(1, "Samples per micro batch per data-parallel rank.")
    global_batch_size: Optional[int] = arg(
        None, "Samples per optimizer step over all data-parallel ranks; gradient accumulation = "
              "global / (micro x DP). Default: micro-batch-size x DP (no accumulation).")
    train_iters: Optional[int] = arg(None, "Total optimizer steps to train for.")
    train_samples: Optional[int] = arg(
        None, "Total samples to train for (alternative to --train-iters; converted to iterations "
              "by dividing by --global-batch-size).")
    train_tokens: Optional[int] = arg(
        None, "Megatron-DeepSpeed's token budget: stop (save, as at the end of training) once the tokens consumed "
              "(samples x --seq-length) reach N; --train-iters or --train-samples still bounds the run and sets the "
              "default decay length.")
    rampup_batch_size: Optional[list[int]] = arg(
        None, "Batch-size ramp-up (Megatron's): START INCREMENT SAMPLES. The global batch starts at START and grows by "
              "INCREMENT, in equal shares of the first SAMPLES samples, up to --global-batch-size; each step runs the "
              "batch of the samples consumed before it (docs/training.md). START and INCREMENT are multiples of "
              "--micro-batch-size x DP.", nargs=3, metavar="N")
    seed: int = arg(1234, "Random seed for weights, dropout and data order.")
    eval_interval: int = arg(1000, "Evaluate on the validation set every N iterations (0: never).")
    eval_iters: int = arg(100, "Validation micro-batch steps per evaluation (x global batch samples).")
    exit_interval: Optional[int] = arg(None, "Save and exit when iteration %% N == 0.")
    exit_duration_in_mins: Optional[float] = arg(None, "Save and exit after N minutes of training.")
    exit_signal_handler: bool = arg(
        False, "On SIGTERM/SIGUSR1 (sent by Slurm/ABCI before the time limit) save and exit 0.")
    bf16: bool = arg(False, "Train in bfloat16 (fp32 master weights).")
    fp16: bool = arg(False, "Train in float16 with dynamic loss scaling (GPU only).")
    grad_reduce_in_bf16: bool = arg(
        False, "With --bf16: accumulate and reduce gradients in bfloat16 (DeepSpeed's grad_accum_dtype bf16), as "
               "Megatron-LM's flag; less memory and traffic, fewer digits in the gradient sums. Default: fp32.")
    loss_scale: Optional[float] = arg(None, "Static loss scale for --fp16 (default: dynamic).")
    initial_loss_scale: float = arg(2.0 ** 32, "Initial dynamic loss scale for --fp16.")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale for --fp16.")
    loss_scale_window: int = arg(1000, "Iterations without overflow before the loss scale grows.")
    hysteresis: int = arg(2, "Overflows tolerated before the dynamic loss scale shrinks.")
    calculate_per_token_loss: bool = arg(
        False, "The loss of a step is the mean over every unmasked token of the global batch (all micro batches "
               "and data-parallel ranks; Megatron-LM's flag), not the mean of the micro batches' means. They "
               "differ only with a loss mask (--eod-mask-loss).")
    torch_compile: bool = arg(
        False, "Run each transformer layer (and, at TP 1, the loss) through torch.compile: fused norms, RoPE, "
               "SwiGLU and residual adds; numerics equal the eager reference to rounding, not bit for bit. "
               "The first step pays the compile (tens of seconds).")
    fp8_format: Optional[str] = arg(
        None, "Train the transformer layers' matmuls in FP8 (Megatron-LM's flag) through torchao's float8 training: "
              "e4m3 (every operand e4m3) or hybrid (output gradients e5m2). Master weights, optimizer and checkpoint "
              "format stay as they are; the output head and embedding stay in the training precision. Needs "
              "--bf16 (or fp32) and, on a GPU, compute capability 8.9+ (docs/training.md).", choices=("e4m3", "hybrid"))
    fp8_recipe: str = arg(
        "tensorwise", "With --fp8-format: the scaling, computed from each operand at every step: tensorwise (one "
                      "scale per tensor; under TP the whole tensor's) or rowwise (one per row, TP 1). Megatron-LM's "
                      "'delayed' (TransformerEngine's amax history) is refused: use tensorwise.",
        choices=("tensorwise", "rowwise", "delayed"))
    zero_stage: int = arg(0, "DeepSpeed ZeRO stage (0-3 with PP=1, 0-1 with PP>1).",
                          choices=(0, 1, 2, 3))
    deepspeed: bool = arg(False, "Accepted for Megatron-DeepSpeed scripts; DeepSpeed is always used.")
    deepspeed_config: Optional[str] = arg(
        None, "DeepSpeed JSON config; default: generated from the flags (batch sizes and "
              "precision must agree with the flags).", flags=("--deepspeed_config", "--deepspeed-config"))
    train_only_embeddings: bool = arg(
        False, "Freeze everything except the input embedding and the output layer.")
    freeze: Optional[list[str]] = arg(
        None, "Freeze parameters whose name matches any of these fnmatch patterns "
              "(e.g. 'layers.0.*' '*.norm.weight').")
    train_embedding_rows: str = arg(
        "all", "With --train-only-embeddings: train all vocabulary rows, or only the 'new' rows a vocabulary "
               "adaptation initialised (tools/adapt_vocab.py records them with the checkpoint in --load); the "
               "other rows stay bit-identical, weight decay included.", choices=("all", "new"))

    def problems(self) -> list[str]:
        out = []
        if self.micro_batch_size < 1:
            out.append(f"--micro-batch-size must be >= 1 (got {self.micro_batch_size})")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            out.append(f"--global-batch-size must be >= 1 (got {self.global_batch_size})")
        if self.train_iters is None and self.train_samples is None:
            out.append("set the training length: --train-iters N or --train-samples N")
        if self.train_iters is not None and self.train_samples is not None:
            out.append("--train-iters and --train-samples are exclusive: set only one")
        for name in ("train_iters", "train_samples"):
            v = getattr(self, name)
            if v is not None and v < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1 (got {v})")
        if self.train_tokens is not None and self.train_tokens < 1:
            out.append(f"--train-tokens must be >= 1 (got {self.train_tokens})")
        if self.bf16 and self.fp16:
            out.append("--bf16 and --fp16 are exclusive: choose one precision")
        if self.grad_reduce_in_bf16 and not self.bf16:
            out.append("--grad-reduce-in-bf16 reduces bfloat16 gradients: add --bf16 (or drop the flag)")
        if self.eval_interval < 0 or self.eval_iters < 0:
            out.append("--eval-interval and --eval-iters must be >= 0")
        if self.exit_interval is not None and self.exit_interval < 1:
            out.append(f"--exit-interval must be >= 1 (got {self.exit_interval})")
        if self.loss_scale is not None and self.loss_scale <= 0:
            out.append(f"--loss-scale must be > 0 (got {self.loss_scale})")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            out.append("--initial-loss-scale and --min-loss-scale must be > 0")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            out.append("--loss-scale-window and --hysteresis must be >= 1")
        if self.train_embedding_rows == "new" and not self.train_only_embeddings:
            out.append("--train-embedding-rows new trains part of the embedding and output rows: add "
                       "--train-only-embeddings (everything else frozen)")
        if self.train_only_embeddings and self.freeze:
            out.append("--train-only-embeddings and --freeze are exclusive: use one way to choose "
                       "trainable parameters")
        return out


@dataclass
class OptimizerConfig:
    """Optimizer (AdamW) and learning-rate schedule."""

    optimizer: str = arg("adam", "Optimizer: adam (torch AdamW, decoupled weight decay) or sgd.",
                         choices=("adam", "sgd"))
    lr: float = arg(1e-4, "Peak learning rate (reached at the end of warmup).")
    min_lr: float = arg(0.0, "Learning rate at the end of decay (and after it).")
    decoupled_lr: Optional[float] = arg(
        None, "Peak learning rate of the input word embedding and the output layer (Megatron-LM's): they follow "
              "the same warmup and decay as the other parameters, between --decoupled-lr and --decoupled-min-lr. "
              "The embedding stage of a vocabulary adaptation trains new rows fast and the body slowly with it.")
    decoupled_min_lr: Optional[float] = arg(
        None, "End-of-decay learning rate of the input word embedding and the output layer (with --decoupled-lr; "
              "default --min-lr).")
    lr_decay_style: str = arg("linear", "Decay after warmup. WSD (warmup-stable-decay): --lr until the last "
                                        "--lr-wsd-decay-iters/-samples of the decay length, then down to --min-lr "
                                        "in --lr-wsd-decay-style.", choices=("constant", "linear", "cosine", "WSD"))
    lr_wsd_decay_style: str = arg("exponential", "Shape of WSD's decay phase (Megatron-LM's).",
                                  choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: Optional[int] = arg(None, "Length of WSD's decay phase in iterations.")
    lr_wsd_decay_samples: Optional[int] = arg(None, "Length of WSD's decay phase in samples (divided by the global "
                                                    "batch).")
    lr_warmup_iters: int = arg(0, "Linear warmup length in iterations.")
    lr_warmup_fraction: Optional[float] = arg(
        None, "Warmup length as a fraction of the decay length (exclusive with --lr-warmup-iters).")
    lr_warmup_samples: int = arg(0, "Warmup length in samples (divided by the global batch).")
    lr_decay_iters: Optional[int] = arg(None, "Iterations over which to decay; default: --train-iters.")
    lr_decay_samples: Optional[int] = arg(None, "Decay length in samples (divided by the global batch).")
    lr_decay_tokens: Optional[int] = arg(
        None, "Megatron-DeepSpeed's: decay length in tokens (samples x --seq-length), overriding the iteration/sample "
              "decay; the decay starts where the warmup ends (--lr-warmup-tokens, or the tokens consumed by the "
              "--lr-warmup-iters/-samples/-fraction warmup).")
    lr_warmup_tokens: Optional[int] = arg(
        None, "Megatron-DeepSpeed's: linear warmup length in tokens (samples x --seq-length), overriding the "
              "iteration/sample warmup.")
    weight_decay: float = arg(0.01, "Decoupled weight decay (not applied to biases and norms).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    adam_implementation: str = arg(
        "auto", "torch AdamW kernel: 'fused' (one CUDA kernel over all tensors; the GPU default), 'foreach' "
                "(batched per op) or 'for-loop' (one tensor at a time; the CPU default). Each updates every "
                "element on its own, so any sharding gives the same numbers as one process; 'auto' picks by device.",
        choices=("auto", "fused", "foreach", "for-loop"))
    sgd_momentum: float = arg(0.9, "SGD momentum.")
    clip_grad: float = arg(1.0, "Clip the global gradient norm (over all TP/PP shards) to this; 0: off.")

    def problems(self) -> list[str]:
        out = []
        if self.lr < 0 or self.min_lr < 0:
            out.append("--lr and --min-lr must be >= 0")
        if self.min_lr > self.lr:
            out.append(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            out.append("--decoupled-min-lr needs --decoupled-lr (the peak it decays from)")
        if self.decoupled_lr is not None:
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if self.decoupled_lr < 0 or low < 0:
                out.append("--decoupled-lr and --decoupled-min-lr must be >= 0")
            elif low > self.decoupled_lr:
                out.append(f"the embedding and output layer's end-of-decay learning rate ({low}, --decoupled-min-lr or "
                           f"--min-lr) must not exceed --decoupled-lr ({self.decoupled_lr})")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            out.append("--lr-warmup-iters and --lr-warmup-samples must be >= 0")
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                out.append(f"--lr-warmup-fraction must be in [0, 1] (got {self.lr_warmup_fraction})")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                out.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are "
                           "exclusive: set only one")
        if self.lr_decay_style == "WSD" and (self.lr_wsd_decay_iters is None) == (self.lr_wsd_decay_samples is None):
            out.append("--lr-decay-style WSD needs the length of its decay phase: give one of --lr-wsd-decay-iters and "
                       "--lr-wsd-decay-samples")
        for name, value in (("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
                            ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples)):
            if value is not None and value < 1:
                out.append(f"{name} must be >= 1 (got {value})")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            out.append(f"--lr-decay-iters must be >= 1 (got {self.lr_decay_iters})")
        if self.lr_decay_tokens is not None and self.lr_decay_tokens < 1:
            out.append(f"--lr-decay-tokens must be >= 1 (got {self.lr_decay_tokens})")
        if self.lr_warmup_tokens is not None and self.lr_warmup_tokens < 0:
            out.append(f"--lr-warmup-tokens must be >= 0 (got {self.lr_warmup_tokens})")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            out.append("--adam-beta1 and --adam-beta2 must be in [0, 1)")
        if self.adam_eps <= 0:
            out.append(f"--adam-eps must be > 0 (got {self.adam_eps})")
        if self.weight_decay < 0:
            out.append(f"--weight-decay must be >= 0 (got {self.weight_decay})")
        if self.clip_grad < 0:
            out.append(f"--clip-grad must be >= 0 (got {self.clip_grad}); 0 turns clipping off")
        return out


@dataclass
class CheckpointConfig:
    """Checkpoints: where to save, how often, what to load."""

    save: Optional[str] = arg(None, "Directory to save checkpoints in (iter_XXXXXXX/ per save).")
    save_interval: Optional[int] = arg(None, "Save every N iterations (and always on exit when --save is set).")
    load: Optional[str] = arg(None, "Directory to resume from (reads latest_checkpointed_iteration.txt). With no "
                                    "checkpoint there, training starts from scratch only when it is also --save; "
                                    "otherwise (and always with --finetune) that is an error.")
    ckpt_step: Optional[int] = arg(None, "Load iteration N of --load (iter_N) instead of the one "
                                         "latest_checkpointed_iteration.txt names, also when that file is missing.")
    override_opt_param_scheduler: bool = arg(
        False, "On --load, run the learning-rate schedule of this run's flags (the default here too; the flag says "
               "it outright). Megatron-DeepSpeed's spelling --override-opt_param-scheduler is accepted.",
        flags=("--override-opt-param-scheduler", "--override-opt_param-scheduler"))
    use_checkpoint_opt_param_scheduler: bool = arg(
        False, "On --load, continue the learning-rate schedule saved in the checkpoint (its --lr, --min-lr, warmup, "
               "decay length and style) instead of this run's flags.",
        flags=("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"))
    exit_on_missing_checkpoint: bool = arg(False, "A --load without a checkpoint is an error also when it is the "
                                                  "--save directory (no resume-or-start).")
    no_load_optim: bool = arg(False, "Load weights only: fresh optimizer, scheduler and loss scaler.")
    no_load_rng: bool = arg(False, "Do not restore the RNG states saved in the checkpoint (also when its "
                                   "rng_rank_*.pt files are missing, which is an error otherwise); dropout then "
                                   "differs from an uninterrupted run, so the resume is not exact.")
    finetune: bool = arg(False, "Load weights only and start at iteration 0 with fresh optimizer, "
                                "scheduler, RNG and data position.")
    keep_last: Optional[int] = arg(None, "Keep only the newest N checkpoints in --save.")
    ckpt_format: str = arg(
        "auto", "How --save writes checkpoints. 'megatron_ru': every tensor and its optimizer state by canonical "
                "name, each rank writing its own slices; --load reads it at any TP x PP x DP and ZeRO stage 0-2. "
                "'deepspeed': DeepSpeed's own files (for DeepSpeed's tools; loaded at another layout by name as "
                "well). 'auto': megatron_ru, except with ZeRO stage 3 or fp16 without ZeRO, whose optimizer "
                "state only DeepSpeed's files hold. Megatron-LM's 'torch_dist' and 'torch' mean 'megatron_ru' here.",
        choices=("auto", "megatron_ru", "deepspeed", "torch_dist", "torch"))
    use_checkpoint_args: bool = arg(False, "Take the model's shape flags (and the tokenizer recorded with it, "
                                           "when no tokenizer flag is given) from the checkpoint in --load; a "
                                           "given flag that contradicts the checkpoint is an error. Dropout "
                                           "defaults to the checkpoint's too (0 for an imported LLaMA/Mistral/"
                                           "Qwen2); --hidden-dropout/--attention-dropout override it.")

    def problems(self) -> list[str]:
        out = []
        if self.save_interval is not None and self.save_interval < 1:
            out.append(f"--save-interval must be >= 1 (got {self.save_interval})")
        if self.save_interval is not None and not self.save:
            out.append("--save-interval needs a directory: add --save DIR")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            out.append("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler contradict each other: "
                       "give one (the schedule of the flags, or the checkpoint's)")
        if self.ckpt_step is not None and not self.load:
            out.append(f"--ckpt-step {self.ckpt_step} names an iteration of the checkpoint to load: add --load DIR")
        if self.ckpt_step is not None and self.ckpt_step < 0:
            out.append(f"--ckpt-step must be >= 0 (got {self.ckpt_step})")
        if self.keep_last is not None and self.keep_last < 1:
            out.append(f"--keep-last must be >= 1 (got {self.keep_last})")
        return out


@dataclass
class LoggingConfig:
    """Logging: progress lines, JSONL metrics, TensorBoard, throughput."""

    log_interval: int = arg(100, "Print one progress line every N iterations.")
    tensorboard_dir: Optional[str] = arg(None, "Write TensorBoard scalars to this directory.")
    metrics_file: Optional[str] = arg(None, "Append one JSON object per logged iteration/evaluation here.")
    peak_tflops: Optional[float] = arg(
        None, "Peak TFLOP/s of one device for MFU (default: built-in table for V100/A100/H100/H200 "
              "in the training precision).")
    comm_audit: Optional[str] = arg(
        None, "Count the collectives and point-to-point messages of every training step (kind, group ranks, "
              "bytes, call site) and append one JSON line per rank per iteration to this file ('{rank}' in the "
              "name: one file per rank); docs/comm_audit.md.")
    wandb_project: Optional[str] = arg(
        None, "Log the TensorBoard scalars to this Weights & Biases project too (needs `pip install wandb`; "
              "WANDB_MODE=offline writes the run files locally for a later `wandb sync`). --wandb-exp-name, "
              "--wandb-id or --wandb-save-dir alone start the W&B run too, in the project WANDB_PROJECT names, "
              "else 'uncategorized' (W&B's own default), as Megatron-DeepSpeed's forks do; the banner says which.")
    wandb_exp_name: Optional[str] = arg(None, "Name of the Weights & Biases run (default: one W&B picks).")
    wandb_id: Optional[str] = arg(None, "Id of the Weights & Biases run: a job given the id of an earlier one "
                                        "continues that run (Megatron-DeepSpeed's flag).")
    wandb_save_dir: Optional[str] = arg(
        None, "Directory for the Weights & Biases run files (default: --save/wandb, else ./wandb).")
    # Megatron-LM's optional scalars, under its tag names, to TensorBoard, W&B and --metrics-file
    # (megatron_ru.training.metrics.MEGATRON_TRAIN_TAGS; docs/training.md)
    log_params_norm: bool = arg(
        False, "Log the L2 norm of all model weights ('params-norm', each element once across TP and PP; one "
               "all-reduce over the model-parallel group per logged iteration). Not with --zero-stage 3.")
    log_num_zeros_in_grad: bool = arg(
        False, "Log the number of zero elements in the gradient of each logged iteration's step ('num-zeros': "
               "unscaled and clipped, before the step; each element once across TP, PP and ZeRO's partitions). "
               "Not with --zero-stage 3, nor --fp16 at --zero-stage 0.")
    log_timers_to_tensorboard: bool = arg(
        False, "Log the wall time per iteration in seconds ('iteration-time'); Megatron's other timers are not "
               "kept.")
    log_validation_ppl_to_tensorboard: bool = arg(
        False, "Log the validation perplexity exp(min(loss, 20)) as 'lm loss validation ppl' (and vs samples).")
    log_batch_size_to_tensorboard: bool = arg(False, "Log the global batch size ('batch-size', and vs samples).")
    log_memory_to_tensorboard: bool = arg(
        False, "Log memory: on a GPU 'mem-reserved-bytes', 'mem-allocated-bytes', 'mem-max-allocated-bytes' "
               "(torch.cuda.memory_stats); on CPU this process's peak RSS as 'mem-max-rss-bytes'.")
    log_world_size_to_tensorboard: bool = arg(False, "Log the number of ranks ('world-size', and vs samples).")

    def problems(self) -> list[str]:
        out = []
        if self.log_interval < 1:
            out.append(f"--log-interval must be >= 1 (got {self.log_interval})")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            out.append(f"--peak-tflops must be > 0 (got {self.peak_tflops})")
        if self.wandb_requested and not wandb_installed():
            given = " ".join(self.wandb_flags())
            out.append(f"{given} needs the wandb package: pip install wandb (or leave out "
                       f"{'that flag' if len(self.wandb_flags()) == 1 else 'those flags'})")
        return out

    def wandb_flags(self) -> list[str]:
        """The W&B flags given, as the command line spells them (our names)."""
        return [f"--{name.replace('_', '-')} {value}" for name, value in (
            ("wandb_project", self.wandb_project), ("wandb_exp_name", self.wandb_exp_name),
            ("wandb_id", self.wandb_id), ("wandb_save_dir", self.wandb_save_dir)) if value]

    @property
    def wandb_requested(self) -> bool:
        """Whether this run logs to W&B: any W&B flag starts it (the project, when not given, comes from
        WANDB_PROJECT or W&B's default: ``megatron_ru.training.wandb_writer.wandb_project``)."""
        return bool(self.wandb_flags())


def wandb_installed() -> bool:
    """Whether ``import wandb`` can succeed (found without importing it: that takes a second)."""
    import importlib.util
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # a module in sys.modules without a spec
        return False
