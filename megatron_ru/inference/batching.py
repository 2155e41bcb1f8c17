"""A batch of prompts of different lengths, left-padded, with per-sample positions and the
attention masks of every decoding step.

Left padding puts every prompt's last token in the last column, so one step appends one column
for the whole batch. Sample ``i``'s real tokens get positions 0, 1, 2, ... (as transformers'
``generate`` computes them from the attention mask), whatever its padding.

Masks are bool, True = may attend, shaped [b, 1, s_q, s_k] for the cached keys of the step.
A query attends to the real keys at or before it (and within the sliding window, when the model
has one). A padding query attends to itself only: every row keeps one key, so no softmax row is
empty (an all-masked row would give NaN, and NaN times a zero probability is still NaN in the
next layer's values); padding keys are masked for every real query, so they never matter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class PaddedBatch:
    """``tokens`` [b, L] left-padded prompts; ``valid`` [b, L] True on real tokens;
    ``positions`` [b, L] per-sample positions (0 on padding); ``lengths`` the prompt lengths."""
    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: Optional[torch.device] = None) -> PaddedBatch:
    """Left-pad token id lists to the longest one."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError(f"prompt {lengths.index(min(lengths))} has no tokens")
    width = max(lengths)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, width - len(p):] = True
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    return PaddedBatch(tokens.to(device), valid.to(device), positions.to(device), lengths)


def attention_mask(valid_keys: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Mask [b, 1, q, k] for the last ``num_queries`` of ``k`` cached positions (``valid_keys``
    [b, k] True on real tokens): causal, real keys only; a padding query sees only itself. A windowed layer
    narrows it to its own window (``Attention.forward``): the window is a property of the layer (Gemma 3's
    global layers have none), not of the batch."""
    b, k = valid_keys.shape
    q_idx = torch.arange(k - num_queries, k, device=valid_keys.device).unsqueeze(-1)   # [q, 1]
    k_idx = torch.arange(k, device=valid_keys.device).unsqueeze(0)                     # [1, k]
    allowed = k_idx <= q_idx
    mask = allowed.unsqueeze(0) & valid_keys.unsqueeze(1)                              # [b, q, k]
    self_only = (k_idx == q_idx).unsqueeze(0) & ~valid_keys[:, k - num_queries:].unsqueeze(-1)
    return (mask | self_only).unsqueeze(1)
