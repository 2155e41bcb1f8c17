"""Every candidate layout of a model on a number of GPUs, its memory and step time, ranked; the
reason each family of layouts that never fits fails."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_ru.config.batch_ramp import BatchRamp
from megatron_ru.config.model import ModelConfig, model_parallel_problems
from megatron_ru.parallel.topology import data_parallel_size
from megatron_ru.plan.activations import Runtime
from megatron_ru.plan.hardware import GIB, GpuSpec
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.memory import MemoryPrediction, predict_memory
from megatron_ru.plan.states import BucketSizes
from megatron_ru.plan.throughput import OURS, Overlap, StepTime, predict_step_time


#: the share of a device's memory a layout must leave free to count as fitting: the planner's own error
#: (BENCHMARKS.md, "Layout planner": measured peaks against predicted ones, benchmarks/plan_memory.py) plus what a
#: run holds beyond the training step (a validation batch, a checkpoint being written, another library's cache)
MEMORY_MARGIN = 0.05


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the planner may make (None: try all that are valid)."""
    recompute: Optional[tuple[str, ...]] = None
    sequence_parallel: Optional[tuple[bool, ...]] = None
    zero_stages: Optional[tuple[int, ...]] = None
    max_micro_batch: int = 8
    max_tp: Optional[int] = None
    """default: GPUs per node (TP across nodes is never worth it)"""
    context_parallel: Optional[tuple[int, ...]] = None
    """CP sizes to consider (the ring); default: 1 and every size the sequence allows (seq % 2CP == 0) whose
    TP x CP group stays within a node"""
    tensor_parallel: Optional[tuple[int, ...]] = None
    """TP sizes to consider (a flag the user gave); default: every divisor up to ``max_tp``"""
    pipeline_parallel: Optional[tuple[int, ...]] = None
    """PP sizes to consider; default: every divisor"""
    micro_batches: Optional[tuple[int, ...]] = None
    """micro batch sizes to consider; default: 1, 2, 4, ... up to ``max_micro_batch``"""


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryPrediction
    time: Optional[StepTime] = None

    @property
    def fits(self) -> bool:
        return self.time is not None


@dataclass
class Plan:
    fitting: list[Candidate]
    rejected: list[str]
    invalid: list[str]
    capacity_bytes: int
    considered: int
    notes: list[str] = field(default_factory=list)
    margin: float = MEMORY_MARGIN
    """the share of ``capacity_bytes`` a fitting layout leaves free"""

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.capacity_bytes, self.margin)

    @property
    def best(self) -> Optional[Candidate]:
        return self.fitting[0] if self.fitting else None


def usable_bytes(capacity_bytes: int, margin: float = MEMORY_MARGIN) -> int:
    """What a layout's predicted peak may reach on a device of ``capacity_bytes``."""
    return int(capacity_bytes * (1.0 - margin))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _zero_stages(pp: int, precision: str, space: SearchSpace) -> list[int]:
    stages = [0, 1] if pp > 1 else [0, 1, 2, 3]
    if precision == "bf16":
        stages = [z for z in stages if z > 0]  # bf16 with fp32 gradient accumulation needs ZeRO >= 1
    return [z for z in stages if space.zero_stages is None or z in space.zero_stages]


