"""Choosing the next token from full-vocabulary logits: greedy, or sampling with temperature,
top-k and top-p (nucleus).

Sampling draws from CPU ``torch.Generator``s, one per prompt, seeded by ``--seed`` and the prompt's
index, on the one rank that samples (the last pipeline stage's tensor-parallel rank 0); the chosen
ids are then broadcast, so every rank continues with the same tokens, and a prompt's completion
does not depend on the layout, the batch it is in or the device. The logits handed in are exactly the model's ``V`` real
vocabulary rows (padded rows are never candidates).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``greedy`` ignores the other fields."""
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def problems(self) -> list[str]:
        """Every invalid value, each naming its flag."""
        found = []
        if not self.greedy and not self.temperature > 0:
            found.append(f"--temperature must be > 0 when sampling (got {self.temperature}); use --greedy "
                         f"for argmax decoding")
        if self.top_k < 0:
            found.append(f"--top-k must be >= 0 (0 = no top-k filter), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            found.append(f"--top-p must be in (0, 1] (1 = no nucleus filter), got {self.top_p}")
        return found


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` [b, V] with every token outside the top-k and outside the smallest set whose
    probability reaches ``top_p`` set to -inf (the most likely token always stays)."""
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # a token is dropped when the tokens ranked above it already reach top_p
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generators: Optional[Sequence[torch.Generator]] = None) -> torch.Tensor:
    """Next token ids [b] (int64, on ``logits``' device) from ``logits`` [b, V].

    Greedy is ``argmax`` (the first maximum on ties, as ``torch.argmax``). Sampling works in fp32 on
    the CPU, row ``i`` drawing from ``generators[i]`` (one per sample, so a sample's tokens do not
    depend on the other prompts in its batch), so the same seeds give the same tokens on any device."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    scores = logits.detach().float().cpu() / params.temperature
    probs = torch.softmax(filter_logits(scores, params.top_k, params.top_p), dim=-1)
    if generators is None:
        ids = torch.multinomial(probs, 1).squeeze(-1)
    else:
        if len(generators) != probs.shape[0]:
            raise ValueError(f"{len(generators)} generators for {probs.shape[0]} samples")
        ids = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g).view(1)
                         for i, g in enumerate(generators)])
    return ids.to(logits.device)


def sample_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s generator under ``--seed seed`` (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_generators(seed: int, indices: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per prompt, seeded from ``--seed`` and the prompt's index in the input."""
    return [torch.Generator(device="cpu").manual_seed(sample_seed(seed, i)) for i in indices]
