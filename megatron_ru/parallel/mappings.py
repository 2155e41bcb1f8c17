"""Autograd collectives for tensor and sequence parallelism, named for their forward/backward pair.

=========================================  ==========================  ==========================
wrapper                                    forward                     backward
=========================================  ==========================  ==========================
copy_to_tensor_model_parallel_region       identity                    all-reduce
reduce_from_tensor_model_parallel_region   all-reduce                  identity
scatter_to_tensor_model_parallel_region    split last dim              all-gather last dim
gather_from_tensor_model_parallel_region   all-gather last dim         split last dim
scatter_to_sequence_parallel_region        split first dim             all-gather first dim
gather_from_sequence_parallel_region       all-gather first dim        reduce-scatter first dim
reduce_scatter_to_sequence_parallel_region reduce-scatter first dim    all-gather first dim
=========================================  ==========================  ==========================

Every wrapper takes the process group explicitly; ``None`` (or a group of size 1) makes it
the identity. Activations in sequence-parallel regions are laid out [s, b, h], so "first
dim" is the sequence.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ru.parallel.utils import ProcessGroup, divide, group_rank, group_size

# torch 2.13 renamed the flat-tensor collectives; keep working on older torch (clusters' containers)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # a copy: the input may be saved for another op's backward
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    width = divide(x.shape[-1], size, "last dimension of a tensor scattered over tensor-parallel ranks")
    return x.narrow(-1, group_rank(group) * width, width).contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    rows = divide(x.shape[0], size, "sequence length (first dimension) under sequence parallelism")
    return x.narrow(0, group_rank(group) * rows, rows).contiguous()


def _gather_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER_SINGLE(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    rows = divide(x.shape[0], size, "sequence length (first dimension) under sequence parallelism")
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _REDUCE_SCATTER_SINGLE(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        # The consumer of the gathered tensor is a tensor-parallel op: each rank holds a
        # partial gradient of the full sequence, so sum across ranks and keep our chunk.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def _collective(fn: type, x: torch.Tensor, group: ProcessGroup, *extra) -> torch.Tensor:
    """Run ``fn`` (one of the Functions above); outside any ``torch.compile`` graph once
    :func:`keep_collectives_out_of_compiled_graphs` ran."""
    return fn.apply(x, group, *extra)


def keep_collectives_out_of_compiled_graphs() -> None:
    """Before ``torch.compile`` of a layer (``--torch-compile``): a compiled transformer layer breaks its graph at
    each collective, which runs eagerly on the process group as given. Done at that point rather than at import:
    ``torch.compiler.disable`` imports torch's compiler (about 1.5 s of every process's start-up)."""
    global _collective
    if not getattr(_collective, "_kept_out", False):
        _collective = torch.compiler.disable(_collective)
        _collective._kept_out = True  # type: ignore[attr-defined]


def _apply(fn: type, x: torch.Tensor, group: ProcessGroup | None, *extra) -> torch.Tensor:
    if group_size(group) == 1:  # identity both ways (and no graph break in a compiled layer)
        return x
    return _collective(fn, x, group, *extra)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward identity; backward all-reduce (the input feeds every TP rank's partial op)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-reduce of partial results; backward identity."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dimension; backward: all-gather it."""
    return _apply(_ScatterToRegion, x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dimension; backward: keep this rank's chunk."""
    return _apply(_GatherFromRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the sequence (dim 0); backward: all-gather it."""
    return _apply(_ScatterToSequenceRegion, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence (dim 0). Backward: reduce-scatter when the gathered
    tensor feeds a tensor-parallel op (the default), else just keep this rank's chunk."""
    return _apply(_GatherFromSequenceRegion, x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: sum partial results and keep this rank's chunk of the sequence; backward: all-gather."""
    return _apply(_ReduceScatterToSequenceRegion, x, group)
