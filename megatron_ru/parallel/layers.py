"""Megatron-style tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding.

Every layer takes ``tp_group`` (``None`` = no tensor parallelism) and, where it matters,
``sequence_parallel``. Weights are initialised layout-independently: ``init_method`` fills
the FULL (unsharded) tensor on CPU, then this rank keeps its shard, so a model starts from
the same numbers whatever the TP size (see ``megatron_ru/model/init.py`` for the
name-keyed generators the model passes in).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ru.parallel.mappings import (copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           gather_from_tensor_model_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_tensor_model_parallel_region)
from megatron_ru.parallel.utils import (ProcessGroup, divide, group_rank, group_size,
                                        set_tensor_model_parallel_attributes, shard_tensor, vocab_range)
from megatron_ru.utils.memory import own_storage

InitMethod = Callable[[torch.Tensor], None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with x's leading dimensions folded into one matrix first. torch's matmul folds them itself
    only when the weight requires a gradient or when their strides are a contiguous tensor's: a frozen weight
    (embedding-only training, LoRA) against [s, 1, h] hidden states viewed from [1, s, h] (strides (h, s·h, 1)),
    or against transposed [b, s, h] ones, took the batched path instead, which copies the weight once per
    position (seconds per step for a 135M model in bf16)."""
    if x.dim() <= 2:
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def default_init(std: float = 0.02) -> InitMethod:
    """Normal(0, std) from the default generator (identical on every rank with equal seeds)."""
    def init_(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)
    return init_


def zeros_init(t: torch.Tensor) -> None:
    t.zero_()


def _make_param(full_shape: tuple[int, ...], init_method: InitMethod, group: ProcessGroup | None,
                dim: int | None, stride: int, device: torch.device | None, dtype: torch.dtype) -> nn.Parameter:
    """Fill the full tensor with ``init_method`` on CPU (fp32) and keep this rank's shard."""
    full = torch.empty(full_shape, dtype=torch.float32)
    with torch.no_grad():
        init_method(full)
    local = full if dim is None else shard_tensor(full, dim, group_rank(group), group_size(group), stride)
    # a row shard is a view of the full tensor: keep only the shard's memory
    param = nn.Parameter(own_storage(local.to(device=device, dtype=dtype).contiguous()))
    if dim is not None:
        set_tensor_model_parallel_attributes(param, dim, stride)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: rank r computes Y[..., chunk r].

    Input: [s, b, in] replicated, or [s/tp, b, in] sequence shards with ``sequence_parallel``
    (all-gathered here). Output: [s, b, out/tp], or [s, b, out] with ``gather_output``.
    ``partition_stride`` > 1 keeps fused blocks (SwiGLU's [gate; up]) aligned per rank.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None = None,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 partition_stride: int = 1, init_method: InitMethod | None = None,
                 bias_init_method: InitMethod = zeros_init, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp_size,
                                                "ColumnParallelLinear output size over tensor-parallel size")
        if gather_output and partition_stride > 1 and self.tp_size > 1:
            raise ValueError("ColumnParallelLinear: gather_output=True would interleave the "
                             f"{partition_stride} fused blocks of each rank; use gather_output=False")
        self.gather_output = gather_output
        assert not sequence_parallel or self.tp_size > 1, "sequence parallelism needs TP > 1"
        self.sequence_parallel = sequence_parallel
        self.weight = _make_param((output_size, input_size), init_method or default_init(), tp_group,
                                  0, partition_stride, device, dtype)
        self.bias = (_make_param((output_size,), bias_init_method, tp_group, 0, partition_stride, device, dtype)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        lora = getattr(self, "lora", None)
        fp8 = self.__dict__.get("fp8")  # megatron_ru/model/fp8.py (--fp8-format)
        if fp8 is not None:
            y = fp8(x, self.weight, self.bias)
        elif lora is None:
            y = linear(x, self.weight, self.bias)
        else:  # adapters (megatron_ru/model/lora.py) see the output without bias, as peft's DoRA
            y = lora.add_to(x, linear(x, self.weight), self.weight)
            y = y if self.bias is None else y + self.bias
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: each rank multiplies its slice of X and
    the partial products are summed (all-reduce, or reduce-scatter over the sequence with
    ``sequence_parallel``). The bias is replicated and added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None = None,
                 bias: bool = True, input_is_parallel: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, self.tp_size,
                                               "RowParallelLinear input size over tensor-parallel size")
        self.input_is_parallel = input_is_parallel
        assert not sequence_parallel or self.tp_size > 1, "sequence parallelism needs TP > 1"
        self.sequence_parallel = sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs input_is_parallel=True")
        self.weight = _make_param((output_size, input_size), init_method or default_init(), tp_group,
                                  1, 1, device, dtype)
        self.bias = _make_param((output_size,), zeros_init, tp_group, None, 1, device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        fp8 = self.__dict__.get("fp8")  # megatron_ru/model/fp8.py (--fp8-format)
        y = linear(x, self.weight) if fp8 is None else fp8(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        lora = getattr(self, "lora", None)
        if lora is not None:  # adapters (megatron_ru/model/lora.py) add to the summed output
            y = lora.add_to(x, y, self.weight)
        if self.bias is not None:
            # under sequence parallelism each rank adds the bias to a different sequence
            # chunk, so its gradient is partial: copy_to sums it across ranks in backward
            bias = copy_to_tensor_model_parallel_region(self.bias, self.tp_group) \
                if self.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows split over TP ranks; tokens outside this rank's rows contribute
    zeros and the partial lookups are all-reduced. ``num_embeddings`` is the padded
    vocabulary (divisible by the TP size). Output [..., embedding_dim], replicated."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None = None,
                 init_method: InitMethod | None = None, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, group_rank(tp_group), self.tp_size)
        self.weight = _make_param((num_embeddings, embedding_dim), init_method or default_init(), tp_group,
                                  0, 1, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group: ProcessGroup | None,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """Vocab-parallel logits [b, s, vocab/tp] of hidden states [s, b, h] against a weight
    split by vocabulary rows (the output layer, or the word embedding when tied). With
    ``sequence_parallel`` the input is a sequence shard [s/tp, b, h] and is gathered first."""
    if sequence_parallel and group_size(tp_group) > 1:
        hidden = gather_from_sequence_parallel_region(hidden, tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, tp_group)
    # batch-first logits: transposing h-wide activations is cheaper than vocab-wide logits
    return linear(hidden.transpose(0, 1), weight)
