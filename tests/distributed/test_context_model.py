"""The whole model under context parallelism (GPTModel with megatron_ru.parallel.context enabled, on gloo
ranks) computes what one process computes: each CP rank holds its chunks of every sample
(``Batch.for_context_parallel``), the ranks' losses average to the single process's loss and their
gradients, averaged over the CP group (as DeepSpeed averages them over DP x CP), equal its gradients.

Llama-shaped (RoPE, GQA, SwiGLU, RMSNorm, untied) and Gemma-shaped (local layers with a window, query/key
norms, (1 + w) sandwich norms, GeGLU, tied) models; packed documents with --reset-position-ids
--reset-attention-mask --eod-mask-loss (documents crossing chunk boundaries, a lone end-of-document, a
sample whose last chunks are all masked) and plain samples; both exchanges; TP 2 x CP 2 with sequence
parallelism. fp32: the sums run in another order (the CP merge, the gradient average), so 1e-5 relative.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VOCAB, SEQ, EOD = 61, 48, 60
RTOL = 1e-5
#: a token's loss under CP vs its document alone: fp32 sums in another order through 2 layers (a few ulp)
PER_TOKEN_RTOL = 1e-6


def _config(shape: str):
    from megatron_ru.config.model import ModelConfig
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  make_vocab_size_divisible_by=4, max_position_embeddings=SEQ, position_embedding_type="rope",
                  normalization="RMSNorm", disable_bias_linear=True, group_query_attention=True,
                  num_query_groups=2)
    if shape == "llama":
        return ModelConfig(**common, swiglu=True, untie_embeddings_and_output_weights=True)
    return ModelConfig(**common, geglu=True, sandwich_norm=True, apply_layernorm_1p=True, scale_embeddings=True,
                       qk_layernorm=True, kv_channels=16, softmax_scale=0.2, sliding_window=7,
                       window_attn_skip_freq=2, rotary_base_local=10000)


def _batch(packed: bool):
    from megatron_ru.data.documents import DocumentMasking
    from megatron_ru.training.data import collate
    gen = torch.Generator().manual_seed(5)
    rows = []
    # documents of odd lengths crossing the chunk boundaries (12 tokens at CP 2, 8 at CP 3), a lone EOD; the
    # second sample starts and ends with runs of EOD (masked): at CP 3 rank 0's chunks of it (0 and 5) score nothing
    for lengths in ((5, 1, 13, 7, 22), (9, 3, 36)):
        docs = [torch.randint(0, EOD, (n,), generator=gen) for n in lengths]
        for d in docs[:-1]:
            d[-1] = EOD
        rows.append(torch.cat(docs + [torch.randint(0, EOD, (1,), generator=gen)]))
    rows[1][:8] = EOD
    rows[1][-14:] = EOD
    return collate([{"tokens": r.numpy()} for r in rows], DocumentMasking(EOD, True, True, True) if packed else None)


def _loss_and_grads(model, batch):
    tokens, labels = batch.tokens, batch.loss_targets()
    loss = model(tokens, labels, position_ids=batch.position_ids, document_ids=batch.document_ids)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(rank, world, cases):
    """Every case of this world size in one spawn of the ranks."""
    return [_per_token(rank, world, *case[1:]) if case[0] == "per-token" else _case(rank, world, *case)
            for case in cases]


def _per_token(rank, world, comm):
    """Per-token losses of one packed sequence under CP (the ranks' tokens put back in order) against each of
    its documents run alone through the same model: {"max": relative error, "tokens": how many compared}."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_ru.data.documents import DocumentMasking
    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.parallel.context import enable_context_parallel, local_token_indices
    from megatron_ru.training.data import collate
    cfg = _config("llama")
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, EOD, (n,), generator=gen) for n in (5, 1, 13, 7, 22)]  # odd lengths, across chunks
    for d in docs[:-1]:
        d[-1] = EOD
    row = torch.cat(docs + [torch.randint(0, EOD, (1,), generator=gen)])
    batch = collate([{"tokens": row.numpy()}], DocumentMasking(EOD, True, True, True))
    alone, plain = [], GPTModel(cfg, VOCAB, None, seed=3)
    with torch.no_grad():
        for d in docs:  # a document alone: its tokens predict its next tokens (the last one is the EOD or the end)
            logits = plain(d[None])[0, :-1].float()
            alone.append(F.cross_entropy(logits, d[1:], reduction="none"))
        group = dist.new_group(list(range(world)))
        model = GPTModel(cfg, VOCAB, None, seed=3)
        enable_context_parallel(model, group, comm)
        part = batch.for_context_parallel(world, rank)
        logits = model(part.tokens, position_ids=part.position_ids, document_ids=part.document_ids)[0].float()
        mine = F.cross_entropy(logits, part.labels[0], reduction="none")
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
    packed = torch.empty(SEQ)
    for r, losses in enumerate(parts):
        packed[local_token_indices(SEQ, world, r)] = losses
    start, worst, count = 0, 0.0, 0
    for d, losses in zip(docs, alone):
        here = packed[start:start + len(d) - 1]
        worst = max(worst, float(((here - losses).abs() / losses.abs()).max()) if len(losses) else 0.0)
        start, count = start + len(d), count + len(losses)
    return {"max": worst, "tokens": count}


