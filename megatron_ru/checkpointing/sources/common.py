"""What the readers of one checkpoint directory share: its files (loaded; memory-mapped files dropped on each
new layer), the shape check of a TP shard, and the common part of the optimizer sources."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError, check_files, list_files, safe_load
from megatron_ru.checkpointing.layout import mp_model_file, specs_by_name
from megatron_ru.checkpointing.meta import TRACKER_FILE, CheckpointMeta
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import ParamSpec
from megatron_ru.model.shards import padded_vocab_rows
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

WeightShard = Callable[[ParamSpec, int], torch.Tensor]  # (parameter, saved TP rank) -> its saved TP shard
OptimShard = dict[str, torch.Tensor]  # {"fp32", "exp_avg", "exp_avg_sq"} of one TP shard


class CheckpointDir:
    """One checkpoint directory (``iter_XXXXXXX``) as its metadata describes it: the model, the saved layout and
    the files present."""

    def __init__(self, ckpt_dir: str, meta: CheckpointMeta, cfg: ModelConfig, vocab_size: int) -> None:
        self.dir = ckpt_dir
        self.meta = meta
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.tp = meta.tensor_model_parallel_size
        self.pp = meta.pipeline_model_parallel_size
        self.specs = specs_by_name(cfg, vocab_size)
        self.rows = padded_vocab_rows(cfg, vocab_size, self.tp)
        self.present = sorted(list_files(ckpt_dir))
        self._mp_files: dict[int, dict[str, Any]] = {}
        self._mapped: dict[str, dict[str, Any]] = {}
        self._per_layer: list[dict[Any, Any]] = [self._mp_files, self._mapped]
        self._mapped_layer: Optional[int] = None

    def check(self, kinds: set[str]) -> None:
        """The files of ``kinds`` that metadata.json lists are all present (else a CheckpointError naming them)."""
        pointer = os.path.join(os.path.dirname(self.dir), TRACKER_FILE)
        check_files(self.dir, self.meta.expected_files(self.present), kinds=kinds, pointer=pointer, earlier=[])

    def load(self, name: str, mmap: bool = True) -> Any:
        """``mmap``: for files that hold more than one layer (tensors read when touched); a file of one
        layer is read whole, in large sequential reads (mapping it page by page is ~2x slower)."""
        return safe_load(os.path.join(self.dir, name), mmap=mmap)

    def layer_cache(self) -> dict[Any, Any]:
        """A cache of memory-mapped files that :meth:`map_layer` empties on each new layer."""
        cache: dict[Any, Any] = {}
        self._per_layer.append(cache)
        return cache

    def map_layer(self, layer: int) -> None:
        """Readers go through the layers in order: on a new layer, drop the memory-mapped DeepSpeed files (model
        states, ZeRO partitions); they are mapped again when read, so the pages touched for earlier layers leave
        this process's memory."""
        if self._mapped_layer != layer:
            for cache in self._per_layer:
                cache.clear()
            self._mapped_layer = layer

    def mp_file(self, mp_rank: int) -> dict[str, Any]:
        """The memory-mapped ``mp_rank_XX_model_states.pt`` of model-parallel rank ``mp_rank`` (ZeRO 0: with the
        optimizer's state). One stage's TP ranks' files are kept at a time: the pages a mapping has touched count
        in the process's memory until it is dropped, and the loaders walk the stages in order."""
        if mp_rank not in self._mp_files:
            if len(self._mp_files) >= self.tp:
                self._mp_files.clear()
            self._mp_files[mp_rank] = self.load(mp_model_file(mp_rank))
        return self._mp_files[mp_rank]

    def mapped(self, name: str, check: Any = None) -> dict[str, Any]:
        """File ``name`` memory-mapped, once per layer (dropped by :meth:`map_layer` on the next); ``check(f)``
        when it is first read."""
        if name not in self._mapped:
            f = self.load(name)
            if check is not None:
                check(f)
            self._mapped[name] = f
        return self._mapped[name]

    def shard_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        """The shape of a saved TP shard of ``spec`` (vocabulary rows padded for the saved TP)."""
        shape = list(spec.shape)
        if spec.vocab:
            shape[0] = self.rows
        if spec.partition_dim is not None:
            shape[spec.partition_dim] //= self.tp
        return tuple(shape)

    def checked(self, spec: ParamSpec, tensor: Any, where: str, key: str) -> torch.Tensor:
        """``tensor`` (``key`` of file ``where``) if it is a tensor of a saved TP shard's shape of ``spec``."""
        want = self.shard_shape(spec)
        if not torch.is_tensor(tensor):
            raise CheckpointError(f"{os.path.join(self.dir, where)}: {key!r} is not a tensor "
                                  f"({type(tensor).__name__}); the file is damaged")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{os.path.join(self.dir, where)}: {key!r} has shape {list(tensor.shape)}, "
                                  f"expected {list(want)} (TP shard of {spec.name} {list(spec.shape)} at TP "
                                  f"{self.tp}); the file does not match the checkpoint's model arguments")
        return tensor


class OptimSource:
    """One source of a checkpoint's optimizer state: :meth:`shard` (the fp32 master and Adam moments of a saved
    TP shard) and :meth:`common_state` (what every parameter shares)."""

    def __init__(self, files: CheckpointDir, weight_shard: WeightShard) -> None:
        self.files = files
        self.weight_shard = weight_shard
        self._frozen_logged: set[str] = set()

    def shard(self, spec: ParamSpec, t: int) -> OptimShard:
        raise NotImplementedError

    def common_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def untrained(self, spec: ParamSpec, t: int) -> OptimShard:
        """A parameter the optimizer did not hold (frozen with --freeze / --train-only-embeddings): its
        weight as the master and zero moments, i.e. the state a fresh optimizer would give it."""
        if spec.name not in self._frozen_logged:
            self._frozen_logged.add(spec.name)
            log.info(f"{spec.name}: no optimizer state in {self.files.dir} (frozen while training): written with "
                     f"zero Adam moments")
        weight = self.weight_shard(spec, t).detach().float()
        return {"fp32": weight, "exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight)}


__all__ = ["CheckpointDir", "OptimShard", "OptimSource", "WeightShard"]
