"""Megatron's pretraining batch sampler: each data-parallel rank's micro batches, resumable.

The sample stream is ``consumed_samples, consumed_samples + 1, ..., total_samples - 1`` cut
into global micro-batch slots of ``micro_batch_size * dp_size`` consecutive indices; rank r
gets positions ``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of every slot. Resuming
with the consumed count of a checkpoint therefore continues exactly where the uninterrupted
run would have been (consumed counts are multiples of the global batch, hence of the slot).

A plain iterable of index lists: pass it as ``batch_sampler=`` to a torch DataLoader.
"""
from __future__ import annotations

from typing import Iterator


class MegatronPretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, drop_last: bool = True) -> None:
        if total_samples < 1:
            raise ValueError(f"no samples to draw from (total_samples={total_samples}); the dataset is empty")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is outside the dataset of {total_samples} samples; "
                             "the checkpoint was trained on more data than this run's dataset holds "
                             "(raise --train-iters/--train-samples or check --data-path)")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1 (got {micro_batch_size})")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is not in [0, {dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last
        self._slot = micro_batch_size * dp_size

    def __len__(self) -> int:
        """Micro batches this rank yields."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._slot)
        if self.drop_last or rest == 0:
            return full
        # the last partial slot gives this rank a batch only if its positions reach into it
        return full + (1 if rest > self.dp_rank * self.micro_batch_size else 0)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.dp_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self._slot <= self.total_samples:
            yield list(range(start + first, start + first + self.micro_batch_size))
            start += self._slot
        if not self.drop_last and start < self.total_samples:
            tail = list(range(start + first, min(start + first + self.micro_batch_size, self.total_samples)))
            if tail:
                yield tail
