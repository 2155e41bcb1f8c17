"""The optimizer kernels and the gradient clipping, element by element: what makes a sharded layout's update
the one-process update (docs/training.md, Engine)."""
from __future__ import annotations

import pytest
import torch

from megatron_ru.training.engine import adam_kernel, clip_grad_norm_tp_aware, grad_norm_tp_aware

N = 1003  # not a multiple of any SIMD width: the whole tensor ends in a partial vector


def _adamw_steps(splits: list[int], **kernel: bool) -> torch.Tensor:
    """Five AdamW steps over one weight of N elements held as tensors of SPLITS sizes; the weight after them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, generator=g)
    grads = [torch.randn(N, generator=g) for _ in range(5)]
    params = [torch.nn.Parameter(x.clone()) for x in weight.split(splits)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kernel)
    for grad in grads:
        for p, piece in zip(params, grad.split(splits)):
            p.grad = piece.clone()
        opt.step()
    return torch.cat([p.detach() for p in params])


SHARDINGS = {"halves": [501, 502], "sevens": [7] * 143 + [2], "ones": [1] * N}


def test_auto_is_the_for_loop_on_cpu():
    assert adam_kernel("auto", [{"params": [torch.nn.Parameter(torch.zeros(2))]}]) == {"foreach": False}
    assert adam_kernel("fused", []) == {"fused": True} and adam_kernel("foreach", []) == {"foreach": True}


@pytest.mark.parametrize("sharding", sorted(SHARDINGS))
def test_for_loop_and_foreach_give_the_one_tensor_update_at_any_sharding(sharding):
    whole = _adamw_steps([N], foreach=False)
    assert torch.equal(_adamw_steps(SHARDINGS[sharding], foreach=False), whole)
    assert torch.equal(_adamw_steps(SHARDINGS[sharding], foreach=True), whole)


def test_fused_cpu_kernel_is_sharding_invariant_at_whole_vectors():
    """The fused CPU kernel computes a tensor's last partial SIMD vector on a scalar path that may round
    differently (measured: shards of 7 or 1 elements differ from the whole tensor in the last bit): it is the
    one-tensor update when every shard but the last is a whole number of vectors (64 floats covers AVX-512)."""
    whole = _adamw_steps([N], fused=True)
    assert torch.equal(_adamw_steps([64] * 15 + [N - 960], fused=True), whole)
    assert torch.equal(_adamw_steps([512, N - 512], fused=True), whole)


def test_clipping_is_per_tensor_norms_and_one_scale():
    """The multi-tensor norm and scale are, bit for bit, the per-tensor fp32 norms combined in float64 and
    one multiply per tensor."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(300, 64), (64,), (N,), (7,), (129, 3)]]
    for p in params:
        p.grad = 3 * torch.randn(p.shape, generator=g)
    norms = torch.stack([torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32) for p in params])
    expected = norms.double().pow(2).sum().sqrt().float()
    assert torch.equal(grad_norm_tp_aware(params, 0, None), expected)
    coef = torch.clamp(1.0 / (expected + 1e-6), max=1.0)
    assert coef < 1  # the gradients are clipped
    scaled = [p.grad.clone().mul_(coef) for p in params]
    assert torch.equal(clip_grad_norm_tp_aware(params, 1.0, 0, None), expected)
    assert all(torch.equal(p.grad, s) for p, s in zip(params, scaled))
