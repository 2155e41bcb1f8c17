"""The generation hook and the HF <-> canonical mapping in detail (TP = 1, fp32, tiny models):

* decoding with the KV cache (a prefill, a multi-token chunk, then token by token) gives the logits
  of the full forward, which equal transformers' (eager), also beyond a sliding window (Mistral, and
  Qwen2 and Qwen3 with every layer windowed, Gemma 3's local layers between global ones) and for a left-padded row under an explicit attention mask;
* the packing is the documented one (QKV rows per query group, fc1 = [gate; up]), so TP shards hold
  whole groups and matching gate/up rows; the mapping back is bit-identical (bf16);
* bad tensors, configurations that cannot be imported or exported, and missing config.json fields
  (transformers' defaults) each give the named result.
"""
from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen2Config, Qwen3Config

from megatron_ru.config.model import ModelConfig
from megatron_ru.convert.hf_mapping import (from_canonical, hf_config_from_model, hf_to_canonical_names,
                                            model_config_from_hf, to_canonical)
from megatron_ru.model.kv_cache import KVCache, LayerKVCache
from megatron_ru.parallel.utils import shard_tensor, unshard_tensors
from tests.unit.test_hf_families import COMMON, _gemma3, _hf_model, _llama3_scaled, _ours


def _mistral_window():   # window 8 << sequence 20; head size 16 != 64 / 8
    return MistralConfig(vocab_size=71, head_dim=16, sliding_window=8, rope_theta=1e6, **COMMON)


def _qwen2_window():     # every layer windowed (max_window_layers 0), QKV biases, tied
    return Qwen2Config(vocab_size=67, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                       max_window_layers=0, **COMMON)


def _qwen3_window():     # query/key norms (the cached keys are the normed ones), head size 16, windowed, tied
    return Qwen3Config(vocab_size=69, tie_word_embeddings=True, head_dim=16, use_sliding_window=True,
                       sliding_window=8, max_window_layers=0, **COMMON)


def _step(gpt, tokens, positions, caches=None, mask=None):
    """One forward through GPTModel's parts with the generation hook: logits [b, s, padded V]."""
    x = gpt.embedding((tokens, positions))
    for i, layer in enumerate(gpt.decoder.layers):
        x = layer(x, positions, kv_cache=None if caches is None else caches[i], attention_mask=mask)
    x = gpt.decoder.final_layernorm(x)
    from megatron_ru.model.gpt import tied_output_logits
    return tied_output_logits(gpt.embedding, x) if gpt.output_layer is None else gpt.output_layer(x)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("make", [_mistral_window, _qwen2_window, _llama3_scaled, _qwen3_window, _gemma3],
                         ids=["mistral-window", "qwen2-window", "llama3", "qwen3-window", "gemma3-local-global"])
def test_cached_decoding_equals_full_forward_and_transformers(make):
    model = _hf_model(make())
    gpt, _ = _ours(model)
    vocab, seq = model.config.vocab_size, 20
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=tokens).logits
        full = gpt(tokens)[..., :vocab]
        assert _rel(full, want) <= 1e-5   # the window (q - k < 8) is applied as transformers does
        caches = KVCache(len(gpt.decoder.layers))
        pieces, start = [], 0
        for width in [5, 3] + [1] * (seq - 8):   # prefill, a chunk with cached keys (offset mask), then steps
            pos = torch.arange(start, start + width).unsqueeze(0).expand(2, -1)
            pos = pos if width > 1 else None   # single steps: the layers continue the cached positions
            pieces.append(_step(gpt, tokens[:, start:start + width], pos, caches)[..., :vocab])
            start += width
    assert caches.length == seq and all(c.length == seq for c in caches.layers)
    assert _rel(torch.cat(pieces, dim=1), full) <= 1e-5


