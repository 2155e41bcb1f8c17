"""The shard arithmetic of the model description (:mod:`megatron_ru.model.spec`): how many vocabulary rows a
layout holds, a TP rank's part of a canonical tensor, and that part read from the shards of a checkpoint
saved at another TP size. The model's layers, the checkpoint writer and loader and the inference runner
all cut tensors here, so that a parameter is split one way wherever it is split."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.parallel.utils import pad_vocab_size, shard_tensor

if TYPE_CHECKING:
    from megatron_ru.model.spec import ParamSpec


def padded_vocab_rows(cfg: ModelConfig, vocab_size: int, tp: int) -> int:
    """Rows of the vocabulary matrices at tensor-parallel size ``tp``."""
    return pad_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, tp)


def layout_shard(spec: "ParamSpec", full: torch.Tensor, rows: int, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of canonical tensor ``full`` at tensor-parallel size ``tp``: the
    vocabulary matrices padded with zero rows to ``rows`` (:func:`padded_vocab_rows`), then split by
    the parameter's dim and stride (replicated parameters: ``full`` itself)."""
    if spec.vocab and rows > full.shape[0] and spec.partition_dim == 0 and spec.partition_stride == 1:
        # cut this rank's rows first, pad only them: no padded copy of the whole matrix
        per = rows // tp
        lo, hi, have = tp_rank * per, (tp_rank + 1) * per, full.shape[0]
        part = full[min(lo, have): min(hi, have)]
        if hi > have:
            part = torch.cat([part, full.new_zeros((hi - max(lo, have), *full.shape[1:]))], dim=0)
        return part
    if spec.vocab and rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))], dim=0)
    if spec.partition_dim is None or tp == 1:
        return full
    return shard_tensor(full, spec.partition_dim, tp_rank, tp, spec.partition_stride)


def shard_from_saved(spec: "ParamSpec", read: Callable[[int], torch.Tensor], real: int, saved_rows: int,
                     saved_tp: int, rows: int, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard at TP size ``tp`` (vocabulary rows padded to ``rows``) taken from the shards
    of a checkpoint saved at TP size ``saved_tp`` (padded to ``saved_rows``), reading only the parts it overlaps:
    ``read(t)`` is saved shard ``t``. Equal to :func:`layout_shard` of the whole tensor, for any pair of TP sizes
    and strides: along the split dim each of the ``stride`` pieces is cut in contiguous, equal blocks, so a
    rank's block of a piece is the concatenation of (views of) the saved blocks it overlaps; rows at or beyond
    ``real`` (the unpadded row count, vocabulary matrices only) are zeros. Replicated: ``read(0)``."""
    dim, stride = spec.partition_dim, spec.partition_stride
    if dim is None:
        return read(0)
    if not spec.vocab:
        real = saved_rows = rows = spec.shape[dim]
    saved_block, block = saved_rows // stride // saved_tp, rows // stride // tp
    real_piece = real // stride if not spec.vocab else real
    parts: list[torch.Tensor] = []
    for i in range(stride):
        lo, hi = tp_rank * block, (tp_rank + 1) * block  # within piece i
        a = lo
        while a < min(hi, real_piece):
            t = a // saved_block
            b = min(hi, real_piece, (t + 1) * saved_block)
            parts.append(read(t).narrow(dim, i * saved_block + a - t * saved_block, b - a))
            a = b
        if hi > max(lo, real_piece):
            like = read(0)
            shape = list(like.shape)
            shape[dim] = hi - max(lo, real_piece)
            parts.append(like.new_zeros(shape))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
