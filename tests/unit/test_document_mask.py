"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss, --calculate-per-token-loss):
the vectorised ids and masks against a straightforward per-document loop (Megatron's rule written out), the
per-token losses of a packed sequence against each document run alone, and the losses of the loss mask and
of the per-token mode against hand computations."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.data.documents import DocumentMasking, document_ids_and_positions
from megatron_ru.model.gpt import GPTLoss, GPTModel
from megatron_ru.model.transformer import document_causal_mask
from megatron_ru.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ru.training.data import Batch, collate, per_token_denominators, pipeline_items

EOD = 49
VOCAB = 50


def _reference(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position ids, attention mask [b, s, s] (True = may attend) and loss mask, token by token: a document
    runs up to and including its EOD; positions count from its first token; a query sees the earlier keys of
    its own document; the loss is masked where the input token is EOD."""
    b, s = tokens.shape
    positions = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, s, dtype=torch.bool)
    for r in range(b):
        start = 0
        for t in range(s):
            positions[r, t] = t - start
            for k in range(start, t + 1):
                mask[r, t, k] = True
            if int(tokens[r, t]) == eod:
                start = t + 1
    return positions, mask, (tokens != eod).float()


def _packed(gen: torch.Generator, b: int, s: int, p_eod: float) -> torch.Tensor:
    tokens = torch.randint(0, EOD, (b, s), generator=gen)
    tokens[torch.rand(b, s, generator=gen) < p_eod] = EOD
    return tokens


@pytest.mark.parametrize("p_eod", [0.0, 0.1, 0.5, 1.0])
def test_ids_and_masks_equal_the_per_document_loop(p_eod: float) -> None:
    gen = torch.Generator().manual_seed(int(p_eod * 10))
    tokens = _packed(gen, 4, 37, p_eod)
    tokens[0, 0] = tokens[1, -1] = EOD               # an EOD first and last
    tokens[2, 5:8] = EOD                             # EODs back to back (one-token documents)
    want_pos, want_mask, want_loss = _reference(tokens, EOD)
    doc, pos = document_ids_and_positions(tokens, EOD)
    assert torch.equal(pos, want_pos)
    assert torch.equal(document_causal_mask(doc)[:, 0], want_mask)
    full = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    got_pos, got_doc, got_loss = full.apply(tokens)
    assert torch.equal(got_pos, want_pos) and torch.equal(got_doc, doc) and torch.equal(got_loss, want_loss)
    # each flag alone: only what it asks for (positions travel with document ids, counting 0..s-1)
    pos_only = DocumentMasking(EOD, reset_position_ids=True).apply(tokens)
    assert torch.equal(pos_only[0], want_pos) and pos_only[1] is None and pos_only[2] is None
    mask_only = DocumentMasking(EOD, reset_attention_mask=True).apply(tokens)
    assert torch.equal(mask_only[0], torch.arange(37).expand(4, 37)) and torch.equal(mask_only[1], doc)
    loss_only = DocumentMasking(EOD, eod_mask_loss=True).apply(tokens)
    assert loss_only[0] is None and loss_only[1] is None and torch.equal(loss_only[2], want_loss)
    assert not DocumentMasking(EOD).active


def test_collate_and_pipeline_items_carry_the_ids() -> None:
    import numpy as np
    sample = {"tokens": np.array([3, 4, EOD, 5, 6, EOD, 7, 8, 9])}
    documents = DocumentMasking(EOD, True, True, True)
    b = collate([sample, sample], documents)
    assert b.position_ids.tolist()[0] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert b.document_ids.tolist()[0] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert b.loss_mask.tolist()[0] == [1, 1, 0, 1, 1, 0, 1, 1]
    inputs, targets = next(pipeline_items([b]))
    assert len(inputs) == 3 and len(targets) == 2 and inputs[0] is b.tokens
    plain = collate([sample])
    assert next(pipeline_items([plain])) == (plain.tokens, plain.labels)
    assert plain.position_ids is None and plain.loss_targets() is plain.labels


def _configs() -> dict[str, ModelConfig]:
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  make_vocab_size_divisible_by=4, max_position_embeddings=64)
    return {"llama": ModelConfig(**common, group_query_attention=True, num_query_groups=2,
                                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                 disable_bias_linear=True, untie_embeddings_and_output_weights=True),
            "gpt2": ModelConfig(**common, position_embedding_type="learned_absolute", normalization="LayerNorm"),
            # a sliding window narrows the documents' additive mask as it does the causal rule
            "llama-window-5": ModelConfig(**common, position_embedding_type="rope", normalization="RMSNorm",
                                          swiglu=True, sliding_window=5)}


def _token_losses(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, **kw) -> torch.Tensor:
    return vocab_parallel_cross_entropy(model(tokens, **kw), labels, None, VOCAB)


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama-window-5"])
def test_packed_losses_equal_each_document_alone(name: str) -> None:
    torch.manual_seed(0)
    model = GPTModel(_configs()[name], VOCAB, seed=3).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [(7, 12, 1, 9, 4), (20, 13)]          # the last document of each sample has no EOD (cut off)
    rows = []
    for doc_lengths in lengths:
        docs = [torch.randint(0, EOD, (n,), generator=gen) for n in doc_lengths]
        for d in docs[:-1]:
            d[-1] = EOD
        rows.append(docs)
    text = torch.stack([torch.cat(docs) for docs in rows])          # [2, 34] inputs + one label token
    sample = torch.cat([text, torch.randint(0, EOD, (2, 1), generator=gen)], dim=1)
    batch = collate([{"tokens": r.numpy()} for r in sample], DocumentMasking(EOD, True, True, True))
    with torch.no_grad():
        packed = _token_losses(model, batch.tokens, batch.labels, position_ids=batch.position_ids,
                               document_ids=batch.document_ids)
        # without the flags the later documents see the earlier ones: a different result
        plain = _token_losses(model, batch.tokens, batch.labels)
        assert (plain - packed).abs().max() > 1e-3
        for r, docs in enumerate(rows):
            start = 0
            for d in docs:
                n = d.numel()
                alone = _token_losses(model, batch.tokens[r:r + 1, start:start + n],
                                      batch.labels[r:r + 1, start:start + n])
                torch.testing.assert_close(packed[r, start:start + n], alone[0], rtol=0, atol=1e-6)
                start += n


def test_loss_mask_and_per_token_loss_by_hand() -> None:
    """Micro batches of one global batch with different numbers of masked (EOD) positions: the default loss
    is each micro batch's masked mean, averaged; --calculate-per-token-loss gives the mean over every unmasked
    token, in value and in gradient, when the micro batches' losses and gradients are averaged over the
    accumulation steps and the data-parallel ranks as DeepSpeed does."""
    gen = torch.Generator().manual_seed(5)
    micro, dp = 3, 2
    logits = torch.randn(micro * dp, 2, 6, 52, generator=gen, requires_grad=True)
    labels = torch.randint(0, VOCAB, (micro * dp, 2, 6), generator=gen)
    tokens = _packed(gen, micro * dp * 2, 6, 0.3).view(micro * dp, 2, 6)
    tokens[0] = EOD                                                    # a micro batch with nothing to score
    masks = [DocumentMasking(EOD, eod_mask_loss=True).apply(t)[2] for t in tokens]
    per_token = torch.stack([torch.nn.functional.cross_entropy(lg[..., :VOCAB].reshape(-1, VOCAB), lb.reshape(-1),
                                                               reduction="none").view(2, 6)
                             for lg, lb in zip(logits, labels)])
    loss_fn = GPTLoss(VOCAB)
    # default: sum(loss * mask) / sum(mask) of each micro batch (0 for one without scored tokens)
    for i in range(micro * dp):
        got = loss_fn(logits[i], (labels[i], masks[i]))
        want = (per_token[i] * masks[i]).sum() / masks[i].sum() if masks[i].sum() else torch.tensor(0.0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # per-token: each DP rank's micro batches share the global count
    global_tokens = float(sum(m.sum() for m in masks))
    batches = [Batch(t, lb, loss_mask=m) for t, lb, m in zip(tokens, labels, masks)]
    mb_losses = []
    for rank in range(dp):
        step = batches[rank * micro:(rank + 1) * micro]
        assert sum(b.scored_tokens() for b in batches) == global_tokens
        for j, b in enumerate(per_token_denominators(step, global_tokens, dp)):
            mb_losses.append(loss_fn(logits[rank * micro + j], b.loss_targets()))
    engine_loss = torch.stack(mb_losses).sum() / (micro * dp)         # 1/accumulation, then the DP mean
    want = (per_token * torch.stack(masks)).sum() / global_tokens
    torch.testing.assert_close(engine_loss, want, rtol=1e-6, atol=0)
    grad, = torch.autograd.grad(engine_loss, logits)
    want_grad, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-9)
    # the default differs from it here (micro batches with different counts)
    default = torch.stack([loss_fn(logits[i], (labels[i], masks[i])) for i in range(micro * dp)]).mean()
    assert abs(float(default.detach()) - float(want.detach())) > 1e-3


def test_gpt_model_takes_the_loss_tuple() -> None:
    cfg = dataclasses.replace(_configs()["llama"], num_layers=1)
    model = GPTModel(cfg, VOCAB, seed=3)
    tokens = torch.randint(0, VOCAB, (2, 8))
    labels = torch.randint(0, VOCAB, (2, 8))
    mask = (torch.arange(8) % 3 != 0).float().expand(2, 8)
    with torch.no_grad():
        losses = _token_losses(model, tokens, labels)
        got = model(tokens, (labels, mask, torch.tensor(4.0)))
    torch.testing.assert_close(got, (losses * mask).sum() / 4.0, rtol=1e-6, atol=0)
