"""Bytes of parameters, gradients and optimizer state one rank holds, as DeepSpeed's engine in
this project holds them (``megatron_ru/training/engine.py`` builds the config; torch AdamW or SGD
is the base optimizer). Which DeepSpeed wrapper runs decides the bytes:

========================  ===========================================================================
precision, ZeRO           wrapper (DeepSpeed 0.19) and what one rank holds at the optimizer step
========================  ===========================================================================
fp32, 0                   none: params 4 N, grads 4 N_t, AdamW moments 8 N_t + a 4-byte step per tensor
fp32/fp16, 1-2            DeepSpeedZeroOptimizer: params e·F (flat groups padded to 2·DP), grads e·(the
                          whole parameters overlapping this rank's partition; stage 2: e·F/DP), fp32
                          master 4·F/DP, moments 8·F/DP + a step per group, a reduce bucket of
                          ``reduce_bucket_size`` elements during backward
bf16, 1                   BF16_Optimizer (fp32 gradient accumulation): params 2·F, grads 2 N_t (bf16
                          ``.grad``) + 4·F (fp32 flat accumulator), master 4·F/DP, moments 8·F/DP + steps
fp16, 0                   FP16_Optimizer: params 2 N, grads 2 N_t + 4 N_t (fp32 flat copy made at the
                          step), master 4 N_t, moments 8 N_t + steps
bf16/fp16, 3 (PP = 1)     ZeRO-3 (approximation): params e·F/DP + the live-parameter budget, grads
                          4·F/DP, master 4·F/DP, moments 8·F/DP
========================  ===========================================================================

``N`` = parameters on the rank, ``N_t`` = trainable ones, ``F`` = trainable parameters flattened
per optimizer group (decay: matrices; no decay: vectors) and padded to a multiple of 2·DP, ``e``
= bytes per element of the training precision. bf16 at ZeRO 0 is refused by DeepSpeed when
gradients accumulate in fp32 (as ours do), so the planner never proposes it. Sources and checks:
docs/planner.md (the bytes are compared with the engine's tensors in
tests/integration/test_plan_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ru.plan.layout import Layout
from megatron_ru.plan.params import TensorInfo
from megatron_ru.utils.optim import weight_decay_groups

#: DeepSpeed's defaults for the settings our generated config leaves alone (elements)
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_ALLGATHER_BUCKET = 500_000_000
#: ZeRO-3 defaults (elements): parameters gathered at once and prefetched
DEFAULT_STAGE3_MAX_LIVE = 1_000_000_000
DEFAULT_STAGE3_PREFETCH = 50_000_000
NCCL_START_ALIGNMENT = 2  # DeepSpeed pads each flat group to a multiple of 2 x DP elements


@dataclass(frozen=True)
class BucketSizes:
    """DeepSpeed's communication buckets (elements), from the ds config when given."""
    reduce_bucket: int = DEFAULT_REDUCE_BUCKET
    allgather_bucket: int = DEFAULT_ALLGATHER_BUCKET
    overlap_comm: bool = False
    contiguous_gradients: bool = True

    @classmethod
    def from_ds_config(cls, ds: dict) -> "BucketSizes":
        zero = ds.get("zero_optimization", {}) or {}
        stage = zero.get("stage", 0)
        return cls(int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)),
                   int(zero.get("allgather_bucket_size", DEFAULT_ALLGATHER_BUCKET)),
                   bool(zero.get("overlap_comm", stage == 3)), bool(zero.get("contiguous_gradients", True)))


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank; ``optimizer`` = ``master`` + ``moments``. ``gradients`` is what is held at the
    optimizer step (what tests/integration/test_plan_memory.py compares with the engine's tensors),
    ``grads_backward`` what is held while the backward runs (next to the activations) and
    ``step_transient`` what the step allocates on top (flattened / fp32-cast partition gradients)."""
    wrapper: str
    parameters: int
    gradients: int
    master: int
    moments: int
    buckets: int
    grads_backward: int = 0
    step_transient: int = 0

    @property
    def optimizer(self) -> int:
        return self.master + self.moments


def wrapper_name(precision: str, zero_stage: int) -> str:
    """The DeepSpeed optimizer wrapper that runs (see the module docstring)."""
    if zero_stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if zero_stage == 0:
        return {"fp32": "none", "fp16": "FP16_Optimizer", "bf16": "BF16_Optimizer"}[precision]
    if precision == "bf16" and zero_stage == 1:
        return "BF16_Optimizer"
    return "DeepSpeedZeroOptimizer"


def optimizer_groups(tensors: list[TensorInfo]) -> list[list[TensorInfo]]:
    """The optimizer's parameter groups (megatron_ru.training.engine.optimizer_param_groups): trainable
    matrices (weight decay), then trainable vectors; empty groups dropped."""
    return [g for _, g in weight_decay_groups([t for t in tensors if t.trainable], lambda t: t.ndim >= 2)]


def padded_flat_size(n: int, dp: int) -> int:
    """Elements of a flat group of ``n`` after DeepSpeed's padding to a multiple of 2 x DP."""
    align = NCCL_START_ALIGNMENT * dp
    return -(-n // align) * align


def _overlapping(group: list[TensorInfo], dp: int, dp_rank: int) -> int:
    """Elements of the whole parameters that overlap data-parallel rank ``dp_rank``'s partition of the
    flat group (DeepSpeed's ``params_in_partition``; ZeRO 1 keeps their full gradients)."""
    part = padded_flat_size(sum(t.numel for t in group), dp) // dp
    lo, hi = dp_rank * part, (dp_rank + 1) * part
    out, start = 0, 0
    for t in group:
        stop = start + t.numel
        if start < hi and stop > lo:
            out += t.numel
        start = stop
    return out


def _resident_bucket(buckets: BucketSizes, n_train: int, device: str) -> int:
    """Elements of ZeRO's reduce bucket that are resident: all of it on CUDA (the caching allocator holds what
    DeepSpeed allocates), on a CPU only the part the gradients copied into it touch."""
    return buckets.reduce_bucket if device == "cuda" else min(buckets.reduce_bucket, n_train)


def state_bytes(tensors: list[TensorInfo], layout: Layout, optimizer: str = "adam",
                buckets: BucketSizes = BucketSizes(), dp_rank: int = 0, device: str = "cuda") -> StateBytes:
    """What one rank (data-parallel rank ``dp_rank``) of a stage holding ``tensors`` keeps. On a CPU only
    the touched part of the reduce bucket is resident (the gradients copied into it); CUDA's caching
    allocator holds all of it."""
    dp, zero, prec = layout.data_axis, layout.zero_stage, layout.precision  # ZeRO partitions over DP x CP
    e = layout.param_bytes
    n_all = sum(t.numel for t in tensors)
    n_frozen = sum(t.numel for t in tensors if not t.trainable)
    groups = optimizer_groups(tensors)
    n_train = sum(t.numel for g in groups for t in g)
    flat = sum(padded_flat_size(sum(t.numel for t in g), dp) for g in groups)
    part = flat // dp
    moment_words = 2 if optimizer == "adam" else 1  # AdamW: exp_avg, exp_avg_sq; SGD: momentum buffer
    step_bytes = 4 if optimizer == "adam" else 0     # AdamW keeps a float32 step per tensor it updates
    wrapper = wrapper_name(prec, zero)
    if wrapper == "none":
        n_tensors = sum(len(g) for g in groups)
        return StateBytes(wrapper, 4 * n_all, 4 * n_train, 0, 4 * moment_words * n_train + step_bytes * n_tensors, 0,
                          grads_backward=4 * n_train)
    if wrapper == "FP16_Optimizer":
        # the step casts every .grad to fp32 (a list of copies) and flattens them into the masters' .grad
        return StateBytes(wrapper, e * n_all, (e + 4) * n_train, 4 * n_train,
                          4 * moment_words * n_train + step_bytes * len(groups), 0, grads_backward=e * n_train,
                          step_transient=4 * n_train)
    master = 4 * part
    moments = 4 * moment_words * part + step_bytes * len(groups)
    if wrapper == "BF16_Optimizer":
        if zero == 0:  # not runnable with fp32 accumulation (see module docstring); unpartitioned
            master, moments = 4 * flat, 4 * moment_words * flat + step_bytes * len(groups)
        grads = e * n_train + 4 * flat
        return StateBytes(wrapper, e * (flat + n_frozen), grads, master, moments, 0, grads_backward=grads)
    if wrapper == "DeepSpeedZeroOptimizer":
        if zero == 1:
            grads = e * sum(_overlapping(g, dp, dp_rank) for g in groups)
        else:
            grads = 4 * part if prec == "bf16" else e * part
        bucket_bytes = 4 if (prec == "bf16" and zero == 1) else e
        nbuf = 2 if buckets.overlap_comm and layout.pp == 1 else 1
        bucket = nbuf * _resident_bucket(buckets, n_train, device) * bucket_bytes if buckets.contiguous_gradients else 0
        # backward: every trainable parameter's .grad (ZeRO 1) or the owned partition (ZeRO 2); the step
        # flattens the partition's gradients and casts them to fp32 for the update
        backward = e * n_train if zero == 1 else grads
        transient = e * part + (4 * part if e != 4 else 0)
        return StateBytes(wrapper, e * (flat + n_frozen), grads, master, moments, bucket,
                          grads_backward=backward, step_transient=transient)
    # ZeRO-3: parameters partitioned; up to the live-parameter budget gathered at once; the reduce bucket as above
    live = min(DEFAULT_STAGE3_MAX_LIVE, n_all) + DEFAULT_STAGE3_PREFETCH
    return StateBytes(wrapper, e * (flat // dp + n_frozen), 4 * part, master, moments,
                      e * min(live, n_all) + e * _resident_bucket(buckets, n_train, device), grads_backward=4 * part,
                      step_transient=e * part)