def candidate_layouts(cfg: ModelConfig, num_gpus: int, global_batch: int, seq_length: int, precision: str,
                      gpus_per_node: int, space: SearchSpace = SearchSpace(), ramp: Optional[BatchRamp] = None
                      ) -> tuple[list[Layout], list[str]]:
    """Valid layouts and, per (TP, PP) that cannot run at all, why. ``ramp``: only micro batches that divide
    every batch of the batch-size ramp (``megatron_ru.plan.ramp``)."""
    out, invalid = [], []
    max_tp = space.max_tp or gpus_per_node
    for tp, cp in _tp_cp(num_gpus, seq_length, max_tp, gpus_per_node, space, invalid):
        for pp in _divisors(num_gpus // (tp * cp)):
            if space.pipeline_parallel is not None and pp not in space.pipeline_parallel:
                continue
            name = f"TP {tp} x PP {pp}" + (f" x CP {cp}" if cp > 1 else "")
            problems = model_parallel_problems(cfg, tp, pp)
            if problems:
                invalid.append(f"{name}: " + "; ".join(problems))
                continue
            dp = data_parallel_size(num_gpus, tp, pp, cp)
            if global_batch % dp:
                invalid.append(f"{name}: --global-batch-size {global_batch} is not divisible by DP {dp}")
                continue
            sizes = space.micro_batches or tuple(mb for mb in (1, 2, 4, 8, 16, 32) if mb <= space.max_micro_batch)
            micro = [mb for mb in sizes if global_batch % (mb * dp) == 0
                     and (ramp is None or (ramp.start % (mb * dp) == 0 and ramp.increment % (mb * dp) == 0))]
            if not micro and ramp is not None:
                invalid.append(f"{name}: --rampup-batch-size {ramp.start} {ramp.increment} "
                               f"{ramp.samples}: START and INCREMENT are not multiples of micro batch x DP {dp}")
            for mb in micro:
                for sp in (False, True) if tp > 1 else (False,):
                    if space.sequence_parallel is not None and sp not in space.sequence_parallel:
                        continue
                    for rc in space.recompute or ("none", "full"):
                        for zero in _zero_stages(pp, precision, space):
                            out.append(Layout(tp, pp, dp, mb, global_batch, seq_length, sp, rc, zero, precision,
                                              cp=cp))
    return out, invalid


def _tp_cp(num_gpus: int, seq_length: int, max_tp: int, gpus_per_node: int, space: SearchSpace,
           invalid: list[str]) -> list[tuple[int, int]]:
    """The (TP, CP) pairs to try: TP up to ``max_tp``; CP (the ring) where the sequence splits into 2 x CP chunks
    and the TP x CP group fits in a node (its exchange is per layer, like TP's)."""
    pairs = []
    for tp in _divisors(num_gpus):
        if space.tensor_parallel is not None:
            if tp not in space.tensor_parallel:
                continue
        elif tp > max_tp:
            continue
        for cp in _divisors(num_gpus // tp):
            if space.context_parallel is not None and cp not in space.context_parallel:
                continue
            if cp > 1 and space.context_parallel is None and tp * cp > gpus_per_node:
                continue
            if cp > 1 and seq_length % (2 * cp):
                if space.context_parallel is not None:
                    invalid.append(f"CP {cp}: --seq-length {seq_length} is not divisible by 2 x CP = {2 * cp}")
                continue
            pairs.append((tp, cp))
    return pairs


def _family(layout: Layout) -> tuple[int, int, int, str]:
    return layout.tp, layout.pp, layout.cp, layout.recompute


def _largest_terms(pred: MemoryPrediction, n: int = 3) -> str:
    top = sorted(pred.terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f} GiB" for k, v in top)


def plan_layouts(cfg: ModelConfig, vocab_size: int, gpu: GpuSpec, num_gpus: int, global_batch: int, seq_length: int,
                 precision: str, *, gpus_per_node: int = 8, optimizer: str = "adam",
                 buckets: Optional[BucketSizes] = None, space: SearchSpace = SearchSpace(),
                 overlap: Overlap = OURS, attention: str = "fused", ramp: Optional[BatchRamp] = None,
                 device: str = "cuda", margin: float = MEMORY_MARGIN) -> Plan:
    """Predict every candidate; rank those that fit (predicted peak within ``1 - margin`` of the memory) by
    tokens/s per GPU (then by memory). ``attention``: "fused" (PyTorch's flash / memory-efficient SDPA) or "math"
    (kernels that keep the s x s scores). ``device``: "cuda" (a GPU's memory: the CUDA context counted) or "cpu"
    (a process's, as a CPU run has it)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"the memory margin must be a share in [0, 1): {margin}")
    gpu.peak(precision)  # a precision the GPU has, or a clear error
    layouts, invalid = candidate_layouts(cfg, num_gpus, global_batch, seq_length, precision, gpus_per_node, space,
                                         ramp)
    capacity = usable_bytes(gpu.memory_bytes, margin)
    cands: list[Candidate] = []
    for layout in layouts:
        mem = predict_memory(cfg, vocab_size, layout, device=device, optimizer=optimizer, buckets=buckets,
                             runtime=Runtime(device, attention) if device == "cuda" else None)
        cand = Candidate(layout, mem)
        if mem.total_bytes <= capacity:
            cand.time = predict_step_time(cfg, vocab_size, layout, gpu, gpus_per_node=gpus_per_node, memory=mem,
                                          overlap=overlap)
        cands.append(cand)
    fitting = sorted((c for c in cands if c.fits),
                     key=lambda c: (-c.time.tokens_per_second_per_gpu, c.memory.total_bytes))
    rejected = []
    families: dict[tuple[int, int, int, str], list[Candidate]] = {}
    for c in cands:
        families.setdefault(_family(c.layout), []).append(c)
    for (tp, pp, cp, rc), members in sorted(families.items()):
        if any(c.fits for c in members):
            continue
        least = min(members, key=lambda c: c.memory.total_bytes)
        how = "with full recomputation" if rc == "full" else "without recomputation"
        lay = least.layout
        need, have = least.memory.total_bytes / GIB, capacity / GIB
        digits = 1 if f"{need:.1f}" != f"{have:.1f}" else 2  # never "15.8 GiB > 15.8 GiB"
        rejected.append(f"TP {tp} x PP {pp}{f' x CP {cp}' if cp > 1 else ''} {how}: at best ({lay.short()}) {need:.{digits}f} GiB "
                        f"> {have:.{digits}f} GiB usable per GPU (largest: {_largest_terms(least.memory)})")
    return Plan(fitting, rejected, invalid, gpu.memory_bytes, len(cands), margin=margin)
