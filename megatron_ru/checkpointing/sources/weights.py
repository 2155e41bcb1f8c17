"""A checkpoint's weights by file format: a saved TP shard of a parameter, by its canonical name.

* :class:`LayerWeights`: ``layer_{j:02d}-model_{t:02d}-model_states.pt`` = layer ``j``'s TP shard ``t`` (local
  names): the layer format (:mod:`megatron_ru.checkpointing.layout`) and DeepSpeed's files at PP > 1;
* :class:`MpWeights`: DeepSpeed's ``mp_rank_{t:02d}_model_states.pt`` at PP = 1, whose ``module`` holds TP shard
  ``t`` of every parameter under its canonical name (memory-mapped: only the tensors asked for are read).

A tensor a LoRA checkpoint does not hold (a frozen weight) is read from its base checkpoint (``base_shard``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.layout import layer_file, mp_model_file
from megatron_ru.checkpointing.sources.common import CheckpointDir, WeightShard
from megatron_ru.model.spec import ParamSpec


class WeightSource:
    """The weights of one file format; ``tp_field``: the part of a file name before its TP rank."""

    tp_field = ""

    def __init__(self, files: CheckpointDir, base_shard: WeightShard) -> None:
        self.files = files
        self.base_shard = base_shard

    def file(self, spec: ParamSpec, t: int) -> str:
        """The name of the file holding TP shard ``t`` of ``spec``."""
        raise NotImplementedError

    def shard(self, spec: ParamSpec, t: int) -> torch.Tensor:
        """TP shard ``t`` of ``spec`` as saved (vocabulary padding kept; read-only)."""
        raise NotImplementedError

    def read_layer(self, layer: int) -> None:
        """Every TP rank's file of ``layer`` is about to be read (full tensors are joined from them)."""

    def _take(self, spec: ParamSpec, t: int, tensors: dict[str, Any], where: str, key: str,
              list_keys: bool = False) -> torch.Tensor:
        """``tensors[key]`` (file ``where``), checked; from the LoRA base when this checkpoint does not hold it."""
        if key not in tensors and self.files.meta.lora_base is not None:
            return self.base_shard(spec, t)
        if key not in tensors:
            holds = f" (it holds {', '.join(sorted(tensors))})" if list_keys else ""
            raise CheckpointError(f"{os.path.join(self.files.dir, where)} has no {key!r}{holds}: the file is damaged "
                                  f"or from another model")
        return self.files.checked(spec, tensors[key], where, key)


class LayerWeights(WeightSource):
    """``layer_*-model_*`` files: the layer format (``own_format``: each file holds exactly its layer's parameters,
    checked) and DeepSpeed's at PP > 1. Full tensors read every TP rank's file of a layer whole, the next layer's
    meanwhile; a single shard is read from its memory-mapped file."""

    tp_field = "-model_"

    def __init__(self, files: CheckpointDir, base_shard: WeightShard, own_format: bool) -> None:
        super().__init__(files, base_shard)
        self.own_format = own_format
        self._layer: Optional[tuple[int, list[dict[str, Any]]]] = None
        self._ahead: Optional[tuple[int, Any]] = None   # (layer, Future of its files) read in the background
        self._pool: Any = None

    def file(self, spec: ParamSpec, t: int) -> str:
        return layer_file(spec.layer_index, t)

    def _read_layer_files(self, layer: int) -> list[dict[str, Any]]:
        return [self.files.load(layer_file(layer, t), mmap=False) for t in range(self.files.tp)]

    def _layer_files(self, layer: int) -> list[dict[str, Any]]:
        """Layer ``layer``'s files; the next layer's are read meanwhile in a background thread (readers
        go through the layers in order: reading overlaps joining and writing; two layers in memory)."""
        ahead = self._ahead
        self._ahead = None
        files = ahead[1].result() if ahead is not None and ahead[0] == layer else self._read_layer_files(layer)
        nxt = layer + 1
        if any(s.layer_index == nxt for s in self.files.specs.values()) and \
                all(layer_file(nxt, t) in self.files.present for t in range(self.files.tp)):
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-read-ahead")
            self._ahead = (nxt, self._pool.submit(self._read_layer_files, nxt))
        return files

    def _check_layer_file(self, layer: int, t: int, f: dict[str, Any]) -> None:
        if self.own_format:  # our own files hold exactly the layer's parameters
            expected = {s.local_name for s in self.files.specs.values() if s.layer_index == layer}
            unexpected = sorted(set(f) - expected)
            if unexpected:
                raise CheckpointError(
                    f"{os.path.join(self.files.dir, layer_file(layer, t))} holds {', '.join(unexpected)}, which "
                    f"layer {layer} of the model in metadata.json does not have: the file is from another "
                    f"model or metadata.json was altered")

    def read_layer(self, layer: int) -> None:
        """Every TP rank's file of layer ``layer``, kept until the next layer is read."""
        if self._layer is None or self._layer[0] != layer:
            self._layer = None  # drop the previous layer's files before reading the next
            files = self._layer_files(layer)
            for t, f in enumerate(files):
                self._check_layer_file(layer, t, f)
            self._layer = (layer, files)

    def _shard_file(self, layer: int, t: int) -> dict[str, Any]:
        """TP rank ``t``'s file of layer ``layer`` alone (memory-mapped: a loading rank reads only the shards,
        or the parts of them, it keeps), unless every TP rank's file of the layer is already in memory."""
        if self._layer is not None and self._layer[0] == layer:
            return self._layer[1][t]
        self.files.map_layer(layer)
        return self.files.mapped(layer_file(layer, t), lambda f: self._check_layer_file(layer, t, f))

    def shard(self, spec: ParamSpec, t: int) -> torch.Tensor:
        return self._take(spec, t, self._shard_file(spec.layer_index, t), layer_file(spec.layer_index, t),
                          spec.local_name, list_keys=True)


class MpWeights(WeightSource):
    """DeepSpeed's ``mp_rank_*_model_states.pt`` files at PP = 1 (memory-mapped, one stage's at a time)."""

    tp_field = "mp_rank_"

    def file(self, spec: ParamSpec, t: int) -> str:
        return mp_model_file(t)

    def shard(self, spec: ParamSpec, t: int) -> torch.Tensor:
        self.files.map_layer(spec.layer_index)
        return self._take(spec, t, self.files.mp_file(t).get("module") or {}, mp_model_file(t), spec.name)
