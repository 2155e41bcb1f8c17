"""The linear layers of a transformer layer, described once: canonical path, column or row split,
input and output size, the fused parts in row order, and the Hugging Face module of each part.

Everything else derives from this table: parameter shapes and splits (``model/spec.py``), the rows
of each fused part (``model/spec.PartLayout``, used by attention, LoRA, the converters), the
Hugging Face names (``convert/hf_mapping.py``, ``convert/lora_export.py``) and the LoRA targets
(``config/lora.py``). It lives with the configuration because the LoRA flags are checked against
it; it has no other dependency than :class:`ModelConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.model import ModelConfig


@dataclass(frozen=True)
class Part:
    """One fused part: our name (``q``) and its module inside a Hugging Face decoder layer."""
    name: str
    hf_module: str


@dataclass(frozen=True)
class Linear:
    """An adaptable linear layer. ``parts`` are the fused parts in the order of the output rows (none:
    the layer is one Hugging Face module, ``hf_module``). ``swiglu_parts``: the parts exist only with
    SwiGLU (linear_fc1 holds [gate; up])."""
    key: str
    path: str
    column: bool
    parts: tuple[Part, ...] = ()
    hf_module: Optional[str] = None
    swiglu_parts: bool = False

    def has_parts(self, cfg: ModelConfig) -> bool:
        return bool(self.parts) and (cfg.gated_mlp or not self.swiglu_parts)

    def in_features(self, cfg: ModelConfig) -> int:
        return {"linear_qkv": cfg.hidden_size, "linear_proj": cfg.num_attention_heads * cfg.head_dim,
                "linear_fc1": cfg.hidden_size, "linear_fc2": cfg.resolved_ffn_hidden_size}[self.key]

    def part_rows(self, cfg: ModelConfig) -> dict[str, int]:
        """Output rows of each part (in row order), or of the whole layer under its own key."""
        d, nq, ng, ffn = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups, cfg.resolved_ffn_hidden_size
        if self.key == "linear_qkv":
            return {"q": nq * d, "k": ng * d, "v": ng * d}
        if self.key == "linear_fc1":
            return {"gate": ffn, "up": ffn} if cfg.gated_mlp else {self.key: ffn}
        return {self.key: cfg.hidden_size}

    def out_features(self, cfg: ModelConfig) -> int:
        return sum(self.part_rows(cfg).values())

    def stride(self, cfg: ModelConfig) -> int:
        """Tensor-parallel split stride of the output rows: every rank holds matching gate and up rows."""
        return 2 if self.swiglu_parts and cfg.gated_mlp else 1

    def hf_modules(self) -> list[tuple[Optional[str], str]]:
        """(our part, or None for the whole layer; Hugging Face module) in row order."""
        return [(p.name, p.hf_module) for p in self.parts] if self.parts else [(None, str(self.hf_module))]


LINEARS: dict[str, Linear] = {
    "linear_qkv": Linear("linear_qkv", "self_attention.linear_qkv", column=True,
                         parts=(Part("q", "self_attn.q_proj"), Part("k", "self_attn.k_proj"),
                                Part("v", "self_attn.v_proj"))),
    "linear_proj": Linear("linear_proj", "self_attention.linear_proj", column=False, hf_module="self_attn.o_proj"),
    "linear_fc1": Linear("linear_fc1", "mlp.linear_fc1", column=True,
                         parts=(Part("gate", "mlp.gate_proj"), Part("up", "mlp.up_proj")), swiglu_parts=True),
    "linear_fc2": Linear("linear_fc2", "mlp.linear_fc2", column=False, hf_module="mlp.down_proj"),
}


def hf_module(linear: str, part: str) -> Optional[str]:
    """The Hugging Face module of ``part`` of ``linear`` (part == linear: the whole layer); None when
    the whole layer is fused from several modules."""
    for ours, hf in LINEARS[linear].hf_modules():
        if ours == part or (ours is None and part == linear):
            return hf
    return None


def hf_targets() -> dict[str, tuple[str, Optional[str]]]:
    """peft's short module names -> (linear layer, part; None = the whole layer)."""
    return {hf.rsplit(".", 1)[1]: (lin.key, ours) for lin in LINEARS.values() for ours, hf in lin.hf_modules()}


def part_rows(cfg: ModelConfig) -> dict[str, int]:
    """Output rows of every part and of every whole layer (by its own key)."""
    out: dict[str, int] = {}
    for lin in LINEARS.values():
        rows = lin.part_rows(cfg)
        out[lin.key] = sum(rows.values())
        out.update(rows)
    return out


def linear_inputs(cfg: ModelConfig) -> dict[str, int]:
    """Input features of every linear layer."""
    return {lin.key: lin.in_features(cfg) for lin in LINEARS.values()}
