"""LoRA/DoRA adapters of a checkpoint as Hugging Face artefacts: merged into the weights, or a PEFT
adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads on top of the exported base; and back (a PEFT adapter as
canonical adapter tensors, for ``import-hf --lora-adapter``).

A fused adapter (one A over linear_qkv or a SwiGLU linear_fc1) is exactly a set of peft adapters on
q/k/v (gate/up) sharing that A, with B (and DoRA's magnitude) split by rows; so every adapter
megatron_ru trains has a PEFT form, and every PEFT adapter on q/k/v/o/gate/up/down has ours.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional

import torch

from megatron_ru.config.linears import LINEARS
from megatron_ru.config.lora import HF_TARGETS, AdapterSpec, LoraSpec
from megatron_ru.config.model import ModelConfig
from megatron_ru.config.lora import model_adapters
from megatron_ru.model.spec import PartLayout

#: peft's key prefix in adapter_model.safetensors (PeftModelForCausalLM -> LlamaForCausalLM)
PEFT_PREFIX = "base_model.model."
#: canonical trained modules -> their Hugging Face module (peft's modules_to_save)
_SAVE_HF = {"embedding.word_embeddings.weight": ("model.embed_tokens", "embed_tokens"),
            "output_layer.weight": ("lm_head", "lm_head"), "decoder.final_layernorm.weight": ("model.norm", "norm")}


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The same model without adapters."""
    return dataclasses.replace(cfg, lora=None)


def _layout(cfg: ModelConfig, linear: str) -> PartLayout:
    return PartLayout.full(linear, cfg)


def _weight_name(a: AdapterSpec) -> str:
    return f"decoder.layers.{a.layer}.{a.module}.weight"


def _adapter(get: Callable[[str], torch.Tensor], a: AdapterSpec) -> dict[str, torch.Tensor]:
    out = {k: get(f"{a.name}.{k}").double() for k in ("lora_A", "lora_B")}
    try:
        out["magnitude"] = get(f"{a.name}.magnitude").double()
    except KeyError:
        pass
    return out


def merged_weights(get: Callable[[str], torch.Tensor], cfg: ModelConfig) -> Callable[[str], torch.Tensor]:
    """``get`` of the model with every adapter merged (in float64, then the stored dtype):
    ``W + s B A``, with DoRA ``m / |W + s B A| * (W + s B A)`` per output row."""
    spec = cfg.lora_spec
    by_weight: dict[str, list[AdapterSpec]] = {}
    for a in model_adapters(cfg):
        by_weight.setdefault(_weight_name(a), []).append(a)

    def merged(name: str) -> torch.Tensor:
        w = get(name)
        adapters = by_weight.get(name)
        if not adapters:
            return w
        full = w.double().clone()
        for a in adapters:
            t = _adapter(get, a)
            layout = _layout(cfg, a.linear)
            rows = layout.select(full, a.part, 0)        # a view into ``full`` for a part of a fused layer
            new = rows + a.scaling * (t["lora_B"] @ t["lora_A"])
            if spec is not None and spec.use_dora:
                new = (t["magnitude"] / new.norm(dim=1))[:, None] * new
            if a.whole:
                full = new
            else:
                deltas = {a.part: (new - rows).t()}
                full = full + layout.assemble(deltas, full.t()).t()
        return full.to(w.dtype)
    return merged


def _hf_parts(a: AdapterSpec) -> list[tuple[Optional[str], str]]:
    """(our part of the fused rows or None, peft module inside the layer) of one adapter."""
    modules = LINEARS[a.linear].hf_modules()
    return modules if a.whole else [(p, hf) for p, hf in modules if p == a.part]


def peft_adapter(get: Callable[[str], torch.Tensor], cfg: ModelConfig, base_dir: str,
                 dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter_model.safetensors tensors, adapter_config.json) of the checkpoint's adapters."""
    spec = cfg.lora_spec
    assert spec is not None
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    targets: set[str] = set()
    for a in model_adapters(cfg):
        t = _adapter(get, a)
        layout = _layout(cfg, a.linear)
        for part, module in _hf_parts(a):
            key = f"model.layers.{a.layer}.{module}"
            targets.add(module.rsplit(".", 1)[1])
            B = t["lora_B"] if part is None or not a.whole else layout.select(t["lora_B"], part, 0)
            tensors[f"{PEFT_PREFIX}{key}.lora_A.weight"] = t["lora_A"].to(dtype).contiguous()
            tensors[f"{PEFT_PREFIX}{key}.lora_B.weight"] = B.to(dtype).contiguous()
            if spec.use_dora:
                m = t["magnitude"] if part is None or not a.whole else layout.select(t["magnitude"], part, 0)
                tensors[f"{PEFT_PREFIX}{key}.lora_magnitude_vector"] = m.to(dtype).contiguous()
            if a.rank != spec.rank:
                ranks[key] = a.rank
            if a.alpha != spec.alpha:
                alphas[key] = a.alpha
    saved: list[str] = []
    for name, (hf, short) in _SAVE_HF.items():
        if _trained_fully(spec, name, cfg):
            tensors[f"{PEFT_PREFIX}{hf}.weight"] = get(name).to(dtype).contiguous()
            saved.append(short)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": os.path.abspath(base_dir),
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
              "target_modules": sorted(targets), "rank_pattern": ranks, "alpha_pattern": alphas,
              "use_rslora": spec.use_rslora, "use_dora": spec.use_dora, "fan_in_fan_out": False,
              "init_lora_weights": True, "modules_to_save": saved or None, "inference_mode": True}
    return tensors, config


