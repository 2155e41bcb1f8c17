"""LoRA / DoRA adapters: the flags (:class:`LoraConfig`) and the resolved, recorded settings
(:class:`LoraSpec`, kept on ``ModelConfig.lora`` and in every checkpoint's model arguments).

Adapters sit on the four linear layers of each transformer layer. A target is either a whole layer
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``: one adapter over its fused output)
or a part of a fused layer as peft names it on a Hugging Face model (``q_proj``, ``k_proj``,
``v_proj`` of linear_qkv; ``gate_proj``, ``up_proj`` of a SwiGLU linear_fc1; ``o_proj`` and
``down_proj`` are linear_proj and linear_fc2 whole). An adapter's canonical name is
``decoder.layers.{i}.self_attention.linear_qkv.lora.{part}``; its Hugging Face name is peft's module
name (``model.layers.{i}.self_attn.q_proj``). Rank and alpha patterns (``fnmatch``) match either.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_ru.config.base import arg
from megatron_ru.config.linears import LINEARS, hf_module, hf_targets

if TYPE_CHECKING:
    from megatron_ru.config.model import ModelConfig

#: peft / Hugging Face module names -> (linear layer, part; None = the whole layer)
HF_TARGETS = hf_targets()
#: what marks an adapter's parameters in a canonical (or module) parameter name
ADAPTER_MARK = ".lora."
INITS = ("kaiming", "gaussian", "zeros-b", "random")
#: --lora-modules-to-save short names -> canonical parameter prefixes
SAVE_ALIASES = {"embedding": "embedding.", "word_embeddings": "embedding.word_embeddings.",
                "embed_tokens": "embedding.word_embeddings.", "output_layer": "output_layer.",
                "lm_head": "output_layer.", "final_layernorm": "decoder.final_layernorm.",
                "norm": "decoder.final_layernorm."}


@dataclass
class LoraConfig:
    """LoRA / DoRA adapters (docs/lora.md)"""
    lora_rank: int = arg(0, "Rank of the LoRA adapters; 0 = no adapters (train the model itself). With a rank "
                            "the base weights are frozen and only the adapters (and --lora-modules-to-save) train.")
    lora_alpha: Optional[float] = arg(None, "LoRA alpha; the update is scaled by alpha/rank (alpha/sqrt(rank) "
                                            "with --use-rslora). Default: the rank (scale 1).")
    lora_dropout: float = arg(0.0, "Dropout on the adapters' input (as peft's lora_dropout).")
    lora_target_modules: Optional[list[str]] = arg(
        None, "Layers that get adapters: linear_qkv linear_proj linear_fc1 linear_fc2 (whole fused layers), "
              "peft's q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (parts), all-linear, or fnmatch "
              "patterns over canonical adapter names (decoder.layers.1*.self_attention.linear_qkv.lora.*). "
              "Default: all-linear.")
    lora_rank_pattern: Optional[str] = arg(
        None, "JSON file {fnmatch pattern: rank} (peft's rank_pattern); patterns match canonical adapter names "
              "or peft module names (model.layers.0.self_attn.q_proj, or just q_proj); the first match wins.")
    lora_alpha_pattern: Optional[str] = arg(None, "JSON file {fnmatch pattern: alpha} (peft's alpha_pattern).")
    use_rslora: bool = arg(False, "Rank-stabilised LoRA: scale alpha/sqrt(rank).")
    use_dora: bool = arg(False, "DoRA: a trained magnitude per output row times the direction of W + BA "
                                "(the norm computed over the full, unsharded rows).")
    lora_init: str = arg("kaiming", "Adapter initialisation; B = 0 (the model starts as the base) except with "
                                    "'random': kaiming = A kaiming-uniform (peft's default), gaussian = A ~ "
                                    "N(0, 1/rank) (peft's 'gaussian'), zeros-b = A ~ N(0, --init-method-std) "
                                    "(Megatron style), random = A and B kaiming-uniform (peft's "
                                    "init_lora_weights=False; not a no-op at start).", choices=INITS)
    lora_modules_to_save: Optional[list[str]] = arg(
        None, "Modules trained fully next to the adapters: embedding (or word_embeddings, embed_tokens), "
              "output_layer (lm_head), final_layernorm, or fnmatch patterns over canonical parameter names.")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    def problems(self) -> list[str]:
        found: list[str] = []
        if self.lora_rank < 0:
            found.append(f"--lora-rank must be >= 0, got {self.lora_rank}")
        if not 0.0 <= self.lora_dropout < 1.0:
            found.append(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha is not None and not (0.0 < self.lora_alpha < math.inf):
            found.append(f"--lora-alpha must be a positive number, got {self.lora_alpha} (the adapters' update is "
                         f"scaled by alpha/rank: 0 would train nothing); leave it out for alpha = rank")
        if not self.enabled:
            # every adapter flag set away from its default: without a rank it would be ignored, and the
            # run would silently train the whole model instead of adapters
            given = [flag for flag, on in (("--lora-alpha", self.lora_alpha is not None),
                                           ("--lora-dropout", self.lora_dropout != 0.0),
                                           ("--lora-init", self.lora_init != "kaiming"),
                                           ("--lora-target-modules", self.lora_target_modules),
                                           ("--lora-rank-pattern", self.lora_rank_pattern),
                                           ("--lora-alpha-pattern", self.lora_alpha_pattern),
                                           ("--use-dora", self.use_dora), ("--use-rslora", self.use_rslora),
                                           ("--lora-modules-to-save", self.lora_modules_to_save)) if on]
            if given:
                found.append(f"{', '.join(given)} need adapters: add --lora-rank R (a positive rank; "
                             f"--lora-rank {self.lora_rank} trains the whole model without adapters)")
        for flag, path in (("--lora-rank-pattern", self.lora_rank_pattern),
                           ("--lora-alpha-pattern", self.lora_alpha_pattern)):
            if path is not None:
                try:
                    read_pattern_file(path, flag)
                except ValueError as e:
                    found.append(str(e))
        return found


def read_pattern_file(path: str, flag: str) -> dict[str, float]:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file (a JSON object {{\"pattern\": value}})")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(f"{flag} {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                             for v in data.values()):
        raise ValueError(f"{flag} {path}: expected a JSON object of fnmatch pattern -> positive number, "
                         f"e.g. {{\"*.linear_qkv.lora.*\": 16}}")
    return {str(k): float(v) for k, v in data.items()}


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: on part ``part`` (the layer's own name when whole) of ``linear`` in layer ``layer``."""
    layer: int
    linear: str
    part: str
    rank: int
    alpha: float
    scaling: float

    @property
    def whole(self) -> bool:
        return self.part == self.linear

    @property
    def module(self) -> str:
        """The linear layer's path inside the transformer layer (``self_attention.linear_qkv``)."""
        return LINEARS[self.linear].path

    @property
    def name(self) -> str:
        return f"decoder.layers.{self.layer}.{self.module}{ADAPTER_MARK}{self.part}"

    @property
    def hf_module(self) -> Optional[str]:
        """peft's module name on a Llama-style Hugging Face model; None: no such module (a fused layer)."""
        hf = hf_module(self.linear, self.part)
        return None if hf is None else f"model.layers.{self.layer}.{hf}"


