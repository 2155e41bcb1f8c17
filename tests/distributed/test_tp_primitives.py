"""Every tensor-parallel primitive equals its unsharded reference, forward and backward,
at TP=2 (two groups of a 4-rank world) and TP=4 — one spawn checks everything."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _check_mappings(group, rank: int, size: int, out: dict) -> None:
    from megatron_ru.parallel import mappings as m
    s, b, h = 8, 3, 4 * size
    full = _randn(s, b, h, seed=1)
    weights = [_randn(s, b, h, seed=100 + r) for r in range(size)]   # rank-dependent upstream grads
    w_sum = sum(weights)
    chunk = lambda t, dim, r: t.chunk(size, dim=dim)[r]  # noqa: E731

    x = full.clone().requires_grad_()
    y = m.copy_to_tensor_model_parallel_region(x, group)
    (y * weights[rank]).sum().backward()
    out["copy_to.fwd"] = _rel(y.detach(), full)
    out["copy_to.bwd"] = _rel(x.grad, w_sum)

    parts = [_randn(s, b, h, seed=200 + r) for r in range(size)]
    x = parts[rank].clone().requires_grad_()
    y = m.reduce_from_tensor_model_parallel_region(x, group)
    (y * weights[0]).sum().backward()
    out["reduce_from.fwd"] = _rel(y.detach(), sum(parts))
    out["reduce_from.bwd"] = _rel(x.grad, weights[0])
    out["reduce_from.input_untouched"] = _rel(x.detach(), parts[rank])

    x = full.clone().requires_grad_()
    y = m.scatter_to_tensor_model_parallel_region(x, group)
    (y * chunk(weights[rank], -1, rank)).sum().backward()
    out["scatter_to.fwd"] = _rel(y.detach(), chunk(full, -1, rank))
    out["scatter_to.bwd"] = _rel(x.grad, torch.cat([chunk(weights[r], -1, r) for r in range(size)], -1))

    x = chunk(full, -1, rank).clone().requires_grad_()
    y = m.gather_from_tensor_model_parallel_region(x, group)
    (y * weights[0]).sum().backward()
    out["gather_from.fwd"] = _rel(y.detach(), full)
    out["gather_from.bwd"] = _rel(x.grad, chunk(weights[0], -1, rank))

    x = full.clone().requires_grad_()
    y = m.scatter_to_sequence_parallel_region(x, group)
    (y * chunk(weights[rank], 0, rank)).sum().backward()
    out["scatter_to_seq.fwd"] = _rel(y.detach(), chunk(full, 0, rank))
    out["scatter_to_seq.bwd"] = _rel(x.grad, torch.cat([chunk(weights[r], 0, r) for r in range(size)], 0))

    for tp_grad in (True, False):
        x = chunk(full, 0, rank).clone().requires_grad_()
        y = m.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=tp_grad)
        (y * weights[rank]).sum().backward()
        expect = chunk(w_sum if tp_grad else weights[rank], 0, rank)
        out[f"gather_from_seq[tp_grad={tp_grad}].fwd"] = _rel(y.detach(), full)
        out[f"gather_from_seq[tp_grad={tp_grad}].bwd"] = _rel(x.grad, expect)

    x = parts[rank].clone().requires_grad_()
    y = m.reduce_scatter_to_sequence_parallel_region(x, group)
    (y * chunk(weights[rank], 0, rank)).sum().backward()
    out["reduce_scatter_to_seq.fwd"] = _rel(y.detach(), chunk(sum(parts), 0, rank))
    out["reduce_scatter_to_seq.bwd"] = _rel(x.grad, torch.cat([chunk(weights[r], 0, r) for r in range(size)], 0))


def _linear_case(layer_cls, kwargs: dict, group, rank: int, size: int, seq_parallel_in: bool,
                 seq_parallel_out: bool, stride: int, out: dict, name: str) -> None:
    from megatron_ru.parallel.utils import gather_full_tensor, shard_tensor
    s, b, n_in, n_out = 8, 2, 12, 8 * stride
    W, bias = _randn(n_out, n_in, seed=3), _randn(n_out, seed=4)
    X, G = _randn(s, b, n_in, seed=5), _randn(s, b, n_out, seed=6)
    Xr = X.clone().requires_grad_()
    Wr, br = W.clone().requires_grad_(), bias.clone().requires_grad_()
    Yr = F.linear(Xr, Wr, br)
    (Yr * G).sum().backward()

    layer = layer_cls(n_in, n_out, tp_group=group, init_method=lambda t: t.copy_(W), **kwargs)
    with torch.no_grad():
        full_bias_local = bias if layer_cls.__name__ == "RowParallelLinear" else \
            shard_tensor(bias, 0, rank, size, stride)
        layer.bias.copy_(full_bias_local)
    x_in = X
    if seq_parallel_in:
        x_in = X.chunk(size, 0)[rank]
    elif layer_cls.__name__ == "RowParallelLinear" and kwargs.get("input_is_parallel"):
        x_in = X.chunk(size, -1)[rank]
    x_in = x_in.clone().requires_grad_()
    y = layer(x_in)
    y_expect = Yr.detach()
    g = G
    if seq_parallel_out:
        y_expect, g = y_expect.chunk(size, 0)[rank], G.chunk(size, 0)[rank]
    if layer_cls.__name__ == "ColumnParallelLinear" and not kwargs.get("gather_output"):
        y_expect, g = shard_tensor(y_expect, 2, rank, size, stride), shard_tensor(g, 2, rank, size, stride)
    (y * g).sum().backward()
    x_grad_expect = Xr.grad
    if seq_parallel_in:
        x_grad_expect = x_grad_expect.chunk(size, 0)[rank]
    elif layer_cls.__name__ == "RowParallelLinear" and kwargs.get("input_is_parallel"):
        x_grad_expect = x_grad_expect.chunk(size, -1)[rank]
    out[f"{name}.fwd"] = _rel(y.detach(), y_expect)
    out[f"{name}.dx"] = _rel(x_in.grad, x_grad_expect)
    w = layer.weight
    out[f"{name}.dW"] = _rel(gather_full_tensor(w.grad, group, w.partition_dim, w.partition_stride), Wr.grad)
    bgrad = layer.bias.grad if layer_cls.__name__ == "RowParallelLinear" else \
        gather_full_tensor(layer.bias.grad, group, 0, stride)
    out[f"{name}.db"] = _rel(bgrad, br.grad)


def _check_layers(group, rank: int, size: int, out: dict) -> None:
    from megatron_ru.parallel.layers import ColumnParallelLinear, RowParallelLinear
    for gather, stride in ((True, 1), (False, 1), (False, 2)):
        _linear_case(ColumnParallelLinear, {"gather_output": gather, "partition_stride": stride}, group,
                     rank, size, False, False, stride, out, f"column[gather={gather},stride={stride}]")
    _linear_case(ColumnParallelLinear, {"sequence_parallel": True}, group, rank, size, True, False, 1, out,
                 "column[sequence_parallel]")
    for parallel_in in (False, True):
        _linear_case(RowParallelLinear, {"input_is_parallel": parallel_in}, group, rank, size, False, False,
                     1, out, f"row[input_is_parallel={parallel_in}]")
    _linear_case(RowParallelLinear, {"input_is_parallel": True, "sequence_parallel": True}, group, rank,
                 size, False, True, 1, out, "row[sequence_parallel]")


def _check_embedding_and_loss(group, rank: int, size: int, out: dict) -> None:
    from megatron_ru.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_ru.parallel.layers import VocabParallelEmbedding
    from megatron_ru.parallel.utils import gather_full_tensor, pad_vocab_size
    vocab, h = 50, 6                                   # 50 is not divisible by 4
    padded = pad_vocab_size(vocab, 3, size)            # 54 at TP=2, 60 at TP=4: some padding either way
    ids = torch.randint(0, vocab, (5, 3), generator=_gen(7))
    W = torch.cat([_randn(vocab, h, seed=8), torch.zeros(padded - vocab, h)])
    G = _randn(5, 3, h, seed=9)
    Wr = W.clone().requires_grad_()
    (F.embedding(ids, Wr) * G).sum().backward()
    emb = VocabParallelEmbedding(padded, h, tp_group=group, init_method=lambda t: t.copy_(W))
    y = emb(ids)
    (y * G).sum().backward()
    out["embedding.fwd"] = _rel(y.detach(), F.embedding(ids, W))
    out["embedding.dW"] = _rel(gather_full_tensor(emb.weight.grad, group, 0), Wr.grad)

    # 50 over 2/4 ranks: the last rank is partly padding; 10 padded to 8*tp: at TP=4 ranks 2 and 3
    # hold nothing but padding; 262,208 (multimodal Gemma 3's rows, Gemma 3 1B has 262,144): a 262k
    # vocabulary padded to 128*tp
    for vocab, divisible_by in ((50, 3), (10, 8), (262208, 128)):
        padded = pad_vocab_size(vocab, divisible_by, size)
        logits = _randn(5, 3, padded, seed=10) * 3
        logits[..., vocab:] = 40.0                     # garbage in padded columns must not matter
        target = torch.randint(0, vocab, (5, 3), generator=_gen(11))
        target[0, 0], target[0, 1] = 0, vocab - 1      # first and last real ids
        upstream = _randn(5, 3, seed=12)
        ref_in = logits[..., :vocab].clone().requires_grad_()
        ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(5, 3)
        (ref * upstream).sum().backward()
        ref_grad = torch.cat([ref_in.grad, torch.zeros(5, 3, padded - vocab)], -1)
        local = logits.chunk(size, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab)
        (loss * upstream).sum().backward()
        out[f"cross_entropy[vocab={vocab}].fwd"] = _rel(loss.detach(), ref.detach())
        out[f"cross_entropy[vocab={vocab}].bwd"] = _rel(gather_full_tensor(local.grad, group, 2), ref_grad)
        out[f"cross_entropy[vocab={vocab}].input_untouched"] = _rel(local.detach(), logits.chunk(size, -1)[rank])


def _check_rng(group, rank: int, size: int, out: dict) -> None:
    from megatron_ru.parallel.random import get_rng_tracker, model_parallel_seed
    model_parallel_seed(1234, dist.get_rank(group))
    ones = torch.ones(64)
    replicated = F.dropout(ones, 0.5, training=True)
    tracker = get_rng_tracker()
    saved = tracker.get_states()
    with tracker.fork():
        split = F.dropout(ones, 0.5, training=True)
    tracker.set_states(saved)
    with tracker.fork():
        split_again = F.dropout(ones, 0.5, training=True)
    masks = [torch.empty(2, 64) for _ in range(size)]
    dist.all_gather(masks, torch.stack([replicated, split]), group=group)
    out["rng.replicated_same_on_all_ranks"] = float(all(torch.equal(m[0], masks[0][0]) for m in masks))
    out["rng.split_differs_between_ranks"] = float(len({tuple(m[1].tolist()) for m in masks}) == size)
    out["rng.set_states_replays"] = float(torch.equal(split, split_again))


def _body(rank: int, world_size: int) -> dict:
    groups2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group4 = dist.new_group([0, 1, 2, 3])
    results = {}
    for size, group in ((2, groups2[rank // 2]), (4, group4)):
        out: dict = {}
        r = dist.get_rank(group)
        _check_mappings(group, r, size, out)
        _check_layers(group, r, size, out)
        _check_embedding_and_loss(group, r, size, out)
        _check_rng(group, r, size, out)
        results.update({f"tp{size}/{k}": v for k, v in out.items()})
    return results


def test_tp_primitives_match_unsharded_reference() -> None:
    per_rank = run_distributed(_body, world_size=4, timeout=120)
    assert len(per_rank[0]) > 60
    for rank, res in enumerate(per_rank):
        for name, value in res.items():
            if name.split("/")[1].startswith("rng."):
                assert value == 1.0, f"rank {rank}: {name} failed"
            else:
                assert value <= TOL, f"rank {rank}: {name} relative error {value:.2e} > {TOL}"