def _trained_fully(spec: LoraSpec, name: str, cfg: ModelConfig) -> bool:
    import fnmatch

    from megatron_ru.config.lora import modules_to_save_patterns
    if name == "output_layer.weight" and cfg.tied_embeddings:
        return False
    return any(fnmatch.fnmatchcase(name, p) for p in modules_to_save_patterns(spec))


def write_peft_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def read_peft_adapter(path: str, cfg: ModelConfig, flag: str = "--lora-adapter"
                      ) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA/DoRA adapter directory for a model of ``cfg`` as our settings and canonical tensors
    (adapters on q/k/v/o/gate/up/down projections; modules_to_save of the embeddings, output layer and
    final norm). Anything else is refused naming ``flag``."""
    from safetensors.torch import load_file
    conf_path, weights_path = (os.path.join(path, n) for n in ("adapter_config.json", "adapter_model.safetensors"))
    if not os.path.isfile(conf_path) or not os.path.isfile(weights_path):
        raise FileNotFoundError(f"{flag} {path}: not a PEFT adapter directory (needs adapter_config.json and "
                                f"adapter_model.safetensors)")
    with open(conf_path, encoding="utf-8") as f:
        conf = json.load(f)
    if conf.get("peft_type") != "LORA":
        raise ValueError(f"{flag} {path}: peft_type {conf.get('peft_type')!r}; only LORA adapters (LoRA, rsLoRA, "
                         f"DoRA) can be imported")
    targets = conf.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{flag} {path}: target_modules is a regular expression ({targets!r}); give the list")
    unknown = sorted(set(targets) - set(HF_TARGETS))
    if unknown:
        raise ValueError(f"{flag} {path}: target_modules {unknown} are not projections of a Llama-style layer "
                         f"({', '.join(HF_TARGETS)})")
    sd = load_file(weights_path)
    sd = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in sd.items()}
    sd = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in sd.items()}
    save = []
    for name, (hf, short) in _SAVE_HF.items():
        if f"{hf}.weight" in sd:
            save.append({"embed_tokens": "embedding", "lm_head": "output_layer", "norm": "final_layernorm"}[short])
    spec = LoraSpec(rank=int(conf["r"]), alpha=float(conf.get("lora_alpha", conf["r"])),
                    dropout=float(conf.get("lora_dropout", 0.0)), targets=list(targets),
                    rank_pattern={k: float(v) for k, v in (conf.get("rank_pattern") or {}).items()},
                    alpha_pattern={k: float(v) for k, v in (conf.get("alpha_pattern") or {}).items()},
                    use_rslora=bool(conf.get("use_rslora")), use_dora=bool(conf.get("use_dora")),
                    modules_to_save=save)
    full = dataclasses.replace(cfg, lora=spec.to_dict())
    tensors: dict[str, torch.Tensor] = {}
    for a in model_adapters(full):
        (part, module), = _hf_parts(a)  # PEFT targets are parts: one peft module per adapter
        key = f"model.layers.{a.layer}.{module}"
        for ours, theirs in (("lora_A", "lora_A.weight"), ("lora_B", "lora_B.weight"),
                             ("magnitude", "lora_magnitude_vector")):
            if ours == "magnitude" and not spec.use_dora:
                continue
            if f"{key}.{theirs}" not in sd:
                raise ValueError(f"{flag} {path}: adapter_model.safetensors has no {key}.{theirs}")
            t = sd[f"{key}.{theirs}"]
            if ours == "lora_A" and t.shape[0] != a.rank:
                raise ValueError(f"{flag} {path}: {key}.{theirs} has rank {t.shape[0]}, adapter_config.json gives "
                                 f"{a.rank}")
            tensors[f"{a.name}.{ours}"] = t
    for name, (hf, _) in _SAVE_HF.items():
        if f"{hf}.weight" in sd:
            tensors[name] = sd[f"{hf}.weight"]
    return spec, tensors
