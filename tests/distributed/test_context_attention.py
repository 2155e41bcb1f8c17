"""Context-parallel attention (megatron_ru/parallel/context.py): the ring and the all-to-all exchange give
torch's own attention over the whole sequence, forward and backward, on real gloo ranks.

The reference is ``F.scaled_dot_product_attention`` on one process with the model's own packed-document
mask (``document_causal_mask``) and a sliding-window band; each rank compares its tokens' outputs and the
gradients of its q, k and v with the reference's rows for those tokens. In fp64 the only difference is the
order of the sums (1e-12); in fp32 the log-sum-exp merge of CP blocks rounds differently from one softmax
(a few ulp of values of order 1, summed over at most 48 keys: 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

B, HEADS, D, SEQ = 2, 4, 8, 48
SCALE = 0.3
# packed documents: odd lengths, documents crossing every chunk boundary (chunks of 8 tokens at CP 3, 12 at
# CP 2), a one-token document, and another layout in the second sample
DOCS = [[5, 1, 13, 7, 22], [30, 9, 9]]


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _inputs(groups: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HEADS, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, groups, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, groups, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, HEADS, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
    docs = torch.stack([_doc_ids(lengths) for lengths in DOCS])
    return q, k, v, dout, docs


def _reference(q, k, v, dout, docs, window):
    import torch.nn.functional as F

    from megatron_ru.model.transformer import document_causal_mask
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    mask = document_causal_mask(docs) if docs is not None else torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if window is not None:
        idx = torch.arange(SEQ)
        mask = mask & ((idx[:, None] - idx[None, :]) < window)
    r = HEADS // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), attn_mask=mask,
                                         scale=SCALE)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run(rank, world, cases):
    """Every case of this world size in one spawn of the ranks (each case: its own group over all of them)."""
    import torch.distributed as dist

    from megatron_ru.parallel import context
    out = []
    for comm, groups, dtype, packed, window, tile in cases:
        context.TILE = tile
        q, k, v, dout, docs = _inputs(groups, dtype)
        docs = docs if packed else None
        ref = _reference(q, k, v, dout, docs, window)
        group = dist.new_group(list(range(world)))
        local = [context.split_sequence(t, 2, world, rank).clone().requires_grad_(True) for t in (q, k, v)]
        fn = context.ring_attention if comm == "p2p" else context.a2a_attention
        res = fn(*local, group, seq_length=SEQ, scale=SCALE, window=window,
                 document_ids=None if docs is None else context.split_sequence(docs, 1, world, rank))
        res.backward(context.split_sequence(dout, 2, world, rank))
        mine = [res.detach(), *(t.grad for t in local)]
        theirs = [context.split_sequence(t, 2, world, rank) for t in ref]
        out.append(([float((a - b).abs().max()) for a, b in zip(mine, theirs)],
                    [float(t.abs().max()) for t in theirs]))
    return out


BIG = 512  # the module's tile: one tile per block at these lengths
CASES = {  # CP size: (comm, key/value groups, dtype, packed documents, window, tile) for 4 query heads; the
    # small tiles divide neither the chunks nor the sequence, so blocks have partial tiles and skipped ones
    2: [("p2p", 2, torch.float64, False, None, BIG), ("p2p", 2, torch.float64, True, None, BIG),
        ("a2a", 2, torch.float64, True, None, BIG), ("a2a", 1, torch.float64, True, 10, BIG),
        ("p2p", 2, torch.float32, True, None, BIG), ("a2a", 2, torch.float32, True, None, BIG),
        ("p2p", 2, torch.float64, True, None, 5), ("a2a", 1, torch.float64, True, 10, 5),
        ("p2p", 2, torch.float64, False, 10, 7)],
    3: [("p2p", 1, torch.float64, True, None, BIG), ("p2p", 4, torch.float64, True, 10, BIG),
        ("p2p", 4, torch.float64, True, 10, 5)],
    4: [("a2a", 4, torch.float64, True, None, BIG), ("a2a", 2, torch.float64, False, None, BIG),
        ("a2a", 4, torch.float64, True, None, 7), ("p2p", 2, torch.float64, True, None, 5)],
}


@pytest.mark.parametrize("cp", sorted(CASES))
def test_cp_attention_equals_one_process(cp):
    cases = CASES[cp]
    for rank, results in enumerate(run_distributed(_run, cp, args=(cases,), timeout=120)):
        for case, (errors, sizes) in zip(cases, results):
            assert all(s > 0.1 for s in sizes), (case, sizes)  # outputs and every gradient are really there
            tol = 1e-12 if case[2] == torch.float64 else 1e-5
            assert max(errors) < tol, (rank, case, errors)


def test_sequence_and_head_rules_are_one_line_errors():
    from megatron_ru.parallel import context
    assert context.local_token_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.local_token_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"--seq-length 50 is not divisible by 2 x --context-parallel-size = 4"):
        context.local_token_indices(50, 2, 0)
    with pytest.raises(ValueError, match=r"6 heads per tensor-parallel rank are not divisible by "
                                         r"--context-parallel-size 4"):
        context.check_a2a_heads(6, 2, 4)
    with pytest.raises(ValueError, match=r"3 key/value groups per tensor-parallel rank and --context-parallel-size 2"):
        context.check_a2a_heads(6, 3, 2)
    context.check_a2a_heads(8, 1, 4)  # one group repeated over 4 ranks
    context.check_a2a_heads(8, 8, 4)


def test_blockwise_attention_skips_the_tiles_no_query_sees():
    """The tiles of a block: under the causal rule alone, the lower triangle of tiles (TILE 8, 48 tokens: 21 of
    36); with a window of 10 only the band of three tiles along the diagonal; with documents only tiles that meet one."""
    from megatron_ru.parallel import context
    idx = torch.arange(SEQ)
    old, context.TILE = context.TILE, 8
    try:
        def count(doc=None, window=None):
            return sum(1 for _ in context._tiles(SEQ, SEQ, idx, idx, doc, doc, window))
        assert count() == 21
        assert count(window=10) == 15  # the diagonal tiles and the two below each (9 < 10 reaches two back)
        docs = torch.stack([_doc_ids([8, 8, 8, 8, 8, 8])])  # one document per tile: the diagonal only
        assert count(doc=docs) == 6
    finally:
        context.TILE = old
