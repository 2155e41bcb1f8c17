"""Pure helpers for tensor parallelism: group sizes, divisibility, sharding, vocab padding.

Sharding is described by two numbers kept on every tensor-parallel parameter:
``partition_dim`` (the dimension split across TP ranks) and ``partition_stride``. With
stride 1 rank ``r`` owns the ``r``-th contiguous chunk of the full tensor. With stride
``k`` the full tensor is ``k`` equal pieces along ``partition_dim`` (e.g. SwiGLU's fused
``[gate; up]``) and rank ``r`` owns the ``r``-th chunk of *each* piece, concatenated — so
every rank still holds matching gate and up rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; ``None`` means no tensor parallelism (size 1)."""
    if group is None:
        return 1
    return dist.get_world_size(group=group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when ``group`` is None."""
    if group is None:
        return 0
    return dist.get_rank(group=group)


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division; a clear error instead of silently rounding."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` that is >= ``vocab_size``
    (Megatron's ``--make-vocab-size-divisible-by`` rule)."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    if divisible_by < 1 or tp_size < 1:
        raise ValueError(f"--make-vocab-size-divisible-by ({divisible_by}) and tensor-parallel "
                         f"size ({tp_size}) must be >= 1")
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def vocab_range(padded_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows owned by ``rank``."""
    per_rank = divide(padded_vocab_size, world_size, "padded vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1) -> torch.Tensor:
    """The part of ``full`` that TP rank ``rank`` owns (see module docstring for ``stride``)."""
    pieces = torch.chunk(full, stride, dim=dim) if stride > 1 else (full,)
    parts = []
    for piece in pieces:
        size = divide(piece.shape[dim], world_size, f"dimension {dim} of a sharded tensor")
        parts.append(piece.narrow(dim, rank * size, size))
    return torch.cat(parts, dim=dim).contiguous() if stride > 1 else parts[0].contiguous()


def unshard_tensors(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's shard."""
    if stride == 1:
        return torch.cat(shards, dim=dim)
    per_rank_pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    pieces = [torch.cat([p[i] for p in per_rank_pieces], dim=dim) for i in range(stride)]
    return torch.cat(pieces, dim=dim)


def set_tensor_model_parallel_attributes(param: torch.Tensor, dim: int, stride: int = 1) -> None:
    """Mark ``param`` as split across TP ranks. DeepSpeed reads ``tensor_model_parallel``
    (so replicated parameters are counted once in the gradient norm); our init and the
    gather helpers read ``partition_dim``/``partition_stride``."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride


def is_tensor_model_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def gather_full_tensor(local: torch.Tensor, group: ProcessGroup | None, dim: int, stride: int = 1) -> torch.Tensor:
    """All-gather every TP rank's shard of a parameter (or its gradient) into the full tensor.
    Not differentiable; for checkpoints, conversion and tests."""
    size = group_size(group)
    if size == 1:
        return local.detach().clone()
    local = local.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return unshard_tensors(shards, dim, stride)