def test_sliding_window_changes_the_result():
    """The test above could not pass with the window ignored: transformers' logits differ."""
    windowed = _hf_model(_mistral_window())
    config = _mistral_window()
    config.sliding_window = None
    full = _hf_model(config)
    full.load_state_dict(windowed.state_dict())
    tokens = torch.randint(0, 71, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = windowed(input_ids=tokens).logits, full(input_ids=tokens).logits
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6) and (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_left_padded_row_under_a_mask_equals_the_unpadded_row():
    model = _hf_model(_qwen2_window())
    gpt, _ = _ours(model)
    pad, seq = 3, 10
    tokens = torch.randint(0, 67, (2, seq), generator=torch.Generator().manual_seed(5))
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, :pad] = False
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    q, k = torch.arange(seq).unsqueeze(-1), torch.arange(seq).unsqueeze(0)
    mask = ((k <= q) & valid.unsqueeze(1)) | ((k == q) & ~valid.unsqueeze(-1))   # a pad query sees itself
    # no window in the mask: the model (window 8 < 10) narrows it itself
    with torch.no_grad():
        caches = KVCache(len(gpt.decoder.layers))
        padded = _step(gpt, tokens, positions, caches, mask.unsqueeze(1))[..., :67]
        alone = gpt(tokens[1:, pad:])[..., :67]
        assert _rel(padded[1:, pad:], alone) <= 1e-5
        assert _rel(padded[:1], gpt(tokens[:1])[..., :67]) <= 1e-5
        nxt = torch.randint(0, 67, (2, 1), generator=torch.Generator().manual_seed(6))
        step_mask = torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], 1)[:, None, None, :]
        step = _step(gpt, nxt, positions[:, -1:] + 1, caches, step_mask)[..., :67]
        whole = gpt(torch.cat([tokens[1:, pad:], nxt[1:]], 1))[..., :67]
    assert _rel(step[1:, -1], whole[:, -1]) <= 1e-5


def test_layer_cache_grows_and_reorders():
    cache = LayerKVCache()
    chunks = [torch.randn(3, 2, n, 4) for n in (5, 1, 17, 1)]
    for i, c in enumerate(chunks):
        k, v = cache.append(c, -c)
        assert torch.equal(k, torch.cat(chunks[:i + 1], 2)) and torch.equal(v, -k)
    cache.reorder(torch.tensor([2, 0]))
    k, _ = cache.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert cache.length == 25 and torch.equal(k[:, :, :24], torch.cat(chunks, 2)[[2, 0]])
    assert KVCache(0).length == 0 and len(KVCache(3)) == 3


# ---- the mapping ------------------------------------------------------------------------------
def _cfg(**kw) -> ModelConfig:
    values = dict(num_layers=1, hidden_size=16, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, kv_channels=3 * 2, ffn_hidden_size=6, position_embedding_type="rope",
                  normalization="RMSNorm", swiglu=True, disable_bias_linear=True, add_qkv_bias=True,
                  untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    values.update(kw)
    return ModelConfig(**values)


def test_qkv_and_fc1_packing_and_tp_shards():
    cfg = _cfg()                          # 4 heads in 2 groups (r = 2), head size 6
    d, h = 6, 16
    pre = "model.layers.0."
    rows = {n: torch.arange(c * d).repeat_interleave(1) for n, c in (("q", 4), ("k", 2), ("v", 2))}
    hf = {f"{pre}self_attn.{n}_proj.weight": (1000 * i + rows[n]).float().unsqueeze(1).expand(-1, h).clone()
          for i, n in enumerate("qkv", 1)}
    qkv = to_canonical("decoder.layers.0.self_attention.linear_qkv.weight", hf, cfg)[:, 0].long().tolist()

    def head(t, j):
        return [1000 * t + j * d + x for x in range(d)]
    # per group g: q heads 2g, 2g+1, then k head g, then v head g
    assert qkv == [x for g in range(2) for x in head(1, 2 * g) + head(1, 2 * g + 1) + head(2, g) + head(3, g)]
    full = to_canonical("decoder.layers.0.self_attention.linear_qkv.weight", hf, cfg)
    rank1 = shard_tensor(full, 0, 1, 2)[:, 0].long().tolist()   # TP rank 1 holds group 1 whole
    assert rank1 == head(1, 2) + head(1, 3) + head(2, 1) + head(3, 1)
    gate, up = torch.arange(6.).unsqueeze(1).expand(-1, h), 100 + torch.arange(6.).unsqueeze(1).expand(-1, h)
    fc1 = to_canonical("decoder.layers.0.mlp.linear_fc1.weight",
                       {f"{pre}mlp.gate_proj.weight": gate, f"{pre}mlp.up_proj.weight": up}, cfg)
    assert fc1[:, 0].tolist() == list(range(6)) + list(range(100, 106))
    assert shard_tensor(fc1, 0, 1, 2, stride=2)[:, 0].tolist() == [3, 4, 5, 103, 104, 105]
    assert torch.equal(unshard_tensors([shard_tensor(fc1, 0, r, 2, stride=2) for r in range(2)], 0, 2), fc1)


def test_round_trip_bit_identical_bf16():
    cfg, vocab = _cfg(), 37
    from megatron_ru.convert.hf_mapping import hf_shapes
    g = torch.Generator().manual_seed(7)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_shapes(cfg, vocab).items()}
    assert "model.layers.0.self_attn.q_proj.bias" in hf and "model.layers.0.self_attn.o_proj.bias" not in hf
    back = {}
    for name, sources in hf_to_canonical_names(cfg).items():
        t = to_canonical(name, {n: hf[n] for n in sources}, cfg)
        assert t.dtype == torch.bfloat16
        back.update(from_canonical(name, t, cfg))
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
    assert back["model.embed_tokens.weight"].shape[0] == vocab


