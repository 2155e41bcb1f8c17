"""Batch-size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``) with Megatron's semantics.

The global batch of a step is a function of the samples consumed before it::

    increments = (global_batch_size - START) // INCREMENT
    per_increment = SAMPLES / increments                      (a float, as in Megatron)
    batch(consumed) = global_batch_size                        if consumed > SAMPLES
                      START + int(consumed / per_increment) * INCREMENT   otherwise

and consumed samples advance by the batch each step used. Megatron's example: ``--rampup-batch-size 16 8
300000 --global-batch-size 1024`` starts at 16 and over (1024 - 16) / 8 = 126 increments grows by 8 every
~2380 samples. With ``--train-samples`` the number of iterations counts the ramp's steps (Megatron's
``update_train_iters``: steps while consumed <= SAMPLES and <= train samples, then the rest in full global
batches, a partial last batch dropped).

Pure arithmetic, no torch: validation, the training loop, the learning-rate schedule and the planner read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


@dataclass(frozen=True)
class BatchRamp:
    start: int
    increment: int
    samples: int
    global_batch_size: int

    @classmethod
    def of(cls, values: Optional[Sequence[int]], global_batch_size: int) -> Optional["BatchRamp"]:
        """The ramp of ``--rampup-batch-size`` (None when the flag is not given); ``values`` are valid
        (:func:`ramp_problems` found nothing)."""
        if values is None:
            return None
        start, increment, samples = (int(v) for v in values)
        return cls(start, increment, samples, global_batch_size)

    @property
    def num_increments(self) -> int:
        return (self.global_batch_size - self.start) // self.increment

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples (Megatron's
        ``RampupBatchsizeNumMicroBatchesCalculator.update``, float division included)."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        per_increment = self.samples / self.num_increments
        steps = int(consumed_samples / per_increment)
        return min(self.start + steps * self.increment, self.global_batch_size)

    def steps(self, consumed_samples: int = 0) -> Iterator[tuple[int, int]]:
        """Endless ``(consumed before the step, batch of the step)`` from ``consumed_samples`` on."""
        consumed = consumed_samples
        while True:
            batch = self.batch_size_at(consumed)
            yield consumed, batch
            consumed += batch

    def consumed_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Samples consumed after ``iterations`` more steps from ``consumed_samples``."""
        consumed = consumed_samples
        for _ in range(iterations):
            consumed += self.batch_size_at(consumed)
        return consumed

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run (Megatron's ``update_train_iters`` with a ramp)."""
        iterations, consumed = 0, 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def describe(self) -> str:
        return (f"global batch {self.start} -> {self.global_batch_size} in steps of {self.increment} over the first "
                f"{self.samples} samples (~{self.samples / max(self.num_increments, 1):.0f} samples per increment)")


def ramp_problems(values: Optional[Sequence[int]], global_batch_size: Optional[int], micro_batch_size: int,
                  dp: int) -> list[str]:
    """What is wrong with ``--rampup-batch-size`` against the batch flags and the data-parallel size ``dp``
    (Megatron's checks: positive values, START <= --global-batch-size, their difference a multiple of
    INCREMENT; and every batch of the ramp a whole number of micro batches per rank)."""
    if values is None:
        return []
    flag = "--rampup-batch-size START INCREMENT SAMPLES"
    if len(values) != 3:
        return [f"{flag} takes three numbers (got {len(values)}: {' '.join(map(str, values))}); e.g. "
                f"--rampup-batch-size 16 8 300000"]
    start, increment, samples = values
    out = []
    if start < 1 or increment < 1:
        out.append(f"{flag}: START ({start}) and INCREMENT ({increment}) must be >= 1")
    if samples < 1:  # Megatron divides by it (and fails): a ramp over no samples is no ramp
        out.append(f"{flag}: SAMPLES must be >= 1 (got {samples}); drop --rampup-batch-size for a constant batch")
    if global_batch_size is None:
        return out + [f"{flag} ramps up to --global-batch-size: give --global-batch-size"]
    if out:
        return out
    if start >= global_batch_size:
        return [f"{flag}: START ({start}) must be smaller than --global-batch-size ({global_batch_size}), the batch "
                f"the ramp ends at; drop --rampup-batch-size for a constant batch"]
    if (global_batch_size - start) % increment:
        return [f"{flag}: --global-batch-size ({global_batch_size}) - START ({start}) = {global_batch_size - start} "
                f"must be a multiple of INCREMENT ({increment}); e.g. --rampup-batch-size "
                f"{global_batch_size - (global_batch_size - start) // increment * increment} {increment} {samples}"]
    per_step = micro_batch_size * dp
    for name, value in (("START", start), ("INCREMENT", increment)):
        if micro_batch_size >= 1 and dp >= 1 and value % per_step:
            out.append(f"{flag}: {name} ({value}) must be a multiple of --micro-batch-size ({micro_batch_size}) x "
                       f"data-parallel size ({dp}) = {per_step}, so that every batch of the ramp is a whole number of "
                       f"micro batches per rank; e.g. {name} {max(per_step, value // per_step * per_step)}")
    return out
