"""Blend several datasets by weight with Megatron's greedy interleaving (C++ helpers).

Sample ``i`` of the blend comes from the dataset whose share lags its weight the most
(``weight * max(i, 1) - taken`` largest), so every prefix of the blend follows the weights
to within one sample per dataset, and each dataset is read in its own order 0, 1, 2, ...
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from megatron_ru.data import helpers
from megatron_ru.utils.logging import RANK0, get_logger

log = get_logger(__name__)

# Megatron asks each dataset for 0.5 % more samples than its weight gives, so that the
# greedy interleaving (which can run ahead of a weight by a sample) never runs out.
OVERSHOOT = 1.005


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples to request from each dataset of a blend of ``num_samples`` (Megatron's margin)."""
    total = float(sum(weights))
    return [int(math.ceil(num_samples * (w / total) * OVERSHOOT)) for w in weights]


class BlendedDataset:
    """``size`` samples interleaved from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int, *, name: str = "train") -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{name}: need one weight per dataset (got {len(datasets)} datasets, {len(weights)} weights)")
        if len(datasets) > 255:
            raise ValueError(f"--data-path names {len(datasets)} datasets; a blend holds at most 255")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w <= 0) or not np.all(np.isfinite(w)):
            raise ValueError(f"{name}: blend weights must be positive and finite (got {list(weights)})")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.name = name
        self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(self.weights, size)
        taken = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, taken)):
            if n > len(ds):
                raise ValueError(f"{name} blend: dataset {d} ({getattr(getattr(ds, 'indexed', None), 'prefix', d)}) "
                                 f"has {len(ds)} samples but the blend needs {int(n)}; build it with "
                                 f"samples_per_dataset() (Megatron's {OVERSHOOT} margin)")
        shares = ", ".join(f"{100 * n / max(size, 1):.2f}% (weight {100 * x:.2f}%)" for n, x in zip(taken, self.weights))
        log.info("%s blend of %d samples: %s", name, size, shares, extra=RANK0)

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for the {self.name} blend of {n} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