def _case(rank, world, shape, packed, comm, tp):
    import torch.distributed as dist

    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.parallel.context import enable_context_parallel
    from megatron_ru.parallel.topology import ParallelLayout
    cfg = _config(shape)
    batch = _batch(packed)
    ref_loss, ref_grads = _loss_and_grads(GPTModel(cfg, VOCAB, None, seed=3), batch)
    layout = ParallelLayout(world, tp=tp, pp=1, cp=world // tp)
    groups = {}
    for kind, all_groups in layout.groups():  # every rank creates every group, in the same order
        for members in all_groups:
            pg = dist.new_group(members)
            if rank in members:
                groups[kind] = pg
    coord = layout.coord(rank)
    model = GPTModel(cfg, VOCAB, groups["tp"] if tp > 1 else None, tp > 1, seed=3)
    assert enable_context_parallel(model, groups["cp"], comm) == cfg.num_layers
    loss, grads = _loss_and_grads(model, batch.for_context_parallel(layout.cp, coord.cp))
    dist.all_reduce(loss, group=groups["cp"])
    loss /= layout.cp
    errors = {"loss": abs(float(loss - ref_loss)) / abs(float(ref_loss))}
    for name, g in grads.items():
        dist.all_reduce(g, group=groups["cp"])
        g /= layout.cp
        ref = ref_grads[name]
        if tp > 1 and g.shape != ref.shape:  # this TP rank's shard of the reference
            dim = next(i for i, (a, b) in enumerate(zip(g.shape, ref.shape)) if a != b)
            if name.endswith("linear_fc1.weight"):  # gated: each rank holds its rows of the gate and of the up part
                ref = torch.cat([half.chunk(tp, dim=dim)[coord.tp] for half in ref.chunk(2, dim=dim)], dim=dim)
            else:
                ref = ref.chunk(tp, dim=dim)[coord.tp]
        errors[name] = float((g - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
    return errors


CASES = {  # ranks: (shape, packed documents, exchange, TP), or ("per-token", exchange)
    2: [("llama", True, "p2p", 1), ("llama", False, "a2a", 1), ("gemma", True, "a2a", 1), ("per-token", "p2p"),
        ("per-token", "a2a")],
    3: [("gemma", True, "p2p", 1)],
    4: [("llama", True, "p2p", 2)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_model_under_cp_equals_one_process(world):
    cases = CASES[world]
    for rank, results in enumerate(run_distributed(_run, world, args=(cases,), timeout=300)):
        for case, errors in zip(cases, results):
            if case[0] == "per-token":  # 48 tokens in 5 documents: all but each document's last one compared
                assert errors["tokens"] == 48 - 5 and errors["max"] < PER_TOKEN_RTOL, (rank, case, errors)
                continue
            bad = {k: v for k, v in errors.items() if not v < RTOL}
            assert not bad, (rank, case, bad)


def test_cp_batch_split_keeps_each_tokens_position_document_and_denominator():
    from megatron_ru.parallel.context import local_token_indices
    batch = _batch(True)
    parts = [batch.for_context_parallel(3, r) for r in range(3)]
    for r, part in enumerate(parts):
        idx = local_token_indices(SEQ, 3, r)
        for name in ("tokens", "labels", "position_ids", "document_ids", "loss_mask"):
            assert torch.equal(getattr(part, name), getattr(batch, name)[:, idx]), name
        assert float(part.loss_denominator) == pytest.approx(float(batch.loss_mask.sum()) / 3)
    # rank 0 holds nothing that scores in sample 2 (chunks 0 and 5 are EOD runs)
    assert float(parts[0].loss_mask[1].sum()) == 0 and float(parts[1].loss_mask[1].sum()) > 0
    plain = _batch(False).for_context_parallel(2, 1)
    assert torch.equal(plain.position_ids[0], local_token_indices(SEQ, 2, 1))  # explicit positions for RoPE
    assert plain.document_ids is None and plain.loss_mask is None
    assert float(plain.loss_denominator) == 2 * SEQ / 2
