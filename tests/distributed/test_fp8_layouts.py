"""FP8 linears under tensor parallelism (with and without sequence parallelism) and context parallelism quantize
to the values one process does: a sharded operand is scaled by the whole tensor's amax. Checked at the linear,
where the inputs are the same numbers on every layout, so the outputs and both gradients must equal one
process's to fp32 summation order; with each rank's own amax (the scaling torchao applies to a plain local
tensor) they would differ by FP8's rounding, ~1e-2 (the control below)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOL = 1e-6  # fp32 summation order (the row-parallel all-reduce, a CP rank's share of the weight gradient)
CONTROL = 1e-3  # what one rank's own amax moves the result by, at least


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _pair(seed: int, sp: bool, tp_group, fp8_group_for_cp=None, local_amax: bool = False):
    """A column-parallel then row-parallel linear (an MLP's shape), FP8, on ``tp_group`` (None: one process)."""
    from megatron_ru.model.fp8 import Fp8Matmul, Fp8Spec, float8_config
    from megatron_ru.parallel.layers import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(seed)
    spec = Fp8Spec("hybrid", "tensorwise")
    config = float8_config(spec, torch.device("cpu"))
    fc1 = ColumnParallelLinear(64, 128, tp_group=tp_group, bias=False, sequence_parallel=sp)
    fc2 = RowParallelLinear(128, 64, tp_group=tp_group, bias=False, input_is_parallel=True, sequence_parallel=sp)
    for mod, kind in ((fc1, "column"), (fc2, "row")):
        mod.fp8 = Fp8Matmul(spec, config, kind, tp_group, mod.tp_size, fp8_group_for_cp)
        if local_amax:  # the control: every operand scaled by this rank's own amax
            mod.fp8.weight_groups, mod.fp8.input_groups, mod.fp8.output_groups = [], [], []
    return fc1, fc2


def _run(fc1, fc2, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    y.backward(grad)
    return y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad


def _body(rank: int, world_size: int) -> dict:
    from megatron_ru.parallel.utils import gather_full_tensor
    group = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 64, generator=gen) * torch.linspace(0.1, 3.0, 64)  # [s, b, h], uneven scales
    grad = torch.randn(16, 2, 64, generator=gen)
    ref = _run(*_pair(3, False, None), x, grad)
    out: dict = {}
    for sp in (False, True):
        for local in (False, True):
            fc1, fc2 = _pair(3, sp, group, local_amax=local)
            s = slice(8 * rank, 8 * rank + 8)
            xs, gs = (x[s], grad[s]) if sp else (x, grad)
            y, gx, g1, g2 = _run(fc1, fc2, xs, gs)
            g1 = gather_full_tensor(g1, group, 0)
            g2 = gather_full_tensor(g2, group, 1)
            key = f"tp2/sp={sp}/{'local amax' if local else 'whole amax'}"
            out[key] = max(_rel(y, ref[0][s] if sp else ref[0]), _rel(gx, ref[1][s] if sp else ref[1]),
                           _rel(g1, ref[2]), _rel(g2, ref[3]))
    # context parallelism: each rank holds half of the tokens (the sequence), the weights whole
    for local in (False, True):
        fc1, fc2 = _pair(3, False, None, fp8_group_for_cp=group, local_amax=local)
        s = slice(8 * rank, 8 * rank + 8)
        y, gx, g1, g2 = _run(fc1, fc2, x[s], grad[s])
        dist.all_reduce(g1, group=group)  # the weight gradient: each CP rank's share of the tokens
        dist.all_reduce(g2, group=group)
        key = f"cp2/{'local amax' if local else 'whole amax'}"
        out[key] = max(_rel(y, ref[0][s]), _rel(gx, ref[1][s]), _rel(g1, ref[2]), _rel(g2, ref[3]))
    return out


def test_fp8_linears_at_tp2_sp_and_cp2_quantize_as_one_process() -> None:
    for rank, res in enumerate(run_distributed(_body, world_size=2, timeout=300)):
        for key, value in res.items():
            if "whole amax" in key:
                assert value <= TOL, f"rank {rank}: {key}: {value:.3e} > {TOL}"
            else:
                assert value >= CONTROL, f"rank {rank}: {key}: {value:.3e}: the control did not move"
