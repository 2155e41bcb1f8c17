"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 (text) <-> megatron_ru: the model configuration and
every tensor.

Pure functions, no I/O: :mod:`megatron_ru.convert.import_hf` and ``export_hf`` stream the files.

* ``model_config_from_hf(config.json dict)`` -> (ModelConfig, V); reads both RoPE forms (transformers 5
  ``rope_parameters``; transformers 4 top-level ``rope_theta`` / ``rope_scaling``). A setting the model
  cannot express is a ValueError naming the config.json field and its value.
* ``hf_config_from_model(cfg, V, architecture, extra)`` -> config.json (transformers 5 form).
* Tensors: ``hf_to_canonical_names(cfg)`` says which HF tensors make each canonical one;
  ``to_canonical`` packs them (q, k, v -> ``linear_qkv`` rows per query group ``[q_0..q_{r-1}, k, v]``;
  gate, up -> ``linear_fc1`` = ``[gate; up]``), ``from_canonical`` unpacks; both exact (bit-identical
  round trip). transformers uses the same "rotate half" RoPE as megatron_ru: q/k rows are NOT permuted.
  Vocabulary matrices hold exactly V rows here (no layout padding). A tied model has no ``lm_head``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ru.config.linears import LINEARS
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import (EMBEDDING, FINAL_NORM, OUTPUT_LAYER, VOCAB_WEIGHTS, WORD_EMBEDDINGS, PartLayout,
                                    layer_prefix, parameter_specs)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}
GEMMA3 = "Gemma3ForCausalLM"
FAMILIES = "Llama/Mistral/Qwen2/Qwen3/Gemma 3"   # the families above, as help texts name them
#: families whose sliding window covers the layers from max_window_layers on (layer_types in transformers 5)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# what transformers assumes for a field a config.json leaves out (the config classes' defaults)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28,
                         "head_dim": 128},
    GEMMA3: {"max_position_embeddings": 131072, "sliding_window": 4096, "head_dim": 256,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6},
}
#: Gemma 3's four norms a layer: HF's post_attention_layernorm normalises the attention output there (in the
#: other families it is the norm before the MLP)
_SANDWICH_NORMS = {
    "post_self_attn_layernorm.weight": ("post_attention_layernorm.weight",),
    "pre_mlp_layernorm.weight": ("pre_feedforward_layernorm.weight",),
    "post_mlp_layernorm.weight": ("post_feedforward_layernorm.weight",),
}

