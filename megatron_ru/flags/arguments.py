"""All of ``pretrain_gpt.py``'s configuration: parse every concern's dataclass, resolve derived
values (data-parallel size, gradient accumulation, iterations) and validate across concerns.

Validation happens before any process group exists: the world size comes from the launcher's
environment (``discover_environment``), the device type from what torch sees. Every problem is
collected and raised in one ValueError that names the flag to change.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_ru.config.base import explicit_dests, parse_configs, validate_all
from megatron_ru.config.batch_ramp import BatchRamp, ramp_problems
from megatron_ru.config.data import DataConfig, parse_data_path, parse_split
from megatron_ru.config.lora import LoraConfig, LoraSpec
from megatron_ru.config.model import ModelConfig, model_parallel_problems
from megatron_ru.config.parallel import ParallelConfig
from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from megatron_ru.data.checks import DataBlend
from megatron_ru.parallel.topology import ParallelLayout, data_parallel_size, layout_problems, micro_batches_per_step

CONFIG_CLASSES: tuple[type, ...] = (ParallelConfig, ModelConfig, DataConfig, TokenizerConfig, TrainingConfig,
                                    OptimizerConfig, CheckpointConfig, LoggingConfig, LoraConfig)
_FIELD_OF = {ParallelConfig: "parallel", ModelConfig: "model", DataConfig: "data", TokenizerConfig: "tokenizer",
             TrainingConfig: "training", OptimizerConfig: "optimizer", CheckpointConfig: "checkpoint",
             LoggingConfig: "logging", LoraConfig: "lora"}


@dataclass
class Arguments:
    parallel: ParallelConfig
    model: ModelConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    lora: LoraConfig
    world_size: int
    device_type: str
    # ---- resolved once by parse_arguments (after validation); consumers never re-check them ----
    layout: Optional[ParallelLayout] = None
    """TP x DP x PP of ``world_size`` ranks; setup() checks it against the real process group."""
    blend: Optional[DataBlend] = None
    """``--data-path`` as dataset prefixes and weights (None: blended by token count)."""
    split: Optional[tuple[float, float, float]] = None
    """``--split`` as normalised train/valid/test shares of each dataset's documents."""
    split_blends: Optional[tuple[Optional[DataBlend], ...]] = None
    """--train/valid/test-data-path (or --per-split-data-args-path): each split's datasets, all their documents
    (None: no per-split data; a None entry: no dataset for that split). ``blend`` is None then."""
    model_vocab_size: Optional[int] = None
    """The model's vocabulary rows from the checkpoint (``--use-checkpoint-args``); None: the tokenizer's size."""
    megatron_no_effect: list[str] = field(default_factory=list)
    """Megatron flags given that change nothing here (megatron_ru/flags/megatron_flags.py; the banner lists them)."""
    megatron_spellings: list[str] = field(default_factory=list)
    """Megatron flags given that were mapped onto ours."""
    notices: list[str] = field(default_factory=list)
    """Warnings about the flags, logged once at start-up (e.g. --sequence-parallel turned off at TP 1)."""
    auto_layout: Optional[dict[str, Any]] = None
    """--auto-layout's choice (megatron_ru/plan/auto.py): the flags it added, the layout, the prediction, the
    runners-up; stored in the checkpoints, the metrics file and the banner. None without --auto-layout."""
    _tokenizer: Any = field(default=None, repr=False, compare=False)
    _load_target: Any = field(default=None, repr=False, compare=False)

    def built_tokenizer(self) -> Any:
        """The tokenizer of ``--tokenizer-type`` & co., loaded once per process (validation loads it to learn its
        vocabulary size; training, the banner's memory prediction and the planner reuse it)."""
        if self._tokenizer is None:
            from megatron_ru.data.tokenizer import build_tokenizer
            self._tokenizer = build_tokenizer(self.tokenizer)
        return self._tokenizer

    def load_target(self) -> Any:
        """What ``--load`` (and ``--ckpt-step``) points at, a ``checkpointing.meta.LoadTarget``: its pointer and
        ``metadata.json`` read once per process, by the first consumer (``--use-checkpoint-args`` at parse time,
        else the start-up checks), and shared by every later one, the load included (see ``LoadTarget``: the
        pointer cannot move between the checks and the load). A pointer or metadata that cannot be read is the
        same :class:`CheckpointError` at every call. None without ``--load``."""
        c = self.checkpoint
        if not c.load:
            return None
        key = (c.load, c.ckpt_step)
        if self._load_target is None or self._load_target[0] != key:
            from megatron_ru.checkpointing.files import CheckpointError
            from megatron_ru.checkpointing.meta import resolve_load
            try:
                self._load_target = (key, resolve_load(c.load, c.ckpt_step))
            except CheckpointError as e:
                self._load_target = (key, e)
        found = self._load_target[1]
        if isinstance(found, Exception):
            raise found
        return found

    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel_size

    @property
    def dp(self) -> int:
        """WORLD_SIZE / (TP x CP x PP), exact: validation refuses a world size it does not divide. The ranks that
        read different samples (the CP ranks of one sample read the same ones)."""
        return data_parallel_size(self.world_size, self.tp, self.pp, self.cp)

    @property
    def sequence_parallel(self) -> bool:
        """The one source of sequence parallelism: validation allows it only with TP > 1, so
        the flag is the active state (models and groups take this value, never recompute it)."""
        return self.parallel.sequence_parallel

    @property
    def global_batch_size(self) -> int:
        t = self.training
        return t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * self.dp

    @property
    def grad_accum(self) -> int:
        """Exact: validation refuses a global batch that micro batch x DP does not divide."""
        return micro_batches_per_step(self.global_batch_size, self.training.micro_batch_size, self.dp)

    @property
    def batch_ramp(self) -> Optional[BatchRamp]:
        """--rampup-batch-size as a :class:`BatchRamp` to --global-batch-size (None: a constant batch)."""
        return BatchRamp.of(self.training.rampup_batch_size, self.global_batch_size)

    @property
    def train_iters(self) -> int:
        """--train-iters, or --train-samples in whole global batches (validation refuses fewer
        samples than one global batch, and requires exactly one of the two flags); with a batch ramp,
        the ramp's steps and then whole global batches (Megatron's count)."""
        t = self.training
        if t.train_iters is not None:
            return t.train_iters
        ramp = self.batch_ramp
        if ramp is not None:
            return ramp.train_iters(t.train_samples)
        return t.train_samples // self.global_batch_size

    @property
    def precision(self) -> str:
        return "bf16" if self.training.bf16 else "fp16" if self.training.fp16 else "fp32"

    def configs(self) -> list[Any]:
        return [getattr(self, name) for name in _FIELD_OF.values()]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: every flag by concern plus the resolved values (stored in checkpoints)."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _FIELD_OF.values()}
        out["resolved"] = {"world_size": self.world_size, "data_parallel_size": self.dp,
                           "global_batch_size": self.global_batch_size, "gradient_accumulation_steps":
                           self.grad_accum, "train_iters": self.train_iters, "precision": self.precision}
        if self.auto_layout is not None:
            out["resolved"]["auto_layout"] = self.auto_layout
        return out


