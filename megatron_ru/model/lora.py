"""LoRA / DoRA adapters on the tensor-parallel linear layers (settings: megatron_ru/config/lora.py).

An adapter adds ``scaling * B(A(dropout(x)))`` to the rows of its layer's output (all rows, or one
part of a fused layer: q, k or v of linear_qkv, gate or up of a SwiGLU linear_fc1). Split over TP
ranks so that every layout computes what one process computes:

* column-parallel layer (linear_qkv, linear_fc1): A [r, in] is replicated and B is split like the
  layer's output rows (per query group for q/k/v, stride 2 for the fused gate/up). Each rank's A
  gradient covers its own rows only, so A enters through ``copy_to`` (backward: all-reduce over TP);
  the input's gradient is summed by the layer's own input collective.
* row-parallel layer (linear_proj, linear_fc2): A [r, in/tp] is split on its input like the layer and
  its partial products are summed (all-reduce, or reduce-scatter over the sequence under sequence
  parallelism); B [out, r] is replicated (through ``copy_to`` under sequence parallelism, where each
  rank sees a different part of the sequence).
* DoRA (peft's formula): ``(m / |W + s BA| - 1) * W x + (m / |W + s BA|) * s B A x`` with the row
  norm detached; a row split over TP ranks (row-parallel layers) sums its squares over TP first.
* dropout masks do not depend on the layout: each is drawn for the full input from a generator keyed
  by the adapter's name and a per-adapter call count (:func:`megatron_ru.parallel.random.keyed_dropout`),
  replayed by activation recomputation and saved with the RNG state. A row-parallel rank keeps its
  columns of the full mask.

The base weight and bias are frozen by :func:`megatron_ru.training.freeze.apply_lora_freezing`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_ru.config.linears import LINEARS
from megatron_ru.config.linears import part_rows as _part_rows
from megatron_ru.config.lora import AdapterSpec, LoraSpec, adapter_param_shapes, b_stride, model_adapters
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.init import name_seed
from megatron_ru.model.spec import PartLayout
from megatron_ru.parallel.layers import linear
from megatron_ru.parallel.mappings import (copy_to_tensor_model_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron_ru.parallel.random import keyed_dropout
from megatron_ru.parallel.utils import (ProcessGroup, group_rank, group_size, set_tensor_model_parallel_attributes,
                                        shard_tensor)

#: parameter names inside an adapter (canonical: ``<linear>.lora.<part>.lora_A``)
PARAMS = ("lora_A", "lora_B", "magnitude")


def _init_full(name: str, shape: tuple[int, ...], how: str, seed: int, std: float) -> torch.Tensor:
    """The full fp32 tensor of adapter parameter ``name`` (layout-independent: seeded by its name)."""
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    full = torch.empty(shape, dtype=torch.float32)
    kind = name.rsplit(".", 1)[1]
    if kind == "lora_B" and how != "random":
        return full.zero_()
    if kind == "magnitude":
        return full.fill_(1.0)          # replaced by the base rows' norms (init_dora_magnitudes)
    if kind == "lora_A" and how == "gaussian":
        return full.normal_(0.0, 1.0 / shape[0], generator=gen)
    if kind == "lora_A" and how == "zeros-b":
        return full.normal_(0.0, std, generator=gen)
    bound = 1.0 / math.sqrt(shape[1])    # kaiming-uniform with a = sqrt(5), as nn.Linear and peft
    return full.uniform_(-bound, bound, generator=gen)


class LoraAdapter(nn.Module):
    """One adapter's parameters and its forward (see the module docstring)."""

    def __init__(self, a: AdapterSpec, spec: LoraSpec, *, column: bool, in_features: int, out_rows: int,
                 stride: int, tp_group: ProcessGroup | None, sequence_parallel: bool, seed: int, std: float,
                 device: torch.device | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec, self.column = a, column
        self.scaling = a.scaling
        self.dropout = spec.dropout
        self.use_dora = spec.use_dora
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.in_features = in_features
        self.dropout_key = f"{seed}:{a.name}"
        tp, rank = group_size(tp_group), group_rank(tp_group)
        for pname, shape, dim, st in adapter_param_shapes(a, in_features, out_rows, column, spec.use_dora, stride):
            full = _init_full(f"{a.name}.{pname}", shape, spec.init, seed, std)
            local = full if dim is None or tp == 1 else shard_tensor(full, dim, rank, tp, st)
            p = nn.Parameter(local.to(device=device, dtype=dtype).contiguous())
            if dim is not None and tp > 1:
                set_tensor_model_parallel_attributes(p, dim, st)
            setattr(self, pname, p)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        if self.column:
            return keyed_dropout(self.dropout_key, x, self.dropout)
        tp = group_size(self.tp_group)
        full_shape = (*x.shape[:-1], x.shape[-1] * tp)
        return keyed_dropout(self.dropout_key, x, self.dropout, full_shape=full_shape,
                             columns=(group_rank(self.tp_group) * x.shape[-1], x.shape[-1]))

    @torch.no_grad()
    def row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """|W + s BA| per output row over the full input (``weight``: this rank's rows of the part)."""
        w = weight.float() + self.scaling * (self.lora_B.float() @ self.lora_A.float())
        sq = (w * w).sum(dim=1)
        if not self.column and group_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def forward(self, x: torch.Tensor, base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to its rows. ``x``: the layer's input as its matmul sees it (full
        sequence; this rank's columns for a row-parallel layer); ``base``: the layer's output rows of
        this part without bias (summed over TP for a row-parallel layer); ``weight``: this rank's base
        weight rows of the part."""
        dropped = self._dropped(x)
        if self.column:
            a = F.linear(dropped, copy_to_tensor_model_parallel_region(self.lora_A, self.tp_group))
            B = self.lora_B
        else:
            a = F.linear(dropped, self.lora_A)
            a = (reduce_scatter_to_sequence_parallel_region(a, self.tp_group) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(a, self.tp_group))
            B = copy_to_tensor_model_parallel_region(self.lora_B, self.tp_group) if self.sequence_parallel \
                else self.lora_B
        lora = F.linear(a, B)
        if not self.use_dora:
            return lora * self.scaling
        m = self.magnitude
        if not self.column and self.sequence_parallel:
            m = copy_to_tensor_model_parallel_region(m, self.tp_group)
        scale = m / self.row_norm(weight).to(m.dtype)
        if dropped is not x:  # peft: with dropout the base term uses the dropped input too
            base = linear(dropped, weight)
            if not self.column:
                base = (reduce_scatter_to_sequence_parallel_region(base, self.tp_group) if self.sequence_parallel
                        else reduce_from_tensor_model_parallel_region(base, self.tp_group))
        return (scale - 1) * base + scale * lora * self.scaling


class LinearAdapters(nn.ModuleDict):
    """The adapters of one linear layer by part (parameters ``lora.<part>.lora_A``), and how their
    outputs combine."""

    def __init__(self, adapters: dict[str, LoraAdapter], layout: PartLayout) -> None:
        super().__init__(adapters)
        self.layout = layout

    def add_to(self, x: torch.Tensor, base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``base`` plus every adapter's contribution (all [..., local output rows])."""
        if len(self) == 1 and self.layout.linear in self:
            return base + self[self.layout.linear](x, base, weight)
        deltas = {p: ad(x, self.layout.select(base, p, -1), self.layout.select(weight, p, 0))
                  for p, ad in self.items()}
        return base + self.layout.assemble(deltas, base)


def attach_adapters(linear: nn.Module, adapters: list[AdapterSpec], spec: LoraSpec, layout: PartLayout, *,
                    column: bool, part_rows: dict[str, int], stride_of: dict[str, int], seed: int, std: float) -> None:
    """Give ``linear`` (a Column/RowParallelLinear) its adapters as ``linear.lora`` (parameter names
    ``lora.<part>.lora_A``, see :func:`megatron_ru.model.spec.canonical_name`)."""
    if not adapters:
        return
    w = linear.weight
    mods = {a.part: LoraAdapter(a, spec, column=column, in_features=linear.input_size, out_rows=part_rows[a.part],
                                stride=stride_of[a.part], tp_group=linear.tp_group,
                                sequence_parallel=linear.sequence_parallel, seed=seed, std=std, device=w.device,
                                dtype=w.dtype) for a in adapters}
    linear.lora = LinearAdapters(mods, layout)


def add_layer_adapters(cfg: ModelConfig, layer_number: int, linear_name: str, linear: nn.Module, *, seed: int,
                       groups_local: int = 1, heads_per_group: int = 1) -> None:
    """Attach the adapters ``cfg`` gives to ``linear_name`` of decoder layer ``layer_number``."""
    spec = cfg.lora_spec
    if spec is None:
        return
    mine = [a for a in model_adapters(cfg) if a.layer == layer_number and a.linear == linear_name]
    if not mine:
        return
    rows = _part_rows(cfg)
    stride = {p: b_stride(cfg, p) for p in rows}
    layout = PartLayout(linear_name, groups_local, heads_per_group, cfg.head_dim)
    attach_adapters(linear, mine, spec, layout, column=LINEARS[linear_name].column, part_rows=rows, stride_of=stride,
                    seed=seed, std=cfg.init_method_std)


def lora_adapters(model: nn.Module) -> list[tuple[nn.Module, LinearAdapters]]:
    """(linear layer, its adapters) of every adapted layer of ``model``."""
    return [(m, m.lora) for m in model.modules() if isinstance(getattr(m, "lora", None), LinearAdapters)]


@torch.no_grad()
def init_dora_magnitudes(model: nn.Module) -> int:
    """Set every DoRA magnitude to its row norm |W + s BA| (peft's initialisation), from the weights the
    model holds now (after the base checkpoint is loaded); returns how many were set."""
    n = 0
    for linear, adapters in lora_adapters(model):
        for part, ad in adapters.items():
            if ad.use_dora:
                ad.magnitude.copy_(ad.row_norm(adapters.layout.select(linear.weight, part, 0)).to(ad.magnitude.dtype))
                n += 1
    return n
