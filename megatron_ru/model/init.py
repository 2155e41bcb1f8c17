"""Layout-independent initialisation: a parameter's value depends only on (seed, its name).

Each weight's FULL tensor is drawn from a generator seeded by a hash of the run seed and
the parameter's global Megatron name (``decoder.layers.3.mlp.linear_fc1.weight``); the
tensor-parallel layers then keep their shard. Neither the TP/PP layout nor the order in
which stages build their layers can change the model. Padded vocabulary rows are zero, so
a layout that needs more padding starts from the same effective model.
"""
from __future__ import annotations

import math

import torch

from megatron_ru.parallel.layers import InitMethod
from megatron_ru.parallel.random import name_seed


def normal_init(std: float, seed: int, name: str, valid_rows: int | None = None) -> InitMethod:
    """Normal(0, std) for the full tensor of ``name``; rows >= ``valid_rows`` are zero."""
    def init_(full: torch.Tensor) -> None:
        gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
        if valid_rows is None:
            full.normal_(0.0, std, generator=gen)
        else:
            full.zero_()
            full[:valid_rows].normal_(0.0, std, generator=gen)
    return init_


def scaled_std(std: float, num_layers: int) -> float:
    """Megatron's output-projection std (linear_proj, linear_fc2): std / sqrt(2 * layers),
    so the residual stream's variance does not grow with depth."""
    return std / math.sqrt(2.0 * num_layers)


def ones_init(full: torch.Tensor) -> None:
    full.fill_(1.0)


def zeros_init(full: torch.Tensor) -> None:
    full.zero_()