# ---- cross-config rules (each takes the Arguments, returns problems naming flags) ----------

def _derivable(a: Arguments) -> bool:
    """Whether DP, the global batch, accumulation and the iteration count are defined: rules that
    use them run only then (the rules for the flags involved report what is wrong)."""
    t = a.training
    if (a.tp < 1 or a.pp < 1 or a.cp < 1 or a.world_size < 1 or a.world_size % (a.tp * a.pp * a.cp)
            or t.micro_batch_size < 1):
        return False
    if t.global_batch_size is not None and (t.global_batch_size < 1 or t.global_batch_size % (t.micro_batch_size * a.dp)):
        return False
    if (t.train_iters is None) == (t.train_samples is None):
        return False
    if ramp_problems(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, a.dp):
        return False
    length = t.train_iters if t.train_iters is not None else t.train_samples
    return length >= 1 and (t.train_samples is None or t.train_samples >= a.global_batch_size)


def _layout_rule(a: Arguments) -> list[str]:
    return layout_problems(a.world_size, a.tp, a.pp, a.cp) + model_parallel_problems(a.model, a.tp, a.pp)


def _context_parallel_rule(a: Arguments) -> list[str]:
    """What context parallelism needs (megatron_ru.parallel.context)."""
    cp = a.cp
    if cp <= 1:
        return []
    out = []
    from megatron_ru.parallel.context import check_a2a_heads, check_sequence
    try:
        check_sequence(a.data.seq_length, cp)
    except ValueError as e:
        out.append(str(e))
    m = a.model
    if m.attention_dropout > 0:
        out.append(f"--attention-dropout {m.attention_dropout} cannot be combined with --context-parallel-size {cp}: "
                   "the CP attention has no dropout; use --attention-dropout 0")
    if a.training.torch_compile:
        out.append(f"--torch-compile cannot be combined with --context-parallel-size {cp}: the CP attention's "
                   "exchange runs eagerly; drop --torch-compile")
    if a.parallel.cp_comm_type == "a2a" and a.tp >= 1 and m.num_attention_heads % a.tp == 0 \
            and m.query_groups % a.tp == 0:
        try:
            check_a2a_heads(m.num_attention_heads // a.tp, m.query_groups // a.tp, cp)
        except ValueError as e:
            out.append(str(e))
    return out


def _zero_rule(a: Arguments) -> list[str]:
    if a.pp > 1 and a.training.zero_stage > 1:
        return [f"--zero-stage {a.training.zero_stage} cannot be combined with --pipeline-model-parallel-size "
                f"{a.pp}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; use --zero-stage 1 or "
                f"--pipeline-model-parallel-size 1"]
    if a.logging.log_params_norm and a.training.zero_stage == 3:
        return ["--log-params-norm cannot be combined with --zero-stage 3: the weights are partitioned over the "
                "data-parallel ranks (each rank holds a slice); drop --log-params-norm or use --zero-stage 2 or lower"]
    stage = a.training.zero_stage
    if a.logging.log_num_zeros_in_grad and (stage == 3 or (a.training.fp16 and stage == 0)):
        return [f"--log-num-zeros-in-grad cannot be combined with "
                f"{'--zero-stage 3' if stage == 3 else '--fp16 at --zero-stage 0'}: DeepSpeed's optimizer there "
                "does not expose the gradient it steps with per parameter; drop --log-num-zeros-in-grad, or use "
                "--zero-stage 1 or 2" + (" (or --bf16)" if stage == 0 else "")]
    return []


def _ckpt_format_rule(a: Arguments) -> list[str]:
    t = a.training
    if a.checkpoint.ckpt_format != "megatron_ru":
        return []
    if t.zero_stage == 3:
        return ["--ckpt-format megatron_ru cannot hold --zero-stage 3's state (the weights themselves are "
                "partitioned; only DeepSpeed's files hold it): use --ckpt-format auto or deepspeed, or --zero-stage 2 "
                "or lower"]
    if t.fp16 and t.zero_stage == 0:
        return ["--ckpt-format megatron_ru cannot hold --fp16's optimizer state at --zero-stage 0 (DeepSpeed's fp16 "
                "optimizer keeps its fp32 masters in flat groups not linked to the parameters): use --zero-stage 1, "
                "or --ckpt-format auto or deepspeed"]
    return []


def _precision_rule(a: Arguments) -> list[str]:
    if a.training.fp16 and a.device_type == "cpu":
        return ["--fp16 needs a GPU: DeepSpeed's CPU accelerator has no float16 training; use --bf16 or "
                "drop --fp16 (fp32) on this machine"]
    return []


def _fp8_rule(a: Arguments) -> list[str]:
    """--fp8-format (megatron_ru/model/fp8.py): the precisions, recipes and features it runs with."""
    t = a.training
    if t.fp8_format is None:
        return []
    out = []
    if t.fp8_recipe == "delayed":
        out.append("--fp8-recipe delayed is TransformerEngine's scaling from an amax history; FP8 here is torchao's, "
                   "scaled from the current step: use --fp8-recipe tensorwise (or rowwise)")
    if t.fp16:
        out.append("--fp8-format with --fp16: FP8 here runs under --bf16 (or fp32), without a loss scale; use --bf16")
    if t.fp8_recipe == "rowwise" and a.tp > 1:
        out.append(f"--fp8-recipe rowwise scales along the contraction dimension, which tensor parallelism "
                   f"({a.tp}) splits: use --fp8-recipe tensorwise, or --tensor-model-parallel-size 1")
    if t.fp8_recipe == "rowwise" and a.cp > 1:
        out.append(f"--fp8-recipe rowwise scales the weight gradient's operands along the tokens, which context "
                   f"parallelism ({a.cp}) splits: use --fp8-recipe tensorwise, or --context-parallel-size 1")
    if a.lora.enabled:
        out.append("--fp8-format with --lora-rank: adapters train in the training precision over a frozen base; "
                   "drop --fp8-format")
    return out


def _batch_rule(a: Arguments) -> list[str]:
    t = a.training
    if t.micro_batch_size < 1 or a.tp < 1 or a.pp < 1 or a.world_size < 1 or a.world_size % (a.tp * a.pp):
        return []  # reported by other rules
    per_step = t.micro_batch_size * a.dp
    if t.global_batch_size is not None and t.global_batch_size % per_step:
        nearest = max(per_step, t.global_batch_size // per_step * per_step)
        return [f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
                f"({t.micro_batch_size}) x data-parallel size ({a.dp} = WORLD_SIZE {a.world_size} / (TP {a.tp} "
                f"x PP {a.pp})) = {per_step}; e.g. --global-batch-size {nearest}"]
    if t.train_samples is not None and t.train_samples < a.global_batch_size:
        return [f"--train-samples ({t.train_samples}) is smaller than one global batch ({a.global_batch_size})"]
    return []


def _rampup_rule(a: Arguments) -> list[str]:
    t = a.training
    if t.micro_batch_size < 1 or a.tp < 1 or a.pp < 1 or a.world_size < 1 or a.world_size % (a.tp * a.pp):
        return []  # reported by other rules
    return ramp_problems(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, a.dp)


def _sequence_rule(a: Arguments) -> list[str]:
    seq = getattr(a.data, "seq_length", None)
    mpe = a.model.max_position_embeddings
    if seq is not None and mpe is not None and seq > mpe:
        # rope has no position table, but --max-position-embeddings is the length the model is
        # declared for (checkpoints, conversion to HF's max_position_embeddings): refuse both
        return [f"--seq-length ({seq}) exceeds --max-position-embeddings ({mpe}) with --position-embedding-type "
                f"{a.model.position_embedding_type}: raise --max-position-embeddings or shorten --seq-length"]
    # a --seq-length above --sliding-window trains with the window applied in every windowed layer, as the
    # source model computes it (tests/integration/test_train_layouts.py: Gemma 3's local and global layers)
    return []


def _tokenizer_vocab_size(a: Arguments) -> tuple[Optional[int], list[str]]:
    """Load the tokenizer (a few milliseconds for SentencePiece) to learn its vocabulary size; a
    file that is not a tokenizer of the given type is a configuration problem like any other."""
    if a.tokenizer.problems():
        return None, []  # reported by TokenizerConfig.problems
    try:
        return a.built_tokenizer().vocab_size, []
    except (ValueError, OSError, RuntimeError) as e:
        return None, [str(e)]


def _data_rule(a: Arguments) -> list[str]:
    """Datasets against the split, the sample counts and the tokenizer (index files and a sample
    of documents only; see megatron_ru/data/checks.py)."""
    from megatron_ru.data.checks import data_problems
    from megatron_ru.data.builder import dataset_sizes
    vocab_size, out = _tokenizer_vocab_size(a)
    if a.data.problems() or a.training.problems() or not _derivable(a) or a.data.mock_data:
        return out  # missing files, a bad --split or batch sizes are reported by their own rules
    t = a.training
    sizes = dataset_sizes(a.train_iters, a.global_batch_size, t.eval_interval, t.eval_iters)
    if a.split_blends is not None:  # each split's own datasets, all their documents
        for s, blend in enumerate(a.split_blends):
            if blend is not None:
                whole = tuple(1.0 if k == s else 0.0 for k in range(3))
                out += data_problems(blend, whole, "(per-split data)", tuple(n if k == s else 0 for k, n in
                                                                             enumerate(sizes)), vocab_size)
        return out
    assert a.blend is not None and a.split is not None  # resolved whenever DataConfig has no problems
    return out + data_problems(a.blend, a.split, a.data.split, sizes, vocab_size)


def _blend_of(tokens: Optional[list[str]]) -> Optional[DataBlend]:
    if tokens is None:
        return None
    prefixes, weights = parse_data_path(tokens)
    return DataBlend(tuple(prefixes), None if weights is None else tuple(weights))


def _resolve_data_flags(cfg: DataConfig) -> tuple[Optional[DataBlend], Optional[tuple[float, float, float]],
                                                  Optional[tuple[Optional[DataBlend], ...]]]:
    """``--data-path`` (or ``--data-args-path``), ``--split`` and the per-split data parsed once; None where a
    flag is invalid (DataConfig.problems says why)."""
    blend: Optional[DataBlend] = None
    per_split: Optional[tuple[Optional[DataBlend], ...]] = None
    try:
        if cfg.per_split:
            per_split = tuple(_blend_of(t) for t in cfg.split_path_tokens())
        elif not cfg.mock_data:
            blend = _blend_of(cfg.data_path_tokens())
    except (ValueError, OSError):
        blend, per_split = None, None
    try:
        a, b, c = parse_split(cfg.split)
        split: Optional[tuple[float, float, float]] = (a, b, c)
    except ValueError:
        split = None
    return blend, split, per_split


def _lr_rule(a: Arguments) -> list[str]:
    from megatron_ru.config.lr_schedule import schedule_from_config
    if not _derivable(a):
        return []
    try:
        schedule_from_config(a.optimizer, a.train_iters, a.global_batch_size, in_samples=a.batch_ramp is not None,
                             train_samples=a.training.train_samples, seq_length=a.data.seq_length)
    except ValueError as e:
        return [str(e)]
    return []


def _freeze_rule(a: Arguments) -> list[str]:
    t = a.training
    if t.train_embedding_rows == "new" and t.fp16 and t.zero_stage == 0 and a.optimizer.weight_decay > 0:
        return ["--train-embedding-rows new with --fp16 at --zero-stage 0 cannot keep the other rows out of weight "
                "decay (DeepSpeed's fp16 optimizer hides its fp32 master weights): use --zero-stage 1, --bf16, or "
                "--weight-decay 0"]
    return []


def _lora_rule(a: Arguments) -> list[str]:
    """--lora-* flags: the adapters resolve on this model (targets and patterns match), and they agree
    with adapters a --use-checkpoint-args checkpoint already has; sets ``a.model.lora``."""
    if a.lora.problems() or a.model.problems():
        return []
    recorded = a.model.lora
    if not a.lora.enabled:
        return []
    spec = LoraSpec.from_config(a.lora)
    if recorded is not None and LoraSpec.from_dict(recorded) != spec:
        return [f"--lora-* flags give {spec.to_dict()} but the checkpoint in --load already has adapters "
                f"{recorded}; drop the --lora-* flags to continue with the checkpoint's adapters"]
    from megatron_ru.config.lora import resolve_adapters
    try:
        resolve_adapters(spec, a.model.num_layers, a.model.gated_mlp)
    except ValueError as e:
        return [str(e)]
    out = []
    if a.training.train_only_embeddings or a.training.freeze:
        out.append("--lora-rank freezes the base model itself: use --lora-modules-to-save to train the embeddings "
                   "next to the adapters, not --train-only-embeddings/--freeze")
    a.model.lora = spec.to_dict()
    return out


def _checkpoint_rule(a: Arguments) -> list[str]:
    c = a.checkpoint
    out = []
    if c.finetune and not c.load:
        out.append("--finetune loads weights from --load: add --load DIR")
    if (c.no_load_optim or c.no_load_rng) and not c.load:
        out.append("--no-load-optim/--no-load-rng only apply with --load DIR")
    if a.training.exit_signal_handler and not c.save:
        out.append("--exit-signal-handler saves a checkpoint before exiting: add --save DIR")
    return out


def _blocking_file(path: str) -> Optional[str]:
    """The existing non-directory that stops ``path`` from being (or being created as) a directory:
    ``path`` itself or the nearest existing parent; None when there is none."""
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return None if os.path.isdir(p) else p


def _output_paths_rule(a: Arguments) -> list[str]:
    """Output directories checked before anything runs: a path that names an existing file used to
    fail only when first written (--save after the last iteration)."""
    lg, out = a.logging, []
    dirs = [("--save", a.checkpoint.save), ("--tensorboard-dir", lg.tensorboard_dir),
            ("--wandb-save-dir", lg.wandb_save_dir)]
    for flag, path in dirs:
        blocker = path and _blocking_file(path)
        if blocker:
            where = "is an existing file" if blocker == os.path.abspath(path) else f"lies under the existing file {blocker}"
            out.append(f"{flag} {path} {where}, not a directory: choose a directory path")
    if lg.metrics_file:
        if os.path.isdir(lg.metrics_file):
            out.append(f"--metrics-file {lg.metrics_file} is a directory: name a file (e.g. {lg.metrics_file}/metrics.jsonl)")
        else:
            blocker = _blocking_file(os.path.dirname(os.path.abspath(lg.metrics_file)))
            if blocker:
                out.append(f"--metrics-file {lg.metrics_file}: its directory would be under the existing file "
                           f"{blocker}; choose another path")
    return out


def _deepspeed_config_rule(a: Arguments) -> list[str]:
    path = a.training.deepspeed_config
    if not path or not _derivable(a):
        return []
    if not os.path.isfile(path):
        return [f"--deepspeed_config {path}: file not found"]
    try:
        user = json.load(open(path, encoding="utf-8"))
    except json.JSONDecodeError as e:
        return [f"--deepspeed_config {path} is not valid JSON: {e}"]
    out = []
    expect = {"train_batch_size": a.global_batch_size, "train_micro_batch_size_per_gpu": a.training.micro_batch_size,
              "gradient_accumulation_steps": a.grad_accum}
    for key, value in expect.items():
        if key in user and user[key] != value:
            out.append(f"--deepspeed_config {path} sets {key}={user[key]} but the flags give {value} "
                       f"(--micro-batch-size/--global-batch-size); make them agree or drop the key")
    for key, flag, on in (("bf16", "--bf16", a.training.bf16), ("fp16", "--fp16", a.training.fp16)):
        enabled = bool(user.get(key, {}).get("enabled", False))
        if enabled != on:
            out.append(f"--deepspeed_config {path} has {key}.enabled={enabled} but {flag} is "
                       f"{'set' if on else 'not set'}; make them agree")
    stage = user.get("zero_optimization", {}).get("stage")
    if stage is not None and stage != a.training.zero_stage:
        out.append(f"--deepspeed_config {path} has zero_optimization.stage={stage} but --zero-stage is "
                   f"{a.training.zero_stage}; make them agree")
    return out


def _recompute_rule(a: Arguments) -> list[str]:
    if a.model.distribute_saved_activations and a.parallel.sequence_parallel:
        return ["--distribute-saved-activations splits each recomputed input across the tensor-parallel ranks, but "
                "--sequence-parallel already splits it along the sequence: drop one of them (as Megatron requires)"]
    return []


RULES: tuple[Callable[[Arguments], list[str]], ...] = (
    _recompute_rule, _layout_rule, _context_parallel_rule, _zero_rule, _ckpt_format_rule, _precision_rule, _fp8_rule, _batch_rule, _rampup_rule, _sequence_rule, _lr_rule,
    _freeze_rule, _lora_rule, _checkpoint_rule, _output_paths_rule, _deepspeed_config_rule, _data_rule)


def default_world_size() -> int:
    from megatron_ru.parallel.env import discover_environment
    return discover_environment(os.environ).world_size


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_arguments(argv: Optional[Sequence[str]] = None, *, world_size: Optional[int] = None,
                    device_type: Optional[str] = None, validate: bool = True) -> Arguments:
    """Parse ``argv`` (default: ``sys.argv[1:]``) into :class:`Arguments`, validate it once (one
    ValueError listing every problem) and resolve the data blend, the split and the layout, which
    the rest of the program takes as they are."""
    from megatron_ru.flags.megatron_flags import add_to_parser, apply_megatron_flags
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_configs(CONFIG_CLASSES, argv, description="Pretrain a GPT/LLaMA model (megatron_ru).",
                           extra=add_to_parser)
    args = Arguments(**{_FIELD_OF[cls]: parsed[cls] for cls in CONFIG_CLASSES},
                     world_size=default_world_size() if world_size is None else world_size,
                     device_type=device_type or default_device_type())
    explicit = explicit_dests(CONFIG_CLASSES, argv)
    megatron_problems = apply_megatron_flags(args, parsed["namespace"], explicit)
    if args.checkpoint.ckpt_format in ("torch_dist", "torch"):  # Megatron-LM's formats: ours is the by-name one
        args.notices.append(f"--ckpt-format {args.checkpoint.ckpt_format}: checkpoints are written by canonical name "
                            f"(--ckpt-format megatron_ru), loadable at any TP x PP x DP")
        args.checkpoint.ckpt_format = "megatron_ru"
    tok = args.tokenizer
    if tok.tokenizer_type is None and tok.vocab_file and tok.merge_file:  # the GPT examples give only the files
        tok.tokenizer_type = "GPT2BPETokenizer"
        args.notices.append("--vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer (the only "
                            "tokenizer that reads a merge file)")
    if args.parallel.sequence_parallel and args.parallel.tensor_model_parallel_size == 1:
        args.notices.append("--sequence-parallel at --tensor-model-parallel-size 1 does nothing: turned off "
                            "(as Megatron does)")
        args.parallel.sequence_parallel = False
    if args.checkpoint.use_checkpoint_args:
        from megatron_ru.flags.checkpoint_args import apply_checkpoint_args
        apply_checkpoint_args(args, explicit)
    args.blend, args.split, args.split_blends = _resolve_data_flags(args.data)
    if args.split_blends is not None:
        if "split" in explicit:
            args.notices.append(f"--split {args.data.split} is not used: each split reads all the documents of its "
                                f"own --train/valid/test-data-path datasets")
        if args.split_blends[1] is None and args.training.eval_iters > 0:
            args.notices.append("no validation datasets (--valid-data-path): no evaluation")
            args.training.eval_iters = 0
    if validate:
        validate_all(args.configs(), [lambda a: megatron_problems, *RULES], context=args)
    if args.training.bf16 and args.training.zero_stage == 0:
        # DeepSpeed keeps bf16's fp32 master weights and fp32 gradient sums only in its ZeRO optimizer (stage 0 is
        # "an unsupported mix of model_dtype=bfloat16 and grad_accum_dtype=float32" inside DeepSpeed); after
        # validation, which checked the flags (and a --deepspeed_config's stage) as the user gave them
        args.notices.append("--bf16 with --zero-stage 0: running ZeRO stage 1, where DeepSpeed keeps bf16's fp32 "
                            "master weights and gradient sums (the same results; the optimizer state is sharded "
                            "over the data-parallel ranks)")
        args.training.zero_stage = 1
    args.layout = ParallelLayout(args.world_size, args.tp, args.pp, args.cp)  # valid: refused above otherwise
    return args
