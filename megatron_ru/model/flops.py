"""Model FLOPs per token of one training iteration: the one convention of the progress line's TFLOP/s and
MFU, the planner's compute time and the benchmarks.

TFLOP/s per device counts the matrix multiplications of one training iteration (``2·m·n·k``
FLOPs per ``m×k @ k×n``), forward + backward (backward = 2 × forward), divided by the
iteration time and the number of devices. Per token, per transformer layer, forward:

* attention projections ``2·h·(q + 2·kv)`` (Q, K, V; ``q = heads·d``, ``kv = kv_heads·d`` for the head size
  ``d``, which is ``h/heads`` unless ``--kv-channels`` says otherwise: Mistral-Nemo, Qwen3) + ``2·q·h`` (out),
* attention itself ``2·s·q`` (Q·Kᵀ) + ``2·s·q`` (scores·V) — the full s×s square, like Megatron,
* MLP ``2·h·f·3`` for a gated (SwiGLU) MLP, ``2·h·f·2`` otherwise,

and the output layer ``2·h·V``. Training is 3 × forward; ``--recompute-granularity full`` adds one
more forward of the transformer layers (not of the output layer). For a GPT with ``f = 4h``
and no GQA this is Megatron's ``72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_ru.config.model import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int
    gated_mlp: bool
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads

    @classmethod
    def of(cls, cfg: "ModelConfig", vocab_size: int, seq_length: int,
           num_layers: Optional[int] = None) -> "ModelShape":
        """The shape of model ``cfg`` (or of ``num_layers`` of its layers) at ``seq_length``."""
        return cls(num_layers=cfg.num_layers if num_layers is None else num_layers, hidden_size=cfg.hidden_size,
                   ffn_hidden_size=cfg.resolved_ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
                   num_query_groups=cfg.query_groups, seq_length=seq_length, vocab_size=vocab_size,
                   gated_mlp=cfg.gated_mlp, head_dim=cfg.head_dim)


def flops_per_token(shape: ModelShape, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward [+ recompute]) of one iteration."""
    h, s, f = shape.hidden_size, shape.seq_length, shape.ffn_hidden_size
    d = shape.head_dim if shape.head_dim is not None else h / shape.num_attention_heads
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    attn_proj = 2 * h * (q + 2 * kv) + 2 * q * h
    attn_core = 4 * s * q
    mlp = 2 * h * f * (3 if shape.gated_mlp else 2)
    layer_fwd = attn_proj + attn_core + mlp
    logits_fwd = 2 * h * shape.vocab_size
    layers_factor = 4 if recompute else 3
    return shape.num_layers * layer_fwd * layers_factor + 3 * logits_fwd
