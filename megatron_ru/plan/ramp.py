"""The planner under a batch-size ramp (``--rampup-batch-size``).

* Which layouts can run it: every batch of the ramp must be a whole number of micro batches per data-parallel
  rank, so START and INCREMENT are multiples of micro batch x DP (as ``pretrain_gpt.py`` validates).
* Memory: the ramp changes only how many micro batches a step runs, not their size; the most a pipeline stage
  holds in flight is ``min(PP - stage, micro batches)``, largest at the full global batch. The planner's
  memory prediction at ``--global-batch-size`` is therefore the peak of the whole run (the ramp's steps need
  no more).
* Time: each of the ramp's steps runs at its own batch: fewer micro batches fill the pipeline less (the bubble
  is a larger share) and the data-parallel gradient reduction is paid per step, not per sample. ``ramp_time``
  adds the predicted step time of every ramp step and compares it with the same samples at the full batch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.batch_ramp import BatchRamp
from megatron_ru.config.model import ModelConfig
from megatron_ru.plan.hardware import GpuSpec
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.memory import MemoryPrediction
from megatron_ru.plan.throughput import OURS, Overlap, predict_step_time


def ramp_problem(layout: Layout, ramp: BatchRamp) -> Optional[str]:
    """Why ``layout`` cannot run ``ramp`` (None: it can)."""
    per_step = layout.micro_batch * layout.dp
    if ramp.start % per_step or ramp.increment % per_step:
        return (f"--rampup-batch-size {ramp.start} {ramp.increment} {ramp.samples}: START and INCREMENT must be "
                f"multiples of micro batch {layout.micro_batch} x DP {layout.dp} = {per_step}")
    return None


@dataclass(frozen=True)
class RampTime:
    """The ramp's steps on one layout: how many per global batch, and their predicted time."""
    steps_per_batch: dict[int, int]
    samples: int
    seconds: float
    #: the same samples at the full global batch (steady-state step time x samples / global batch)
    constant_seconds: float

    @property
    def steps(self) -> int:
        return sum(self.steps_per_batch.values())

    @property
    def slowdown(self) -> float:
        return self.seconds / self.constant_seconds if self.constant_seconds else 1.0

    def summary(self) -> str:
        return (f"batch ramp-up: {self.steps} steps over {self.samples:,} samples, predicted {self.seconds:,.0f} s "
                f"({self.slowdown:.2f}x the {self.constant_seconds:,.0f} s those samples take at the full batch)")


def ramp_time(cfg: ModelConfig, vocab_size: int, layout: Layout, gpu: GpuSpec, ramp: BatchRamp, *,
              gpus_per_node: int = 8, memory: Optional[MemoryPrediction] = None, overlap: Overlap = OURS) -> RampTime:
    """Predicted time of the ramp's steps (until the consumed samples pass SAMPLES) on ``layout``."""
    counts: dict[int, int] = {}
    consumed = 0
    for consumed, batch in ramp.steps():
        if consumed > ramp.samples:
            break
        counts[batch] = counts.get(batch, 0) + 1
    seconds = 0.0
    for batch, n in counts.items():
        step = predict_step_time(cfg, vocab_size, dataclasses.replace(layout, global_batch=batch), gpu,
                                 gpus_per_node=gpus_per_node, memory=memory, overlap=overlap)
        seconds += n * step.seconds
    full = predict_step_time(cfg, vocab_size, dataclasses.replace(layout, global_batch=ramp.global_batch_size), gpu,
                             gpus_per_node=gpus_per_node, memory=memory, overlap=overlap)
    return RampTime(counts, consumed, seconds, full.seconds * consumed / ramp.global_batch_size)
