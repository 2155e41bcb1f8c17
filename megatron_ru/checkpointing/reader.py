"""Read any megatron_ru checkpoint as canonical full tensors, offline (CPU, no process group).

Three layouts are read (:mod:`megatron_ru.checkpointing.sources.weights`):

* the layer format (:mod:`megatron_ru.checkpointing.layout`), written by training and :func:`write_checkpoint`;
* DeepSpeed's PP > 1 files: ``layer_{j:02d}-model_{t:02d}-model_states.pt`` = layer ``j``'s TP shard ``t``
  (local names);
* DeepSpeed's PP = 1 files: ``mp_rank_{t:02d}_model_states.pt``, whose ``module`` holds TP shard ``t``
  of every parameter under its canonical name (memory-mapped: only the tensors asked for are read).

TP shards are joined with each parameter's partition dim and stride and the vocabulary padding is
cut to the model's ``V`` rows (:meth:`CheckpointReader.get`), or a shard at another TP size is taken from
the parts of the saved shards it overlaps (:meth:`CheckpointReader.shard_at`, what the loader uses). Files
are read one layer at a time (the previous layer's are dropped).

Optimizer state (:meth:`CheckpointReader.optimizer_state`), as full canonical fp32 tensors
(``fp32`` master weight, ``exp_avg``, ``exp_avg_sq``), from four sources:

* layer format (:mod:`~megatron_ru.checkpointing.sources.optim_layers`): its per-layer optimizer files, or (from
  training) each TP shard's fragments joined over the data-parallel ranks' ``optim_states-pp*-tp*-dp*.pt`` files;
* DeepSpeed (:mod:`~megatron_ru.checkpointing.sources.optim_zero`): ZeRO 0 in fp32 (torch AdamW's state inside
  the ``mp_rank`` files), ZeRO 1 in fp32, bf16 or fp16 (the flat fp32 partitions of
  ``[bf16_]zero_pp_rank_{d}_mp_rank_{m}``, like DeepSpeed's ``zero_to_fp32``).

Anything else in DeepSpeed's files (ZeRO 2/3, ZeRO 0 with bf16/fp16) is refused by name with the flag to
change.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.layout import LAYERS_FORMAT, OPTIM_KEYS
from megatron_ru.checkpointing.lora_base import verify
from megatron_ru.checkpointing.meta import (TRACKER_FILE, CheckpointMeta, iteration_dir_name,
                                            read_latest_iteration)
from megatron_ru.checkpointing.sources.common import CheckpointDir, OptimSource
from megatron_ru.checkpointing.sources.optim_layers import FragmentOptim, LayerFileOptim
from megatron_ru.checkpointing.sources.optim_zero import Zero0Optim, Zero1Optim
from megatron_ru.checkpointing.sources.weights import LayerWeights, MpWeights, WeightSource
from megatron_ru.model.spec import ParamSpec, model_config_from_dict
from megatron_ru.model.shards import padded_vocab_rows, shard_from_saved
from megatron_ru.parallel.utils import unshard_tensors

__all__ = ["CheckpointReader", "read_checkpoint"]

_ITER_DIR = re.compile(r"^iter_\d{7,}$")


def read_checkpoint(load_dir: str, iteration: Optional[int] = None) -> "CheckpointReader":
    """The checkpoint ``latest`` points at in ``load_dir`` (or ``iteration``)."""
    load_dir = os.path.abspath(load_dir)
    if iteration is None and _ITER_DIR.match(os.path.basename(load_dir)) and \
            os.path.isfile(os.path.join(load_dir, "metadata.json")):  # an iter_* directory itself
        return CheckpointReader(load_dir, CheckpointMeta.read(load_dir))
    if iteration is None:
        if not os.path.isdir(load_dir):
            raise FileNotFoundError(f"--load {load_dir} does not exist: point it at a megatron_ru checkpoint "
                                    f"directory (it holds {TRACKER_FILE})")
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"--load {load_dir} holds no {TRACKER_FILE}: point it at a directory written by "
                                  f"pretrain_gpt.py --save or tools/convert_checkpoint.py")
    ckpt_dir = os.path.join(load_dir, iteration_dir_name(iteration))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} does not exist: the checkpoint of iteration {iteration} is missing; "
                              f"fix {os.path.join(load_dir, TRACKER_FILE)} or pick an existing iter_* directory")
    return CheckpointReader(ckpt_dir, CheckpointMeta.read(ckpt_dir))


def _precision(meta: CheckpointMeta) -> str:
    training = (meta.args or {}).get("training", {}) if isinstance(meta.args, dict) else {}
    return "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "fp32"


class CheckpointReader:
    """Canonical full tensors of one checkpoint directory (``iter_XXXXXXX``).

    Its weights are read by file format (:mod:`~megatron_ru.checkpointing.sources.weights`), its optimizer state
    from one of four sources (:mod:`~megatron_ru.checkpointing.sources.optim_layers`,
    :mod:`~megatron_ru.checkpointing.sources.optim_zero`); this class joins and reslices the saved TP shards."""

    def __init__(self, ckpt_dir: str, meta: CheckpointMeta) -> None:
        self.dir = ckpt_dir
        self.meta = meta
        if meta.model_args is None or meta.vocab_size is None:
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'metadata.json')} records no model arguments "
                                  f"(model_args, vocab_size): it was saved by an older megatron_ru; resume it "
                                  f"once with this version and save again to convert or reshard it")
        self.cfg = model_config_from_dict(meta.model_args)
        self.vocab_size = int(meta.vocab_size)
        self.tp = meta.tensor_model_parallel_size
        self.pp = meta.pipeline_model_parallel_size
        self.kind = "layers" if meta.format == LAYERS_FORMAT else "ds_pipe" if self.pp > 1 else "ds_mp"
        if meta.format not in (None, LAYERS_FORMAT):
            raise CheckpointError(f"{ckpt_dir}: unknown checkpoint format {meta.format!r} (this megatron_ru reads "
                                  f"{LAYERS_FORMAT!r} and DeepSpeed's files)")
        if meta.format is None and meta.zero_stage == 3:
            raise CheckpointError(f"{ckpt_dir} was saved with ZeRO stage 3 (the weights themselves are partitioned "
                                  f"over the data-parallel ranks), which megatron_ru cannot read offline: resume it "
                                  f"at its own layout with --zero-stage 3, or train with --zero-stage 0 or 1 to get "
                                  f"checkpoints that convert and reshard")
        self._files = CheckpointDir(ckpt_dir, meta, self.cfg, self.vocab_size)
        self.specs, self.rows = self._files.specs, self._files.rows
        self._files.check({"model"})
        self._weights: WeightSource = MpWeights(self._files, self._from_base) if self.kind == "ds_mp" else \
            LayerWeights(self._files, self._from_base, own_format=self.kind == "layers")
        optim: type[OptimSource] = (FragmentOptim if meta.optimizer_fragments else LayerFileOptim) \
            if self.kind == "layers" else Zero0Optim if meta.zero_stage == 0 else Zero1Optim
        self._optim = optim(self._files, self._weight_shard)
        self._optim_checked = False
        self._base: Optional["CheckpointReader"] = None

    def names(self) -> list[str]:
        """Canonical parameter names, in model order."""
        return list(self.specs)

    def spec(self, name: str) -> ParamSpec:
        if name not in self.specs:
            raise KeyError(f"{name!r} is not a parameter of this model (its parameters: "
                           f"{', '.join(list(self.specs)[:4])}, ...)")
        return self.specs[name]

    # ---- weights ---------------------------------------------------------------------------------

    def _weight_shard(self, spec: ParamSpec, t: int) -> torch.Tensor:
        return self._weights.shard(spec, t)

    def _from_base(self, spec: ParamSpec, t: int) -> torch.Tensor:
        """A frozen tensor of a LoRA checkpoint: read from its base checkpoint (any layout), as TP shard ``t``."""
        base = self.meta.lora_base or {}
        if self._base is None:
            try:
                reader = read_checkpoint(base["load"], int(base["iteration"]))
            except (OSError, CheckpointError) as e:
                raise CheckpointError(f"{self.dir} holds only the LoRA adapters and trained modules; its frozen weights "
                                      f"are in {base.get('load')} iteration {base.get('iteration')} (lora_base in "
                                      f"metadata.json), which cannot be read: {e}") from None
            verify(self.dir, base)  # the same base by content, not only by path
            self._base = reader
        return self._base.shard_at(spec.name, self.tp, t)  # from the base's shards it overlaps

    def _join(self, spec: ParamSpec, shards: list[torch.Tensor], copy: bool = True) -> torch.Tensor:
        """The canonical tensor from the TP shards, vocabulary padding cut. ``copy=False``: a single shard is
        returned as a view (of a memory-mapped file's tensor or of the reader's cache: not to be modified)."""
        shards = [s.detach() for s in shards]
        if len(shards) == 1 and not copy:
            full = shards[0]
        elif spec.partition_dim is None:
            full = shards[0].clone()
        else:
            full = unshard_tensors(shards, spec.partition_dim, spec.partition_stride)
        if spec.vocab:  # the padding rows are cut (a view)
            full = full[: self.vocab_size]
        return full

    def weight_file(self, name: str, tp_rank: Optional[int] = None) -> str:
        """The path of the file holding TP shard ``tp_rank`` of ``name`` (None: every TP rank's, as a pattern)."""
        file = self._weights.file(self.spec(name), 0 if tp_rank is None else tp_rank)
        if tp_rank is None:  # the TP rank's field as a pattern
            tp_part = self._weights.tp_field
            file = file.replace(f"{tp_part}00", f"{tp_part}*", 1)
        return os.path.join(self.dir, file)

    def shard(self, name: str, tp_rank: int) -> torch.Tensor:
        """TP shard ``tp_rank`` of parameter ``name`` at the checkpoint's own TP (vocabulary padding kept)."""
        return self._weight_shard(self.spec(name), tp_rank).detach()

    def _reslice(self, spec: ParamSpec, tp: int, rank: int, read: Any) -> torch.Tensor:
        """TP shard ``rank`` at TP size ``tp`` (vocabulary rows padded for ``tp``) from only the saved shards it
        overlaps (``read(t)``: saved shard ``t``): the saved shard itself at the saved TP size, otherwise views
        of the parts it overlaps, joined (:func:`~megatron_ru.model.shards.shard_from_saved`)."""
        rows = padded_vocab_rows(self.cfg, self.vocab_size, tp)
        if spec.partition_dim is None:
            return read(0)
        if tp == self.tp and (not spec.vocab or rows == self.rows):
            return read(rank)
        return shard_from_saved(spec, read, self.vocab_size, self.rows, self.tp, rows, tp, rank)

    def shard_at(self, name: str, tp: int, rank: int) -> torch.Tensor:
        """TP shard ``rank`` of parameter ``name`` at TP size ``tp`` (vocabulary padding for ``tp``) read from
        the saved shards it overlaps only."""
        spec = self.spec(name)
        return self._reslice(spec, tp, rank, lambda t: self._weight_shard(spec, t).detach())

    def optimizer_shard_at(self, name: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
        """Like :meth:`shard_at` for ``{"fp32", "exp_avg", "exp_avg_sq"}``."""
        spec = self.spec(name)
        self._require_optimizer()
        saved: dict[int, dict[str, torch.Tensor]] = {}

        def read(t: int) -> dict[str, torch.Tensor]:
            if t not in saved:
                saved[t] = self._optim_shard(spec, t)
            return saved[t]

        return {key: self._reslice(spec, tp, rank, lambda t: read(t)[key].detach()).float() for key in OPTIM_KEYS}

    def get(self, name: str) -> torch.Tensor:
        """The full canonical tensor (``V`` rows for the vocabulary matrices), in the file's dtype."""
        spec = self.spec(name)
        if spec.partition_dim is not None:
            self._weights.read_layer(spec.layer_index)  # every TP rank's file of the layer, the next read meanwhile
        return self._join(spec, [self._weight_shard(spec, t) for t in range(self.tp)])

    # ---- optimizer state -------------------------------------------------------------------------

    def optimizer_problem(self) -> Optional[str]:
        """Why this checkpoint's optimizer state cannot be read (None: it can)."""
        m = self.meta
        if self.kind == "layers":
            return None if m.optimizer is not None else (
                f"{self.dir} was written without optimizer state (weights only)")
        precision = _precision(m)
        if m.zero_stage == 1:
            return None
        if m.zero_stage == 0 and precision == "fp32":
            return None
        return (f"{self.dir} holds the optimizer state of ZeRO stage {m.zero_stage} with {precision}, which "
                f"megatron_ru cannot convert (supported: ZeRO stage 0 with fp32, ZeRO stage 1 with fp32, bf16 or "
                f"fp16): convert the weights only (--no-load-optim), or train with --zero-stage 1 (or 0 with "
                f"fp32) and save again")

    @property
    def has_optimizer_state(self) -> bool:
        return self.optimizer_problem() is None

    def _require_optimizer(self) -> None:
        problem = self.optimizer_problem()
        if problem:
            raise CheckpointError(problem)
        if not self._optim_checked:
            self._files.check({"optim"})
            self._optim_checked = True

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """``{"fp32", "exp_avg", "exp_avg_sq"}``: full canonical fp32 tensors of parameter ``name`` (read-only:
        from a checkpoint at TP 1 they are views of the file's tensors, not copies)."""
        spec = self.spec(name)
        self._require_optimizer()
        per_rank = [self._optim_shard(spec, t) for t in range(self.tp)]
        return {k: self._join(spec, [s[k] for s in per_rank], copy=False).float() for k in OPTIM_KEYS}

    def optimizer_shard(self, name: str, tp_rank: int) -> dict[str, torch.Tensor]:
        """Like :meth:`optimizer_state`, TP shard ``tp_rank`` at the checkpoint's own TP (padding kept)."""
        self._require_optimizer()
        return {k: v.detach().float() for k, v in self._optim_shard(self.spec(name), tp_rank).items()}

    def _optim_shard(self, spec: ParamSpec, t: int) -> dict[str, torch.Tensor]:
        return self._optim.shard(spec, t)

    def common_state(self) -> dict[str, Any]:
        """What every parameter shares: ``step`` (optimizer steps), ``lr_scheduler``, ``loss_scaler``
        (cur_scale and friends; None without loss scaling), ``skipped_steps``, ``global_steps``."""
        if self.kind != "layers":
            self._require_optimizer()
        return self._optim.common_state()
