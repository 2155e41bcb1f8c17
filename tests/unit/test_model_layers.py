"""Single-process checks of the model: layout-independent init, vocabulary padding, the
pipeline layer sequence, recomputation with dropout, the loss mask, sharding helpers."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ru.config.model import ModelConfig
from megatron_ru.deepspeed_bridge.pipeline import layer_specs
from megatron_ru.model import GPTModel, pipeline_layers, tied_output_logits
from megatron_ru.model.init import name_seed
from megatron_ru.parallel.random import get_rng_tracker, model_parallel_seed
from megatron_ru.parallel.utils import pad_vocab_size, shard_tensor, unshard_tensors

VOCAB = 37


def _llama(**kw) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                      num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, make_vocab_size_divisible_by=8)
    return dataclasses.replace(cfg, **kw)


def _gpt2(**kw) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                      hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
    return dataclasses.replace(cfg, **kw)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g)


@pytest.mark.parametrize("vocab, divisible_by, tp, expected", [
    (50, 128, 1, 128), (50257, 128, 1, 50304), (50257, 128, 2, 50432), (32000, 128, 8, 32768),
    (32000, 128, 1, 32000), (7, 1, 4, 8)])
def test_pad_vocab_size(vocab: int, divisible_by: int, tp: int, expected: int) -> None:
    assert pad_vocab_size(vocab, divisible_by, tp) == expected


def test_pad_vocab_size_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        pad_vocab_size(10, 0, 1)


def test_strided_shards_keep_fused_blocks_aligned() -> None:
    gate, up = torch.arange(8.0).view(8, 1), torch.arange(100.0, 108.0).view(8, 1)
    full = torch.cat([gate, up])
    shards = [shard_tensor(full, 0, r, 4, stride=2) for r in range(4)]
    assert shards[1].flatten().tolist() == [2.0, 3.0, 102.0, 103.0]    # rank 1: its gate rows + its up rows
    assert torch.equal(unshard_tensors(shards, 0, stride=2), full)
    assert torch.equal(unshard_tensors([shard_tensor(full, 0, r, 4) for r in range(4)], 0), full)


def test_init_depends_only_on_seed_and_name() -> None:
    a, b, c = GPTModel(_llama(), VOCAB, seed=5), GPTModel(_llama(), VOCAB, seed=5), GPTModel(_llama(), VOCAB, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    w0 = a.decoder.layers[0].mlp.linear_fc1.weight
    assert not torch.equal(w0, a.decoder.layers[1].mlp.linear_fc1.weight)
    assert float(w0.detach().std()) == pytest.approx(0.02, rel=0.1)
    proj = a.decoder.layers[0].mlp.linear_fc2.weight                    # scaled: 0.02 / sqrt(2 * layers)
    assert float(proj.detach().std()) == pytest.approx(0.01, rel=0.15)
    assert name_seed(5, "x") == name_seed(5, "x") != name_seed(5, "y")
    # padded vocabulary rows start at zero, whatever the padding
    assert a.padded_vocab_size == 40
    assert a.embedding.word_embeddings.weight[VOCAB:].abs().max() == 0
    assert a.output_layer.weight[VOCAB:].abs().max() == 0


@pytest.mark.parametrize("make_cfg", [_llama, _gpt2])
def test_padding_does_not_change_the_model(make_cfg) -> None:
    tokens, labels = _batch()
    small = GPTModel(make_cfg(make_vocab_size_divisible_by=1), VOCAB, seed=3)
    large = GPTModel(make_cfg(make_vocab_size_divisible_by=64), VOCAB, seed=3)
    assert (small.padded_vocab_size, large.padded_vocab_size) == (37, 64)
    ls, ll = small(tokens, labels=labels), large(tokens, labels=labels)
    assert float(ls.detach()) == pytest.approx(float(ll.detach()), rel=1e-6)
    ls.backward(), ll.backward()
    gs = small.embedding.word_embeddings.weight.grad
    gl = large.embedding.word_embeddings.weight.grad
    assert torch.allclose(gs, gl[:VOCAB], rtol=1e-5, atol=1e-7) and gl[VOCAB:].abs().max() == 0


@pytest.mark.parametrize("make_cfg", [_llama, _gpt2])
def test_layer_specs_compose_to_gpt_model(make_cfg) -> None:
    cfg = make_cfg()
    model = GPTModel(cfg, VOCAB, seed=9)
    specs = layer_specs(pipeline_layers(cfg, VOCAB, seed=9))
    assert len(specs) == cfg.num_layers + 3
    layers = [spec.build() for spec in specs]
    tied = cfg.tied_embeddings
    assert [type(s).__name__ for s in (specs[0], specs[-1])] == (["TiedLayerSpec"] * 2 if tied else ["LayerSpec"] * 2)
    if tied:
        assert specs[0].key == specs[-1].key == "embed"
        assert specs[-1].forward_fn is tied_output_logits and specs[-1].tied_weight_attr == ["word_embeddings.weight"]
        # a separate last stage holds only the tied word embeddings (nothing without a gradient)
        assert [n for n, _ in layers[-1].named_parameters()] == ["word_embeddings.weight"]
        with pytest.raises(RuntimeError, match="output_only") if cfg.position_embedding_type != "rope" \
                else contextlib.nullcontext():
            layers[-1](torch.zeros(1, 4, dtype=torch.long))
    tokens, labels = _batch(1)
    x = tokens
    with torch.no_grad():
        for i, (spec, layer) in enumerate(zip(specs, layers)):
            forward_fn = getattr(spec, "forward_fn", None)
            x = forward_fn(layer, x) if forward_fn is not None and i == len(specs) - 1 else layer(x)
        expect = model(tokens)
        assert torch.allclose(x, expect, rtol=0, atol=1e-6)
        assert float(model.loss_fn(x, labels)) == pytest.approx(float(model(tokens, labels=labels)), rel=1e-6)


def test_recompute_replays_dropout_including_tp_stream() -> None:
    cfg = _llama(hidden_dropout=0.2, attention_dropout=0.2)
    tokens, labels = _batch(2)

    def grads(recompute: bool) -> tuple[float, list[torch.Tensor]]:
        model = GPTModel(dataclasses.replace(cfg, recompute_granularity="full" if recompute else None), VOCAB,
                         seed=1).train()
        model_parallel_seed(123, tp_rank=0)
        loss = model(tokens, labels=labels)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters()]

    loss_a, ga = grads(False)
    loss_b, gb = grads(True)
    assert loss_a == loss_b
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    model = GPTModel(cfg, VOCAB, seed=1)
    with torch.no_grad():   # dropout really is on in training mode (else the check above is empty)
        assert not torch.equal(model.train()(tokens), model.eval()(tokens))


def test_attention_dropout_without_tp_seed_says_how_to_fix() -> None:
    get_rng_tracker().reset()
    model = GPTModel(_llama(attention_dropout=0.1), VOCAB).train()
    with pytest.raises(KeyError, match="model_parallel_seed"):
        model(_batch()[0])


def test_loss_mask_and_padding_columns() -> None:
    model = GPTModel(_gpt2(), VOCAB, seed=4)
    tokens, labels = _batch(3)
    mask = torch.ones(2, 12)
    mask[0, :5] = 0
    with torch.no_grad():
        logits = model(tokens)
        per_token = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        expect = (per_token * mask.reshape(-1)).sum() / mask.sum()
        got = model(tokens, labels=labels, loss_mask=mask)
        assert float(got) == pytest.approx(float(expect), rel=1e-6)
        assert float(model.loss_fn(logits, (labels, mask))) == pytest.approx(float(expect), rel=1e-6)
        assert float(model(tokens, labels=labels)) == pytest.approx(float(per_token.mean()), rel=1e-6)


def test_rng_state_round_trip_restores_both_streams() -> None:
    from megatron_ru.parallel.random import get_rng_state, set_rng_state
    model_parallel_seed(77, tp_rank=1)
    ones = torch.ones(256)
    state = get_rng_state()

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        replicated = F.dropout(ones, 0.5, training=True)
        with get_rng_tracker().fork():
            split = F.dropout(ones, 0.5, training=True)
        return replicated, split

    first = draw()
    second = draw()
    assert not torch.equal(first[1], second[1])        # the TP stream advances between draws
    set_rng_state(state)
    again = draw()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    model_parallel_seed(77, tp_rank=2)                 # another TP rank: same replicated, other split mask
    other = draw()
    assert torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])


def test_attention_without_native_gqa_gives_the_same_logits(monkeypatch) -> None:
    import megatron_ru.model.transformer as transformer
    model = GPTModel(_llama(), VOCAB, seed=2)
    tokens = _batch(4)[0]
    with torch.no_grad():
        native = model(tokens)
        monkeypatch.setattr(transformer, "_SDPA_HAS_GQA", False)     # torch < 2.5: repeated key/value heads
        repeated = model(tokens)
    assert torch.allclose(native, repeated, rtol=0, atol=1e-6)


def test_linear_folds_positions_for_a_frozen_weight():
    """A frozen weight (embedding-only training, LoRA) against hidden states whose strides are not a contiguous
    tensor's ([s, 1, h] viewed from [1, s, h]; a transposed [b, s, h]): one matrix product, never torch's
    batched path that copies the weight once per position; the result is F.linear's."""
    import torch.nn.functional as F
    from torch.profiler import profile

    from megatron_ru.parallel.layers import linear
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=g)  # frozen: requires_grad False
    for x in (torch.randn(1, 10, 16, generator=g).transpose(0, 1),       # [10, 1, 16], strides (16, 160, 1)
              torch.randn(10, 3, 16, generator=g).transpose(0, 1)):      # [3, 10, 16], not contiguous
        x.requires_grad_(True)
        with profile() as prof:
            y = linear(x, weight)
            y.sum().backward()
        names = {e.name for e in prof.events()}
        assert "aten::bmm" not in names and "aten::mm" in names, sorted(names)
        ref = x.detach().clone().requires_grad_(True)
        expected = F.linear(ref, weight)
        expected.sum().backward()
        assert y.shape == expected.shape and torch.allclose(y, expected, atol=1e-6) and torch.allclose(x.grad, ref.grad)