def test_bad_tensors_are_named():
    cfg = _cfg()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    pre = "model.layers.0.self_attn."
    good = {f"{pre}q_proj.weight": torch.zeros(24, 16), f"{pre}k_proj.weight": torch.zeros(12, 16),
            f"{pre}v_proj.weight": torch.zeros(12, 16)}
    with pytest.raises(ValueError, match=rf"tensor {pre}k_proj.weight is missing"):
        to_canonical(name, {k: v for k, v in good.items() if "k_proj" not in k}, cfg)
    with pytest.raises(ValueError, match=rf"tensor {pre}v_proj.weight has shape \[12, 15\], expected \[12, 16\] "
                                         r"from config.json"):
        to_canonical(name, {**good, f"{pre}v_proj.weight": torch.zeros(12, 15)}, cfg)
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \[40, 16\], expected \[48, 16\] from the "
                                         r"model configuration"):
        from_canonical(name, torch.zeros(40, 16), cfg)
    with pytest.raises(ValueError, match=r"output_layer.weight is not a parameter of this model \(tied"):
        from_canonical("output_layer.weight", torch.zeros(5, 16), _cfg(untie_embeddings_and_output_weights=False))
    with pytest.raises(ValueError, match=r"decoder.layers.1.mlp.linear_fc1.weight is not a parameter"):
        to_canonical("decoder.layers.1.mlp.linear_fc1.weight", {}, cfg)


@pytest.mark.parametrize("kw,arch,message", [
    (dict(add_qkv_bias=False), "Qwen2ForCausalLM", "no Q/K/V biases, which Qwen2ForCausalLM always has"),
    ({}, "LlamaForCausalLM", "Q/K/V biases (--add-qkv-bias), which LlamaForCausalLM does not have"),
    (dict(add_qkv_bias=False, sliding_window=8), "LlamaForCausalLM",
     "a sliding window of 8 (--sliding-window), which LlamaForCausalLM does not have"),
    (dict(add_qkv_bias=False), "GPT2LMHeadModel", "architecture 'GPT2LMHeadModel' (supported: LlamaForCausalLM"),
    (dict(normalization="LayerNorm", swiglu=False, disable_bias_linear=False, position_embedding_type=
          "learned_absolute", max_position_embeddings=32), None,
     "learned absolute position embeddings (--position-embedding-type learned_absolute); LayerNorm (Llama/Qwen2 "
     "use RMSNorm: --normalization RMSNorm); a GELU MLP (Llama/Qwen2 use SwiGLU: --swiglu; Gemma 3 GeGLU: "
     "--geglu); biases on every linear layer (Llama/Qwen2 have none: --disable-bias-linear)"),
])
def test_export_refuses_what_the_architecture_cannot_hold(kw, arch, message):
    with pytest.raises(ValueError) as e:
        hf_config_from_model(_cfg(**kw), 37, arch)
    assert message in str(e.value)