_LAYER_MAP = {  # canonical local name -> HF names under model.layers.{i}. (linear layers: config/linears.py)
    "input_layernorm.weight": ("input_layernorm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    **{f"{lin.path}.weight": tuple(f"{hf}.weight" for _, hf in lin.hf_modules()) for lin in LINEARS.values()},
    # Qwen2 has q/k/v biases; no supported family has the other linear biases
    "self_attention.linear_qkv.bias": tuple(f"{hf}.bias" for _, hf in LINEARS["linear_qkv"].hf_modules()),
    # Qwen3's per-head query/key RMSNorm (--qk-layernorm)
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
}
#: Hugging Face module (``self_attn.q_proj``) -> (linear layer, part or None for the whole layer)
_HF_PARTS = {hf: (lin.key, ours) for lin in LINEARS.values() for ours, hf in lin.hf_modules()}
_TOP_MAP = {
    f"{EMBEDDING}.{WORD_EMBEDDINGS}": ("model.embed_tokens.weight",),
    f"{FINAL_NORM}.weight": ("model.norm.weight",),
    f"{OUTPUT_LAYER}.weight": ("lm_head.weight",),
}


def _field_error(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: {field} = {value!r} {why}")


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {t: a for a, t in MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        if archs or "model_type" not in hf:
            raise _field_error("architectures", archs,
                               f"is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        raise _field_error("model_type", hf["model_type"], f"(no architectures field) is not supported; supported: "
                           f"{', '.join(f'{t} ({a})' for a, t in MODEL_TYPES.items())}")
    return arch


def _sliding_window(hf: dict[str, Any], arch: str) -> Optional[int]:
    """The window every layer attends within (None: full attention). Qwen2 windows only the layers
    from ``max_window_layers`` on (``layer_types`` in transformers 5); a mix of windowed and full layers
    cannot be expressed."""
    defaults = _FAMILY_DEFAULTS[arch]
    window = hf.get("sliding_window", defaults.get("sliding_window"))
    if arch == "LlamaForCausalLM" or window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise _field_error("sliding_window", window, "must be a positive integer or null")
    layers = hf["num_hidden_layers"]
    if arch in _QWEN:
        if not hf.get("use_sliding_window", False):
            return None
        types = hf.get("layer_types")
        field = "layer_types"
        if not types:
            start = hf.get("max_window_layers", defaults["max_window_layers"])
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
            field = "max_window_layers"
        windowed = {t == "sliding_attention" for t in types}
        if windowed == {False}:
            return None
        if windowed != {True}:
            raise _field_error(field, hf.get(field), f"windows some layers only (use_sliding_window = true, "
                               f"sliding_window = {window}); megatron_ru cannot mix windowed and full attention")
    return window


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json in either form, as one dict with ``rope_type`` and
    ``rope_theta`` (transformers 5 ``rope_parameters``; transformers 4 ``rope_theta`` + ``rope_scaling``)."""
    # as transformers 5 reads them: a non-empty rope_scaling wins over rope_parameters
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise _field_error(field, params, "must be a dict")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _field_error(field, params, "holds per-layer-type RoPE settings, which megatron_ru cannot express")
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _field_error(f"{field}.rope_type", rope_type,
                           f"cannot be expressed; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    params["rope_type"] = rope_type
    params["_field"] = field
    if "rope_theta" not in params:
        params["rope_theta"] = hf.get("rope_theta", 10000.0)
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise _field_error(f"{field}.rope_theta" if "rope_theta" in (hf.get(field) or {}) else "rope_theta", theta,
                           "must be a positive number")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _field_error("partial_rotary_factor", partial, "cannot be expressed (megatron_ru rotates every channel)")
    return params


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma3ForCausalLM config.json beyond the Llama ones (``_rope``: the global
    layers' RoPE settings, as :func:`rope_settings` gives them): GeGLU, (1 + w) norms, four norms a layer,
    embeddings times sqrt(hidden), query/key norms, the query_pre_attn_scalar scale, and the local / global
    layer pattern with each type's RoPE. What the model cannot express is an error naming the field."""
    defaults = _FAMILY_DEFAULTS[GEMMA3]
    act = hf.get("hidden_activation", defaults["hidden_activation"])
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise _field_error("hidden_activation", act, "cannot be expressed (megatron_ru's GeGLU is 'gelu_pytorch_tanh')")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise _field_error(key, hf[key], "cannot be expressed (no logit softcapping in megatron_ru)")
    if hf.get("use_bidirectional_attention", False):
        raise _field_error("use_bidirectional_attention", True, "cannot be expressed (megatron_ru is causal)")
    scalar = hf.get("query_pre_attn_scalar", defaults["query_pre_attn_scalar"])
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise _field_error("query_pre_attn_scalar", scalar, "must be a positive number")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    field = "layer_types"
    if not types:  # transformers 4: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern", defaults["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        field = "sliding_window_pattern"
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise _field_error(field, hf.get(field), f"must name full_attention or sliding_attention for each of the "
                                                 f"{layers} layers")
    window = hf.get("sliding_window", defaults["sliding_window"])
    local = [t == "sliding_attention" for t in types]
    skip = None
    if not any(local):
        window = None
    elif not all(local):
        skip = local.index(False) + 1
        if any(is_local != ((i + 1) % skip != 0) for i, is_local in enumerate(local)):
            raise _field_error(field, hf.get(field), f"is not a pattern of every {skip}-th layer global, which is "
                                                     f"what megatron_ru's --window-attn-skip-freq expresses")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise _field_error("sliding_window", window, "must be a positive integer or null")
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):   # transformers 5: one dict per layer type
        glob = rope_settings({"rope_parameters": params.get("full_attention", {"rope_theta": 1e6})})
        local_rope = params.get("sliding_attention", {"rope_type": "default", "rope_theta": 10000.0})
        field_local = "rope_parameters.sliding_attention"
        local_base = local_rope.get("rope_theta", 10000.0)
    else:   # transformers 4: rope_theta and rope_scaling for the global layers, rope_local_base_freq
        glob = rope_settings({"rope_theta": 1e6, **hf})
        local_rope, field_local = {}, "rope_local_base_freq"
        local_base = hf.get("rope_local_base_freq", 10000.0)
    if skip is None and window is not None:   # every layer local: the local RoPE everywhere
        glob = {"rope_type": "default", "rope_theta": float(local_base), "_field": field_local}
    if local_rope.get("rope_type", "default") != "default":
        raise _field_error(f"{field_local}.rope_type", local_rope["rope_type"],
                           "cannot be expressed (the sliding-window layers' RoPE is unscaled here)")
    return {"_rope": glob, "sliding_window": window, "window_attn_skip_freq": skip,
            "rotary_base_local": float(local_base) if skip is not None else None, "geglu": True,
            "apply_layernorm_1p": True, "sandwich_norm": True, "scale_embeddings": True,
            "softmax_scale": float(scalar) ** -0.5}


def model_config_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(ModelConfig, V) of a LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
    config.json."""
    arch = architecture_of(hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int) or hf[key] < 1:
            raise _field_error(key, hf.get(key), "must be a positive integer")
    gemma = _gemma3_fields(hf) if arch == GEMMA3 else {}
    act = hf.get("hidden_act", "silu")
    if arch != GEMMA3 and act != "silu":
        raise _field_error("hidden_act", act, "cannot be expressed (megatron_ru's gated MLP is SwiGLU: 'silu')")
    # mlp_bias / attention_bias are Llama's; Mistral and Qwen2 ignore them (their biases are fixed)
    if arch == "LlamaForCausalLM" and hf.get("mlp_bias", False):
        raise _field_error("mlp_bias", True, "cannot be expressed (no MLP biases in this model family)")
    qkv_bias = arch == "Qwen2ForCausalLM"
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", GEMMA3) and hf.get("attention_bias", False):
        raise _field_error("attention_bias", True, "cannot be expressed: it puts a bias on o_proj too; megatron_ru "
                                                   "supports biases on q/k/v only (Qwen2)")
    heads = hf["num_attention_heads"]
    for key in ("num_key_value_heads", "head_dim"):
        if hf.get(key) is not None and (not isinstance(hf[key], int) or isinstance(hf[key], bool) or hf[key] < 1):
            raise _field_error(key, hf[key], "must be a positive integer or null")
    groups = hf.get("num_key_value_heads") or heads
    if heads % groups:
        raise _field_error("num_key_value_heads", groups, f"must divide num_attention_heads ({heads})")
    head_dim = hf.get("head_dim", _FAMILY_DEFAULTS[arch].get("head_dim"))
    kv_channels = head_dim if head_dim and head_dim * heads != hf["hidden_size"] else None
    rope = gemma.pop("_rope") if arch == GEMMA3 else rope_settings(hf)
    scaling = {"default": "none"}.get(rope["rope_type"], rope["rope_type"])
    extra: dict[str, Any] = {}
    if scaling in ("linear", "llama3"):
        if "factor" not in rope:
            raise _field_error(f"{rope['_field']}.factor", None, f"is required for rope_type {scaling}")
        extra["rope_scaling_factor"] = float(rope["factor"])
    if scaling == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rope:
                raise _field_error(f"{rope['_field']}.{key}", None, "is required for rope_type llama3")
        extra.update(rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                     rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                     rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    window = gemma.pop("sliding_window") if arch == GEMMA3 else _sliding_window(hf, arch)
    max_positions = hf.get("max_position_embeddings", _FAMILY_DEFAULTS[arch]["max_position_embeddings"])
    tied = bool(hf.get("tie_word_embeddings", _FAMILY_DEFAULTS[arch].get("tie_word_embeddings", False)))
    cfg = ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=kv_channels, max_position_embeddings=max_positions,
        position_embedding_type="rope", rotary_base=float(rope["rope_theta"]), rope_scaling_type=scaling,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=arch != GEMMA3,
        disable_bias_linear=True, add_qkv_bias=qkv_bias, untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=float(hf.get("initializer_range", 0.02)), sliding_window=window,
        qk_layernorm=arch in ("Qwen3ForCausalLM", GEMMA3), **extra, **gemma)
    problems = cfg.problems()
    if problems:
        raise ValueError("config.json describes a model megatron_ru cannot build: " + "; ".join(problems))
    return cfg, hf["vocab_size"]


def export_problems(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` has no Hugging Face Llama/Qwen2 equivalent (empty: it has one)."""
    out = []
    if cfg.position_embedding_type != "rope":
        out.append("learned absolute position embeddings (--position-embedding-type learned_absolute)")
    if cfg.normalization != "RMSNorm":
        out.append(f"{cfg.normalization} (Llama/Qwen2 use RMSNorm: --normalization RMSNorm)")
    if not cfg.gated_mlp:
        out.append("a GELU MLP (Llama/Qwen2 use SwiGLU: --swiglu; Gemma 3 GeGLU: --geglu)")
    if cfg.add_bias_linear:
        out.append("biases on every linear layer (Llama/Qwen2 have none: --disable-bias-linear)")
    return out


def architecture_for(cfg: ModelConfig) -> str:
    """The HF architecture that expresses ``cfg`` (Qwen2 when Q/K/V have biases, Qwen3 with query/key norms,
    Mistral with a sliding window, else Llama); whether it can is :func:`hf_config_from_model`'s check."""
    if cfg.add_qkv_bias:
        return "Qwen2ForCausalLM"
    if cfg.sandwich_norm or cfg.geglu:
        return GEMMA3
    if cfg.qk_layernorm:
        return "Qwen3ForCausalLM"
    return "MistralForCausalLM" if cfg.sliding_window is not None else "LlamaForCausalLM"


def export_architecture(cfg: ModelConfig, requested: Optional[str] = None,
                        source_config: Optional[dict[str, Any]] = None) -> str:
    """The architecture an export writes: the one asked for, else the source config.json's (the model it was
    imported from), else :func:`architecture_for`. Never replaced by another: one the model cannot be written
    as is refused by :func:`hf_config_from_model`."""
    return requested or ((source_config or {}).get("architectures") or [None])[0] or architecture_for(cfg)


def hf_config_from_model(cfg: ModelConfig, vocab_size: int, architecture: Optional[str] = None,
                         extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """config.json for ``cfg`` (transformers 5 form), or the one ValueError that lists why ``cfg`` cannot be
    written as ``architecture`` (every writer of a Hugging Face directory checks here, before any tensor is
    written). ``extra``: fields kept from the imported config.json or set by the caller (token ids, dtype,
    ...); the model's own fields win."""
    architecture = architecture or architecture_for(cfg)
    problems = export_problems(cfg)
    if architecture not in SUPPORTED_ARCHITECTURES:
        problems.append(f"architecture {architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.add_qkv_bias and architecture != "Qwen2ForCausalLM":
        problems.append(f"Q/K/V biases (--add-qkv-bias), which {architecture} does not have (Qwen2ForCausalLM does)")
    if architecture == "LlamaForCausalLM" and cfg.sliding_window is not None:
        problems.append(f"a sliding window of {cfg.sliding_window} (--sliding-window), which LlamaForCausalLM does "
                        f"not have (MistralForCausalLM does)")
    if architecture == "Qwen2ForCausalLM" and not cfg.add_qkv_bias:
        problems.append("no Q/K/V biases, which Qwen2ForCausalLM always has (export as LlamaForCausalLM)")
    if cfg.qk_layernorm and architecture not in ("Qwen3ForCausalLM", GEMMA3):
        problems.append(f"query/key norms (--qk-layernorm), which {architecture} does not have (Qwen3ForCausalLM "
                        f"does)")
    if architecture in ("Qwen3ForCausalLM", GEMMA3) and not cfg.qk_layernorm:
        problems.append(f"no query/key norms, which {architecture} always has (--qk-layernorm)")
    gemma = {"--geglu": cfg.geglu, "--apply-layernorm-1p": cfg.apply_layernorm_1p, "--sandwich-norm": cfg.sandwich_norm,
             "--scale-embeddings": cfg.scale_embeddings}
    if architecture == GEMMA3:
        problems += [f"no {flag}, which Gemma3ForCausalLM always has" for flag, on in gemma.items() if not on]
        if cfg.rope_scaling_type == "llama3":
            problems.append("llama3 RoPE scaling, which Gemma3ForCausalLM does not use (linear or none)")
    else:
        problems += [f"{flag}, which {architecture} does not have (Gemma3ForCausalLM does)"
                     for flag, on in gemma.items() if on]
        for flag, value in (("--softmax-scale", cfg.softmax_scale), ("--window-attn-skip-freq", cfg.window_attn_skip_freq),
                            ("--rotary-base-local", cfg.rotary_base_local)):
            if value is not None:
                problems.append(f"{flag} {value}, which {architecture} does not have (Gemma3ForCausalLM does)")
    if problems:
        raise ValueError(f"this model cannot be expressed as {architecture}: it has " + "; ".join(problems))
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling_type == "none" else cfg.rope_scaling_type,
                            "rope_theta": float(cfg.rotary_base)}
    if cfg.rope_scaling_type in ("linear", "llama3"):
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_scaling_low_freq_factor,
                    high_freq_factor=cfg.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings)
    out: dict[str, Any] = dict(extra or {})
    for stale in ("rope_scaling", "rope_theta", "architectures", "model_type", "rope_local_base_freq",
                  "sliding_window_pattern"):
        out.pop(stale, None)
    out.update({
        "architectures": [architecture], "model_type": MODEL_TYPES[architecture], "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.resolved_ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": cfg.tied_embeddings, "rope_parameters": rope, "attention_dropout": 0.0,
        "initializer_range": cfg.init_method_std, "use_cache": True,
    })
    if cfg.max_position_embeddings is None:   # a RoPE model trained without the flag: the caller's value, else
        out["max_position_embeddings"] = (extra or {}).get("max_position_embeddings")   # transformers' default
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
    if architecture == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    if architecture == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window
    if architecture == "Qwen3ForCausalLM":
        out["attention_bias"] = False
    if architecture == GEMMA3:
        out.update(_gemma3_config(cfg, rope))
        del out["hidden_act"]   # Gemma's is hidden_activation
    if architecture in _QWEN:   # every layer windowed, or none (stale per-layer fields replaced)
        windowed = cfg.sliding_window is not None
        out.update(use_sliding_window=windowed, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if windowed else cfg.num_layers,
                   layer_types=["sliding_attention" if windowed else "full_attention"] * cfg.num_layers)
    return out


def _gemma3_config(cfg: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """The Gemma3ForCausalLM fields of config.json (transformers 5 form), stale transformers 4 ones replaced."""
    layers = [cfg.layer_is_local(i) for i in range(cfg.num_layers)]
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else cfg.head_dim ** -0.5
    scalar = scale ** -2
    local_base = cfg.rotary_base_local if cfg.rotary_base_local is not None else cfg.rotary_base
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar))
           < 1e-9 * scalar else scalar, "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else 4096,
           "layer_types": ["sliding_attention" if local else "full_attention" for local in layers],
           "rope_parameters": {"full_attention": rope, "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": float(local_base)}},
           "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
           "use_bidirectional_attention": False}
    return out


