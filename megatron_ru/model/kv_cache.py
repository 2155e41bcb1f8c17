"""Key/value cache for incremental decoding (``tools/generate.py``).

One :class:`LayerKVCache` per transformer layer of a stage holds this rank's keys and values
[b, groups/tp, s_total, d] (after RoPE). ``append`` adds a step's keys/values and returns
everything cached so far; storage grows by doubling, so decoding n tokens copies O(n) elements.
"""
from __future__ import annotations

from typing import Optional

import torch


class LayerKVCache:
    def __init__(self) -> None:
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [b, g, s_new, d] keys/values; return the cached [b, g, length, d] views."""
        new = k.shape[2]
        need = self.length + new
        if self._k is None or need > self._k.shape[2]:
            capacity = max(need, 2 * (self._k.shape[2] if self._k is not None else 0), 16)
            shape = (*k.shape[:2], capacity, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if self._k is not None and self.length:
                grown_k[:, :, :self.length] = self._k[:, :, :self.length]
                grown_v[:, :, :self.length] = self._v[:, :, :self.length]
            self._k, self._v = grown_k, grown_v
        self._k[:, :, self.length:need] = k
        self._v[:, :, self.length:need] = v
        self.length = need
        return self._k[:, :, :need], self._v[:, :, :need]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (e.g. to drop finished sequences)."""
        if self._k is not None:
            self._k, self._v = self._k[index], self._v[index]


class KVCache:
    """The caches of a stage's transformer layers, in order."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(num_layers)]

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