def test_export_config_fields():
    cfg = _cfg(add_qkv_bias=False, rope_scaling_type="llama3", rope_scaling_factor=8.0,
               rope_scaling_original_max_position_embeddings=16, rotary_base=5e5, max_position_embeddings=64)
    out = hf_config_from_model(cfg, 37, "LlamaForCausalLM",
                               {"torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": [2, 3],
                                "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1.0})
    assert "rope_scaling" not in out and "rope_theta" not in out
    assert out["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert (out["torch_dtype"], out["bos_token_id"], out["eos_token_id"]) == ("bfloat16", 1, [2, 3])
    assert (out["head_dim"], out["num_key_value_heads"], out["tie_word_embeddings"], out["vocab_size"]) == \
        (6, 2, False, 37)
    assert model_config_from_hf(out) == (cfg, 37)


def _hf(arch="LlamaForCausalLM", **kw):
    hf = {"architectures": [arch], "vocab_size": 61, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    hf.update(kw)
    return hf


def test_missing_fields_take_transformers_defaults():
    for arch, cls in (("LlamaForCausalLM", "LlamaConfig"), ("MistralForCausalLM", "MistralConfig"),
                      ("Qwen2ForCausalLM", "Qwen2Config")):
        import transformers
        ref = getattr(transformers, cls).from_dict(_hf(arch))
        cfg, vocab = model_config_from_hf(_hf(arch))
        assert cfg.max_position_embeddings == ref.max_position_embeddings
        assert cfg.rotary_base == ref.rope_parameters["rope_theta"] and cfg.norm_epsilon == ref.rms_norm_eps
        assert cfg.sliding_window == getattr(ref, "sliding_window", None)    # Mistral: 4096; Qwen2: off
        assert cfg.tied_embeddings == ref.tie_word_embeddings and cfg.add_qkv_bias == (arch == "Qwen2ForCausalLM")
    assert model_config_from_hf(_hf("MistralForCausalLM", sliding_window=None))[0].sliding_window is None


@pytest.mark.parametrize("kw,window", [
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), None),   # no layer windowed
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), 16),     # every layer windowed
    (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), None),
    (dict(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention"] * 2), 16),
])
def test_qwen2_windowed_layers(kw, window):
    assert model_config_from_hf(_hf("Qwen2ForCausalLM", **kw))[0].sliding_window == window


@pytest.mark.parametrize("kw,message", [
    (dict(architectures=None, model_type="gpt2"), "config.json: model_type = 'gpt2' (no architectures field) is not "
     "supported; supported: llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM)"),
    (dict(architectures=[], model_type="mistral"), None),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "config.json: max_window_layers = 1 windows some layers only (use_sliding_window = true, sliding_window = 16); "
     "megatron_ru cannot mix windowed and full attention"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16,
          layer_types=["full_attention", "sliding_attention"]), "config.json: layer_types = ['full_attention', "
     "'sliding_attention'] windows some layers only"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=0), "sliding_window = 0 must be a positive integer"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5 cannot be expressed"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}),
     "rope_parameters = {'full_attention'"),
    (dict(rope_scaling={"rope_type": "linear"}), "config.json: rope_scaling.factor = None is required for rope_type "
                                                 "linear"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type = 'dynamic' cannot be "
                                                                 "expressed; supported: default, linear, llama3"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}),
     "llama3 RoPE scaling needs 0 < --rope-scaling-low-freq-factor (4.0) < --rope-scaling-high-freq-factor (4.0)"),
    (dict(vocab_size=0), "config.json: vocab_size = 0 must be a positive integer"),
    (dict(rope_theta=None), "config.json: rope_theta = None must be a positive number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
     "config.json: rope_parameters.rope_theta = -1.0 must be a positive number"),
    (dict(rope_scaling=[1, 2]), "config.json: rope_scaling = [1, 2] must be a dict"),
    (dict(num_hidden_layers=None), "config.json: num_hidden_layers = None must be a positive integer"),
    (dict(head_dim=7), "rotary embeddings need an even head size; --kv-channels is 7"),
    (dict(head_dim=0), "config.json: head_dim = 0 must be a positive integer or null"),
    (dict(num_key_value_heads=0), "config.json: num_key_value_heads = 0 must be a positive integer or null"),
    (dict(num_key_value_heads=16), "config.json: num_key_value_heads = 16 must divide num_attention_heads (8)"),
])
def test_more_config_errors_name_the_field(kw, message):
    hf = _hf(**kw)
    if message is None:   # an empty architectures list falls back to model_type
        assert model_config_from_hf(hf)[0].sliding_window == 4096
        return
    with pytest.raises(ValueError) as e:
        model_config_from_hf(hf)
    assert message in str(e.value)