_TABLES: dict[tuple[str, str, int], Any] = {}


def _memo(kind: str, cfg: ModelConfig, vocab_size: int, build: Any) -> Any:
    """The name/shape tables of one model, built once (converters look them up per tensor)."""
    key = (kind, repr(cfg), vocab_size)
    if key not in _TABLES:
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = build()
    return _TABLES[key]


def hf_to_canonical_names(cfg: ModelConfig, vocab_size: int = 1) -> dict[str, tuple[str, ...]]:
    """canonical name -> the HF tensor names it is made of, in model order (a tied model: no lm_head)."""
    return dict(_memo("names", cfg, vocab_size, lambda: _hf_to_canonical_names(cfg, vocab_size)))


def _hf_to_canonical_names(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    layer_map = {**_LAYER_MAP, **_SANDWICH_NORMS} if cfg.sandwich_norm else _LAYER_MAP
    for spec in parameter_specs(cfg, vocab_size):
        if spec.name in _TOP_MAP:
            out[spec.name] = _TOP_MAP[spec.name]
            continue
        i = int(spec.name.split(".")[2])
        local = spec.name[len(layer_prefix(i)) + 1:]
        if local not in layer_map:
            raise ValueError(f"{spec.name} has no Hugging Face equivalent")
        out[spec.name] = tuple(f"model.layers.{i}.{n}" for n in layer_map[local])
    return out


def hf_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model with its expected shape."""
    return dict(_memo("shapes", cfg, vocab_size, lambda: _hf_shapes(cfg, vocab_size)))


def _hf_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for names in hf_to_canonical_names(cfg, vocab_size).values():
        for n in names:
            module = ".".join(n.split(".")[3:-1])     # model.layers.{i}.<module>.weight
            if n in ("model.embed_tokens.weight", "lm_head.weight"):
                out[n] = (vocab_size, h)
            elif n.endswith(("q_norm.weight", "k_norm.weight")):
                out[n] = (cfg.head_dim,)
            elif n.endswith("norm.weight"):
                out[n] = (h,)
            elif module in _HF_PARTS:
                linear, part = _HF_PARTS[module]
                lin = LINEARS[linear]
                rows = lin.part_rows(cfg)[part or linear]
                out[n] = (rows, lin.in_features(cfg)) if n.endswith("weight") else (rows,)
    return out


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], source: str = "config.json") -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"tensor {name} has shape {list(t.shape)}, expected {list(want)} from {source}")


def _sources(name: str, cfg: ModelConfig) -> tuple[str, ...]:
    names = _memo("names", cfg, 1, lambda: _hf_to_canonical_names(cfg, 1))
    if name not in names:
        raise ValueError(f"{name} is not a parameter of this model (tied embeddings: no {OUTPUT_LAYER}.weight)"
                         if name == f"{OUTPUT_LAYER}.weight" else f"{name} is not a parameter of this model")
    return names[name]


def to_canonical(name: str, hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The canonical tensor ``name`` from its HF tensors (``hf_to_canonical_names(cfg)[name]``)."""
    sources = _sources(name, cfg)
    missing = [n for n in sources if n not in hf_tensors]
    if missing:
        raise ValueError(f"{name} is made of {', '.join(sources)}: tensor {', '.join(missing)} is missing")
    vocab = hf_tensors[sources[0]].shape[0] if name in VOCAB_WEIGHTS \
        else 1
    shapes = _memo("shapes", cfg, vocab, lambda: _hf_shapes(cfg, vocab))
    for n in sources:
        _check_shape(n, hf_tensors[n], shapes[n])
    parts = [hf_tensors[n] for n in sources]
    fused = fused_linear(name)
    if fused is None:
        return parts[0]
    layout = PartLayout.full(fused, cfg)
    return layout.join(dict(zip(layout.parts(), parts)), dim=0)


def fused_linear(name: str) -> Optional[str]:
    """The linear layer whose canonical tensor ``name`` joins several Hugging Face tensors, else None."""
    for lin in LINEARS.values():
        if lin.parts and name.endswith((f"{lin.path}.weight", f"{lin.path}.bias")):
            return lin.key
    return None


def from_canonical(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF tensors of canonical tensor ``name`` (exact inverse of :func:`to_canonical`)."""
    sources = _sources(name, cfg)
    vocab = tensor.shape[0] if name in VOCAB_WEIGHTS else 1
    want = _memo("specs", cfg, vocab, lambda: {spec.name: spec.shape for spec in parameter_specs(cfg, vocab)})[name]
    _check_shape(name, tensor, want, "the model configuration")
    fused = fused_linear(name)
    if fused is None:
        return {sources[0]: tensor}
    parts = PartLayout.full(fused, cfg).split(tensor, dim=0)
    return {n: t.contiguous() for n, t in zip(sources, parts.values())}
