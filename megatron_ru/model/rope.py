"""Rotary position embeddings: the inverse frequencies (with transformers' ``linear`` and ``llama3``
scaling) and the cos/sin tables in LLaMA's non-interleaved "rotate half" convention, always in fp32.

The frequencies are computed once per (settings, device) and kept outside any module rather than in a
buffer: a buffer would be cast to bf16/fp16 with the module and lose the digits large positions need.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_ru.config.model import ModelConfig


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    base: float
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: Optional[int] = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, local: bool = False) -> "RopeSpec":
        """The RoPE of a layer; ``local``: a sliding-window layer, which has its own unscaled base
        (--rotary-base-local) where the model mixes local and global layers (Gemma 3)."""
        if local and cfg.rotary_base_local is not None:
            return cls(cfg.head_dim, float(cfg.rotary_base_local))
        return cls(cfg.head_dim, float(cfg.rotary_base), cfg.rope_scaling_type, cfg.rope_scaling_factor,
                   cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
                   cfg.rope_scaling_original_max_position_embeddings)

    def inv_freq(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[head_dim / 2] fp32 inverse frequencies, as transformers' rope init functions compute them
        (computed once per device; every layer of every step reuses them; do not modify). Inside
        ``torch.compile`` they are computed in the graph instead (the compiler does not trace the cache)."""
        if torch.compiler.is_compiling():
            return self.compute_inv_freq(device)
        return _cached_inv_freq(self, None if device is None else torch.device(device))

    def compute_inv_freq(self, device: Optional[torch.device] = None) -> torch.Tensor:
        d = self.head_dim
        inv = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if self.scaling == "linear":
            return inv / self.factor
        if self.scaling == "llama3":
            old = self.original_max_positions
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@functools.lru_cache(maxsize=64)
def _cached_inv_freq(spec: RopeSpec, device: Optional[torch.device]) -> torch.Tensor:
    return spec.compute_inv_freq(device)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables broadcastable to [s, b, heads, d] for positions [s] or [b, s] (fp32 math)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq   # [s, d/2] or [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    emb = emb.unsqueeze(1) if emb.dim() == 2 else emb.transpose(0, 1)   # [s, 1|b, d]
    emb = emb.unsqueeze(2)                                # [s, 1|b, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@functools.lru_cache(maxsize=16)
def cached_cos_sin(spec: RopeSpec, length: int, device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_cos_sin` for positions 0..length-1 (training's case), computed once per length, device
    and dtype. A compiled layer takes them as inputs (``--torch-compile``): computed inside the graph,
    inductor fuses the fp32 powers, sines and cosines into the per-element RoPE kernel of q and k, which
    then evaluates them for every head and batch row (~9 % of a 1B step on an H200). Do not modify."""
    return rotary_cos_sin(torch.arange(length, device=device), spec.inv_freq(device), dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
