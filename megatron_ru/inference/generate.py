"""Autoregressive generation for a batch of prompts of different lengths, with a KV cache.

Every rank of a model replica calls :func:`generate` with the same prompts; the last stage picks
the next tokens (:mod:`megatron_ru.inference.sampling`) and broadcasts them, so all ranks follow
the same path and stop together. A sample that emits the end-of-document token stops there
(the token is part of its output); the batch stops when every sample has stopped or after
``max_new_tokens``.

With the cache, the first step runs the left-padded prompts and fills every layer's cache; each
later step runs one new token per sample. Without it (``use_cache=False``, for checking the cache),
every step runs the whole sequence again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import logging

import torch

from megatron_ru.inference.batching import attention_mask, left_pad
from megatron_ru.inference.runner import StageRunner
from megatron_ru.inference.sampling import SamplingParams, sample_generators, sample_next
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)


@dataclass
class Completion:
    """What one prompt produced: the generated ids (ending with the end-of-document token when the
    sample stopped there) and why it stopped: ``"eod"`` or ``"length"``."""
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def generate(runner: StageRunner, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             params: SamplingParams, eod: Optional[int] = None, pad_id: int = 0, seed: int = 1234,
             indices: Optional[Sequence[int]] = None, use_cache: bool = True) -> list[Completion]:
    """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids, any lengths).
    ``indices``: each prompt's index in the whole input (seeds its sampling generator; default
    0..n-1). Collective over the replica's ranks."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    device = runner.device
    batch = left_pad(prompts, pad_id, device)
    b, width = batch.tokens.shape
    check_positions(runner.cfg, width, max_new_tokens)
    generators = None
    if not params.greedy and runner.is_source():
        generators = sample_generators(seed, indices if indices is not None else range(b))
    caches = runner.new_kv_caches() if use_cache else None

    tokens, positions, valid = batch.tokens, batch.positions, batch.valid
    step_tokens, step_positions = tokens, positions
    out = [Completion(list(map(int, p))) for p in prompts]
    done = [False] * b
    for step in range(max_new_tokens):
        # causal over the real tokens; each windowed layer narrows it to its own window (Gemma 3's global
        # layers see everything)
        mask = attention_mask(valid, step_tokens.shape[1])
        with torch.no_grad():
            logits = runner(step_tokens, step_positions, attention_mask=mask, kv_caches=caches, last_only=True)
        nxt = torch.zeros(b, dtype=torch.long, device=device)
        if runner.is_source():
            nxt = sample_next(logits[:, -1], params, generators).to(torch.long)
        runner.broadcast_from_last(nxt)
        for i, t in enumerate(nxt.tolist()):
            if done[i]:
                continue
            out[i].token_ids.append(int(t))
            if eod is not None and t == eod:
                done[i], out[i].finish_reason = True, "eod"
        if all(done) or step == max_new_tokens - 1:
            break
        new_pos = positions[:, -1:] + 1
        tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        positions = torch.cat([positions, new_pos], dim=1)
        valid = torch.cat([valid, torch.ones((b, 1), dtype=torch.bool, device=device)], dim=1)
        step_tokens, step_positions = (nxt.unsqueeze(1), new_pos) if use_cache else (tokens, positions)
    return out


_warned_rope: set[tuple[int, int]] = set()


def check_positions(cfg: Any, width: int, max_new_tokens: int) -> None:
    """Generation past the model's --max-position-embeddings: refused with learned positions (there is no
    row for them); with RoPE, warned once per process and length (the positions exist but were never
    trained: the output usually degrades; training refuses such sequences)."""
    limit = cfg.max_position_embeddings
    if limit is None or width + max_new_tokens <= limit:
        return
    what = (f"the longest prompt ({width} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds the model's "
            f"--max-position-embeddings ({limit})")
    if cfg.position_embedding_type == "learned_absolute":
        raise ValueError(f"{what}; shorten the prompt or lower --max-new-tokens")
    key = (limit, width + max_new_tokens)
    if key in _warned_rope:
        return
    _warned_rope.add(key)
    scaled = (f" (that already includes its --rope-scaling-type {cfg.rope_scaling_type} x{cfg.rope_scaling_factor:g})"
              if cfg.rope_scaling_type != "none" else "")
    log_rank0(log, f"{what}, the context it was trained for{scaled}: RoPE positions past it were never trained and "
                   f"the output usually degrades; shorten the prompt or lower --max-new-tokens", level=logging.WARNING)