def test_v4_rope_form_without_scaling():
    v4 = _hf("Qwen2ForCausalLM", rope_theta=1e6, rope_scaling=None)
    v5 = _hf("Qwen2ForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert model_config_from_hf(v4) == model_config_from_hf(v5)
    assert model_config_from_hf(v4)[0].rotary_base == 1e6


def test_qwen2_window_exports_every_layer_windowed():
    """An imported config's per-layer fields (max_window_layers 28, layer_types) would window no layer of a
    2-layer model in transformers: export rewrites them."""
    hf = Qwen2Config(vocab_size=67, use_sliding_window=True, sliding_window=8, max_window_layers=0, **COMMON).to_dict()
    cfg, vocab = model_config_from_hf(hf)
    stale = {**hf, "max_window_layers": 28, "layer_types": ["full_attention"] * 2}
    out = hf_config_from_model(cfg, vocab, "Qwen2ForCausalLM", stale)
    assert Qwen2Config.from_dict(out).layer_types == ["sliding_attention"] * 2
    assert model_config_from_hf(out) == (cfg, vocab)
    plain, _ = model_config_from_hf(Qwen2Config(vocab_size=67, **COMMON).to_dict())
    out = hf_config_from_model(plain, vocab, "Qwen2ForCausalLM", stale)
    assert Qwen2Config.from_dict(out).layer_types == ["full_attention"] * 2 and out["sliding_window"] is None


def test_recomputed_layer_keeps_the_attention_mask():
    from megatron_ru.model.transformer import TransformerLayer
    kw = dict(add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    x = torch.randn(6, 2, 16)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(8)) > 0.4
    mask |= torch.eye(6, dtype=torch.bool)
    out, grads = [], []
    for recompute in (None, "full"):
        layer = TransformerLayer(_cfg(recompute_granularity=recompute, **kw), 1).train()
        xi = x.clone().requires_grad_()
        y = layer(xi, kv_cache=None, attention_mask=mask)
        y.square().sum().backward()
        out.append(y.detach())
        grads.append(xi.grad)
    assert torch.equal(out[0], out[1]) and torch.equal(grads[0], grads[1])
    with torch.no_grad():
        assert not torch.equal(out[0], layer(x))   # the mask mattered


def test_export_without_max_positions():
    """A RoPE model trained without --max-position-embeddings: the caller's value, else transformers' default
    (never a null that transformers would carry into the model)."""
    cfg = _cfg(add_qkv_bias=False)
    assert cfg.max_position_embeddings is None
    assert "max_position_embeddings" not in hf_config_from_model(cfg, 37, "LlamaForCausalLM", {})
    out = hf_config_from_model(cfg, 37, "LlamaForCausalLM", {"max_position_embeddings": 4096})
    assert out["max_position_embeddings"] == 4096
    out = hf_config_from_model(_cfg(add_qkv_bias=False, max_position_embeddings=64), 37, "LlamaForCausalLM",
                               {"max_position_embeddings": 4096})
    assert out["max_position_embeddings"] == 64


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},     # Llama 3.1 8B
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},     # Llama 3.2
], ids=["default", "linear", "llama3.1", "llama3.2"])
def test_inverse_frequencies_bit_identical_to_transformers(rope):
    """At the real head size (128) the fp32 inverse frequencies are transformers' to the bit."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_ru.model.rope import RopeSpec
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_parameters=rope,
                         max_position_embeddings=131072)
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    want, scaling = init(config=config, device=torch.device("cpu"))
    cfg, _ = model_config_from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"], "vocab_size": 128})
    got = RopeSpec.from_config(cfg).inv_freq(torch.device("cpu"))
    assert scaling == 1.0 and got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_bias_fields_are_llamas_only():
    """Mistral and Qwen2 ignore attention_bias / mlp_bias (their biases are fixed in transformers)."""
    for arch, qkv_bias in (("MistralForCausalLM", False), ("Qwen2ForCausalLM", True)):
        cfg, _ = model_config_from_hf(_hf(arch, attention_bias=True, mlp_bias=True))
        assert cfg.add_qkv_bias == qkv_bias and not cfg.add_bias_linear
    with pytest.raises(ValueError, match="attention_bias = True cannot be expressed"):
        model_config_from_hf(_hf(attention_bias=True))


def _tp_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_ru.model import GPTModel
    from megatron_ru.parallel.utils import gather_full_tensor
    cfg = _cfg(sliding_window=4, rope_scaling_type="llama3", rope_scaling_factor=8.0,
               rope_scaling_original_max_position_embeddings=4, num_layers=2, make_vocab_size_divisible_by=4)
    group = dist.new_group([0, 1])
    tokens = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(9))
    out = {}
    with torch.no_grad():
        ref = GPTModel(cfg, 37, None, seed=7).eval()(tokens)[..., :37]
        model = GPTModel(cfg, 37, group, seed=7).eval()
        out["full"] = _rel(gather_full_tensor(model(tokens), group, dim=2)[..., :37], ref)
        caches, pieces, start = KVCache(2), [], 0
        for width in (3, 2) + (1,) * 7:
            pos = torch.arange(start, start + width).unsqueeze(0).expand(2, -1)
            pieces.append(gather_full_tensor(_step(model, tokens[:, start:start + width], pos, caches), group,
                                             dim=2)[..., :37])
            start += width
        out["cached"] = _rel(torch.cat(pieces, 1), ref)
        out["cache_heads"] = caches[0]._k.shape[1]
    return out


@pytest.mark.slow  # spawns 2 gloo ranks
def test_tensor_parallel_cached_decoding_equals_one_rank():
    """TP = 2 (one query group per rank; head size 6 != 16 / 4; Q/K/V biases; a window of 4 over 12 tokens;
    llama3 scaling): the full forward and the cached decoding equal the single-rank model."""
    from tests.dist_utils import run_distributed
    for result in run_distributed(_tp_body, 2, timeout=120):
        assert result["full"] <= 1e-5 and result["cached"] <= 1e-5, result
        assert result["cache_heads"] == 1   # this rank's key/value groups only


@pytest.mark.parametrize("fields", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 2.0},
     "rope_theta": 5e5},
    {"rope_parameters": {"rope_type": "linear", "factor": 3.0}, "rope_scaling": None, "rope_theta": 5e5},
    {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5},
])
def test_rope_fields_read_as_transformers_reads_them(fields):
    """Both forms in one config.json: transformers 5 lets a non-empty rope_scaling win; so do we."""
    from transformers import LlamaConfig
    hf = _hf(**fields)
    ref = LlamaConfig.from_dict(dict(hf)).rope_parameters
    cfg, _ = model_config_from_hf(hf)
    assert (cfg.rope_scaling_type, cfg.rotary_base) == ({"default": "none"}.get(ref["rope_type"], ref["rope_type"]),
                                                        ref["rope_theta"])
    assert ref["rope_type"] == "default" or cfg.rope_scaling_factor == ref["factor"]