@dataclass
class LoraSpec:
    """The resolved adapter settings a model is built with (JSON-able, recorded in checkpoints)."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    rank_pattern: dict[str, float] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    init: str = "kaiming"
    modules_to_save: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, c: LoraConfig) -> Optional["LoraSpec"]:
        if not c.enabled:
            return None
        return cls(rank=c.lora_rank, alpha=float(c.lora_alpha if c.lora_alpha is not None else c.lora_rank),
                   dropout=c.lora_dropout, targets=list(c.lora_target_modules or ["all-linear"]),
                   rank_pattern=read_pattern_file(c.lora_rank_pattern, "--lora-rank-pattern")
                   if c.lora_rank_pattern else {},
                   alpha_pattern=read_pattern_file(c.lora_alpha_pattern, "--lora-alpha-pattern")
                   if c.lora_alpha_pattern else {},
                   use_rslora=c.use_rslora, use_dora=c.use_dora, init=c.lora_init,
                   modules_to_save=list(c.lora_modules_to_save or []))

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> Optional["LoraSpec"]:
        return None if d is None else (d if isinstance(d, LoraSpec) else cls(**d))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _candidates(num_layers: int, swiglu: bool) -> list[tuple[int, str, str]]:
    """Every (layer, linear, part) an adapter could sit on; part == linear for a whole layer."""
    out = []
    for i in range(num_layers):
        for linear, lin in LINEARS.items():
            out.append((i, linear, linear))
            if not lin.swiglu_parts or swiglu:
                out += [(i, linear, p.name) for p in lin.parts]
    return out


def _name(i: int, linear: str, part: str) -> str:
    return f"decoder.layers.{i}.{LINEARS[linear].path}{ADAPTER_MARK}{part}"


def _target_hits(target: str, cands: list[tuple[int, str, str]], swiglu: bool) -> list[tuple[int, str, str]]:
    if target == "all-linear":
        return [c for c in cands if c[1] == c[2]]
    if target in LINEARS:
        return [c for c in cands if c[1] == target and c[2] == target]
    if target in HF_TARGETS:
        linear, part = HF_TARGETS[target]
        if linear == "linear_fc1" and not swiglu:
            raise ValueError(f"--lora-target-modules {target}: this model's MLP has no gate/up projections (no "
                             f"--swiglu); target linear_fc1 instead")
        return [c for c in cands if c[1] == linear and c[2] == (part or linear)]
    return [c for c in cands if fnmatch.fnmatchcase(_name(*c), target)]


_NOT_WRAPPABLE = ("embedding", "word_embeddings", "embed_tokens", "output_layer", "lm_head", "layernorm", "norm")


def resolve_adapters(spec: LoraSpec, num_layers: int, swiglu: bool) -> list[AdapterSpec]:
    """Every adapter of the model, in layer order; ValueError naming the flag for a target or pattern
    that matches nothing, an adapter on both a fused layer and one of its parts, or a layer LoRA cannot
    wrap."""
    cands = _candidates(num_layers, swiglu)
    chosen: dict[tuple[int, str, str], None] = {}
    for t in spec.targets:
        if any(w in t for w in _NOT_WRAPPABLE):
            raise ValueError(f"--lora-target-modules {t}: adapters wrap the linear layers (linear_qkv, linear_proj, "
                             f"linear_fc1, linear_fc2 or their q/k/v/gate/up parts); to train the embeddings or the "
                             f"output layer fully next to them use --lora-modules-to-save")
        hits = _target_hits(t, cands, swiglu)
        if not hits:
            raise ValueError(f"--lora-target-modules {t!r} matches no layer; use linear_qkv, linear_proj, "
                             f"linear_fc1, linear_fc2, {', '.join(HF_TARGETS)}, all-linear, or a pattern over "
                             f"names like {_name(0, 'linear_qkv', 'linear_qkv')}")
        chosen.update(dict.fromkeys(hits))
    wholes = {(i, lin) for i, lin, part in chosen if part == lin}
    both = sorted({f"layer {i} {lin}" for i, lin, part in chosen if part != lin and (i, lin) in wholes})
    if both:
        raise ValueError(f"--lora-target-modules adapts both a whole fused layer and one of its parts ({both[0]}"
                         f"{' and more' if len(both) > 1 else ''}); choose linear_qkv or q_proj/k_proj/v_proj "
                         f"(linear_fc1 or gate_proj/up_proj)")
    out: list[AdapterSpec] = []
    used_r: set[str] = set()
    used_a: set[str] = set()
    for i, lin, part in sorted(chosen, key=lambda c: (c[0], list(LINEARS).index(c[1]), c[2])):
        names = [_name(i, lin, part)]
        hf = hf_module(lin, part)
        if hf:
            names.append(f"model.layers.{i}.{hf}")
        rank = _pattern_value(spec.rank_pattern, names, used_r)
        alpha = _pattern_value(spec.alpha_pattern, names, used_a)
        r = int(rank) if rank is not None else spec.rank
        a = float(alpha) if alpha is not None else spec.alpha
        if rank is not None and rank != int(rank):
            raise ValueError(f"--lora-rank-pattern gives {names[0]} the rank {rank}; ranks are whole numbers")
        out.append(AdapterSpec(i, lin, part, r, a, spec.scaling(r, a)))
    for flag, pats, used in (("--lora-rank-pattern", spec.rank_pattern, used_r),
                             ("--lora-alpha-pattern", spec.alpha_pattern, used_a)):
        unused = [p for p in pats if p not in used]
        if unused:
            raise ValueError(f"{flag}: the pattern {unused[0]!r} matches no adapter; patterns match canonical adapter "
                             f"names ({out[0].name if out else '...'}) or peft module names "
                             f"(model.layers.0.self_attn.q_proj, or q_proj)")
    return out


def _pattern_value(patterns: dict[str, float], names: list[str], used: set[str]) -> Optional[float]:
    value: Optional[float] = None
    for pat, v in patterns.items():
        if any(fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(n, "*." + pat) for n in names):
            used.add(pat)
            if value is None:
                value = v
    return value


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter (canonical, or a module's local name) belongs to a LoRA/DoRA adapter."""
    return ADAPTER_MARK in name


