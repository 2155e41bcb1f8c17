"""Model FLOPs per token of one training iteration: the one convention of the progress line's TFLOP/s and
MFU, the planner's compute time and the benchmarks.

TFLOP/s per device counts the matrix multiplications of one training iteration (``2·m·n·k``
FLOPs per ``m×k @ k×n``), forward + backward (backward = 2 × forward), divided by the
iteration time and the number of devices. Per token, per transformer layer, forward:

* attention projections ``2·h·(q + 2·kv)`` (Q, K, V; ``q = heads·d``, ``kv = kv_heads·d`` for the head size
  ``d``, which is ``h/heads`` unless ``--kv-channels`` says otherwise: Mistral-Nemo, Qwen3) + ``2·q·h`` (out),
* attention itself ``2·s·q`` (Q·Kᵀ) + ``2·s·q`` (scores·V) — the full s×s square, like Megatron; a
  sliding-window layer (``--sliding-window W``: Mistral, Gemma 3's local layers) ``min(s, W)`` keys per query
  instead of ``s`` (the same convention with the window's width: the band of keys a query may see),
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
    window: Optional[int] = None    # --sliding-window of the local layers
    local_layers: int = 0           # how many of num_layers are local (sliding-window) layers

    @classmethod
    def of(cls, cfg: "ModelConfig", vocab_size: int, seq_length: int,
           num_layers: Optional[int] = None) -> "ModelShape":
        """The shape of model ``cfg`` (or of ``num_layers`` of its layers, with the model's share of local
        layers, rounded) at ``seq_length``."""
        total = cfg.num_layers
        n = total if num_layers is None else num_layers
        local = sum(cfg.layer_is_local(i) for i in range(total))
        if n != total:
            local = round(local * n / total) if total else 0
        return cls(num_layers=n, hidden_size=cfg.hidden_size,
                   ffn_hidden_size=cfg.resolved_ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
                   num_query_groups=cfg.query_groups, seq_length=seq_length, vocab_size=vocab_size,
                   gated_mlp=cfg.gated_mlp, head_dim=cfg.head_dim, window=cfg.sliding_window, local_layers=local)


def flops_per_token(shape: ModelShape, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward [+ recompute]) of one iteration."""
    h, s, f = shape.hidden_size, shape.seq_length, shape.ffn_hidden_size
    d = shape.head_dim if shape.head_dim is not None else h / shape.num_attention_heads
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    attn_proj = 2 * h * (q + 2 * kv) + 2 * q * h
    mlp = 2 * h * f * (3 if shape.gated_mlp else 2)
    local = shape.local_layers if shape.window is not None else 0
    keys = s * (shape.num_layers - local) + min(s, shape.window or s) * local   # keys per query, summed over layers
    layers_fwd = shape.num_layers * (attn_proj + mlp) + 4 * q * keys
    logits_fwd = 2 * h * shape.vocab_size
    layers_factor = 4 if recompute else 3
    return layers_fwd * layers_factor + 3 * logits_fwd
