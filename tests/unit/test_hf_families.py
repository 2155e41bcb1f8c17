"""The Hugging Face families through megatron_ru/convert/hf_mapping.py at TP = 1: a tiny
model built from a transformers config, mapped to canonical tensors and loaded into GPTModel,
gives transformers' logits (fp32, eager attention, <= 1e-5 relative); the mapping is exact both
ways; config.json settings the model cannot express are errors naming the field."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from megatron_ru.convert.hf_mapping import (from_canonical, hf_config_from_model, hf_to_canonical_names,
                                            model_config_from_hf, to_canonical)
from megatron_ru.model import GPTModel
from megatron_ru.model.spec import parameter_specs
from megatron_ru.model.shards import padded_vocab_rows

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)


def _llama(tied=False, **kw):
    return LlamaConfig(vocab_size=61, tie_word_embeddings=tied, rope_theta=500000.0, **COMMON, **kw)


def _llama3_scaled():
    return _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def _llama_linear():
    return _llama(rope_scaling={"rope_type": "linear", "factor": 4.0})


def _qwen2():
    return Qwen2Config(vocab_size=67, tie_word_embeddings=True, rope_theta=1e6, **COMMON)


def _mistral():  # odd vocabulary, head size 16 != hidden / heads, a sliding window
    return MistralConfig(vocab_size=73, head_dim=16, sliding_window=32, rope_theta=1e6, tie_word_embeddings=False,
                         **COMMON)


def _qwen3():  # per-head query/key norms, head size 16 != hidden / heads (query width 128 != hidden 64), tied
    return Qwen3Config(vocab_size=71, head_dim=16, tie_word_embeddings=True, rope_theta=1e6, **COMMON)


def _qwen3_untied_mha():  # every head its own key/value (no GQA), head size 8 = hidden / heads, untied
    return Qwen3Config(vocab_size=59, head_dim=8, tie_word_embeddings=False, rope_theta=1e6,
                       **{**COMMON, "num_key_value_heads": 8})


def _gemma3(**kw):  # local and global layers (every 3rd global: 2 local + 1 global, twice), windows shorter than
    # the sequence, each type its own RoPE, scale 1/sqrt(query_pre_attn_scalar) not 1/sqrt(head size), tied
    cfg = dict(vocab_size=83, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               **{**COMMON, "num_hidden_layers": 6})
    cfg.update(kw)
    return Gemma3TextConfig(**cfg)


def _gemma3_linear_rope():  # Gemma 3 4B's global RoPE: linear scaling by 8 (the local layers unscaled)
    return _gemma3(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


CASES = {"llama-gqa-untied": _llama, "llama-tied": lambda: _llama(tied=True), "llama3-scaled": _llama3_scaled,
         "llama-linear": _llama_linear, "qwen2-bias-tied": _qwen2, "mistral-odd-vocab-head16": _mistral,
         "qwen3-qknorm-head16-tied": _qwen3, "qwen3-untied-mha": _qwen3_untied_mha,
         "gemma3-local-global": _gemma3, "gemma3-linear-rope": _gemma3_linear_rope}


def _hf_model(config):
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make every tensor count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours(model) -> tuple[GPTModel, dict[str, torch.Tensor]]:
    cfg, vocab = model_config_from_hf(model.config.to_dict())
    sd = model.state_dict()
    gpt = GPTModel(cfg, vocab)
    canonical = {}
    with torch.no_grad():
        params = dict(gpt.named_parameters())
        for name, sources in hf_to_canonical_names(cfg).items():
            t = to_canonical(name, {n: sd[n] for n in sources}, cfg)
            canonical[name] = t
            if t.shape[0] == vocab and name.endswith(("word_embeddings.weight", "output_layer.weight")):
                t = torch.cat([t, t.new_zeros(padded_vocab_rows(cfg, vocab, 1) - vocab, t.shape[1])])
            params[name].copy_(t)
    return gpt.eval(), canonical


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case):
    model = _hf_model(CASES[case]())
    gpt, canonical = _ours(model)
    vocab = model.config.vocab_size
    seq = 48 if case == "llama3-scaled" else 24   # llama3: positions far beyond the original 16
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = None
    if case == "llama-linear":  # offset positions, as in a continued sequence
        positions = torch.arange(10, 10 + seq).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        want = model(input_ids=tokens, position_ids=positions).logits
        got = gpt(tokens, position_ids=positions)[..., :vocab]
    assert got.shape == want.shape
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-5, rel
    # the mapping back is exact (every HF tensor bit-identical; a tied model has no lm_head)
    sd = model.state_dict()
    back = {}
    cfg, _ = model_config_from_hf(model.config.to_dict())
    for name, t in canonical.items():
        back.update(from_canonical(name, t, cfg))
    expected = {k for k in sd if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
    assert all(torch.equal(back[k], sd[k]) for k in expected)
    assert len(canonical) == len(parameter_specs(cfg, vocab))


def test_llama3_scaling_matters():
    """The scaled model is not the unscaled one beyond the original length (the test above could not
    pass with the scaling ignored)."""
    model = _hf_model(_llama3_scaled())
    cfg, vocab = model_config_from_hf(model.config.to_dict())
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings) == \
        ("llama3", 8.0, 16)
    gpt, _ = _ours(model)
    tokens = torch.randint(0, vocab, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        scaled = gpt(tokens)
        for layer in gpt.decoder.layers:
            layer.self_attention.rope = type(layer.self_attention.rope)(cfg.head_dim, cfg.rotary_base)
        plain = gpt(tokens)
    assert (scaled - plain).abs().max() > 1e-3


def test_both_rope_config_forms():
    v5 = _llama3_scaled().to_dict()
    assert "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = v5["rope_parameters"]["rope_theta"]
    v4["rope_scaling"] = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    v4["rope_scaling"]["type"] = v4["rope_scaling"].pop("rope_type")   # the oldest spelling
    assert model_config_from_hf(v4) == model_config_from_hf(v5)


def test_config_round_trip_loads_in_transformers():
    for make in CASES.values():
        hf = make().to_dict()
        cfg, vocab = model_config_from_hf(hf)
        out = hf_config_from_model(cfg, vocab)   # the architecture follows from the model
        assert model_config_from_hf(out) == (cfg, vocab)
        config_cls = type(make())
        assert out["model_type"] == config_cls.model_type
        loaded = config_cls.from_dict(out)
        assert loaded.vocab_size == vocab and loaded.tie_word_embeddings == cfg.tied_embeddings


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures = ['GPT2LMHeadModel'] is not supported; supported: "
                                             "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type = 'yarn' cannot be expressed; supported: default, linear, llama3"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' cannot be expressed"),
    ({"mlp_bias": True}, "mlp_bias = True cannot be expressed"),
    ({"attention_bias": True}, "attention_bias = True cannot be expressed: it puts a bias on o_proj too"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 must divide num_attention_heads (8)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters.low_freq_factor = None is required for rope_type llama3"),
])
def test_config_errors_name_the_field(change, message):
    hf = _llama().to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    hf.update(change)
    with pytest.raises(ValueError) as e:
        model_config_from_hf(hf)
    assert message in str(e.value)


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
     "architectures = ['Qwen3MoeForCausalLM'] is not supported"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
     "architectures = ['MixtralForCausalLM'] is not supported"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "architectures = ['Gemma3ForConditionalGeneration'] is not supported"),
    ({"attention_bias": True}, "attention_bias = True cannot be expressed: it puts a bias on o_proj too"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type = 'yarn' cannot be expressed"),
    ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]},
     "config.json: layer_types = ['full_attention', 'sliding_attention'] windows some layers only"),
])
def test_qwen3_refusals_name_the_field(config, message):
    """MoE and multimodal checkpoints and the Qwen3 settings the model cannot express: one error naming the
    field and its value, before anything is read or written."""
    hf = {**_qwen3().to_dict(), "architectures": ["Qwen3ForCausalLM"], **config}
    with pytest.raises(ValueError) as e:
        model_config_from_hf(hf)
    assert message in str(e.value), str(e.value)


def test_mistral_window_trains_longer_sequences():
    """--seq-length above the window trains with the window applied (Gemma 3's 512-token local layers in 32k
    sequences); the training numbers are checked in tests/integration/test_train_layouts.py."""
    from megatron_ru.flags.arguments import parse_arguments
    from tests.integration._train_helpers import tiny_argv
    argv = tiny_argv("/nonexistent", "/tmp") + ["--sliding-window", "16"]
    args = parse_arguments(argv, world_size=1, device_type="cpu", validate=False)
    assert args.model.sliding_window == 16 and args.data.seq_length == 32
    cfg, _ = model_config_from_hf({**_mistral().to_dict(), "architectures": ["MistralForCausalLM"]})
    assert cfg.sliding_window == 32 and cfg.kv_channels == 16