def modules_to_save_patterns(spec: LoraSpec) -> list[str]:
    """fnmatch patterns over canonical parameter names of the fully trained modules."""
    return [SAVE_ALIASES[m] + "*" if m in SAVE_ALIASES else m for m in spec.modules_to_save]


def adapter_param_shapes(a: AdapterSpec, in_features: int, out_rows: int, column: bool, use_dora: bool,
                         stride: int) -> list[tuple[str, tuple[int, ...], Optional[int], int]]:
    """(name, full shape, TP partition dim, stride) of one adapter's parameters; ``out_rows``: the rows
    of its part of the layer's output."""
    out = [("lora_A", (a.rank, in_features), None if column else 1, 1),
           ("lora_B", (out_rows, a.rank), 0 if column else None, stride if column else 1)]
    if use_dora:
        out.append(("magnitude", (out_rows,), 0 if column else None, stride if column else 1))
    return out


def model_adapters(cfg: ModelConfig) -> list[AdapterSpec]:
    """Every adapter of the model ``cfg`` describes (none without ``cfg.lora``)."""
    spec = cfg.lora_spec
    return [] if spec is None else resolve_adapters(spec, cfg.num_layers, cfg.gated_mlp)


def b_stride(cfg: ModelConfig, part: str) -> int:
    """TP split stride of B's rows: the fused [gate; up] rows of a SwiGLU linear_fc1 keep stride 2."""
    return LINEARS[part].stride(cfg) if part in LINEARS else 1
