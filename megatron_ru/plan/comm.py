"""Analytic communication volume of one training step, per rank, per parallel dimension.

Every collective and point-to-point message our model, our loop and DeepSpeed 0.19 issue in one
iteration is listed as a :class:`CommOp` (kind, group size, payload, count, dimension) for each
pipeline stage; ``benchmarks/comm_audit.py`` checks the list against the ops counted by
:mod:`megatron_ru.parallel.comm_audit` at several layouts (ratio 1.00). Formulas and byte
conventions: docs/comm_audit.md.

Bytes are "wire bytes" (what one rank sends or receives through its link, nccl-tests' bus bytes):
all-reduce ``2(n-1)/n`` x payload, all-gather / reduce-scatter ``(n-1)/n`` x the full buffer,
broadcast / reduce / send / recv the payload (send and recv both counted, on their own rank).
``payload`` is the buffer size itself.

Modelled exactly (audited on CPU in fp32 and bf16; BENCHMARKS.md): TP with and without sequence
parallelism, full recomputation, PP (DeepSpeed's 1F1B with its TP-partitioned activations and
gradients), DP at ZeRO 0-3 (DeepSpeed's ZeRO optimizers; its BF16_Optimizer at ZeRO 1 in bf16),
tied embeddings, the small per-step terms (loss averaging for the log, gradient-norm and overflow
all-reduces, the loss broadcast of the pipeline). Not audited: fp16 (GPU only; modelled like bf16
through DeepSpeed's ZeRO optimizer) and ZeRO 3's backward re-gather of models beyond
``stage3_max_reuse_distance`` (DeepSpeed's documented behaviour).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import spec as model_spec
from megatron_ru.model.shards import padded_vocab_rows
from megatron_ru.parallel.comm_audit import wire_bytes  # the one byte convention
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.params import stage_tensors
from megatron_ru.plan.states import optimizer_groups, padded_flat_size

#: keys of :func:`step_comm_bytes` (the planner's dimensions); ``mp`` = the TP x PP group; ``dp`` is DeepSpeed's
#: data axis (DP x CP: the ranks holding the same weights); ``cp`` the attention's exchange within a sample
DIMENSIONS = ("tp", "pp", "dp", "mp", "cp")

_FP32 = 4
_INT64 = 8
#: the int64 meta tensor DeepSpeed sends before each TP-partitioned activation/gradient:
#: [ndim, *shape(3), num_parts, rank, *partition offsets (tp + 1)]
_PARTITION_META = lambda tp: (1 + 3 + 2 + tp + 1) * _INT64  # noqa: E731


@dataclass(frozen=True)
class CommOp:
    """``count`` ops of one kind and size at one rank per step."""
    name: str
    dim: str
    kind: str
    group_size: int
    payload: int
    count: int

    @property
    def bytes(self) -> int:
        return self.count * wire_bytes(self.kind, self.payload, self.group_size)

    @property
    def payload_bytes(self) -> int:
        return self.count * self.payload


@dataclass(frozen=True)
class _Stage:
    layers: int
    embedding: bool
    output: bool
    final_norm: bool
    tied_copy: bool         # the last stage's copy of tied word embeddings (PP > 1)
    groups: tuple[int, ...]  # padded flat sizes of the optimizer's parameter groups (decay, no decay)
    trainable: int
    params: tuple[int, ...]  # elements of each parameter (this rank's TP shard)


def _stages(cfg: ModelConfig, vocab_size: int, layout: Layout) -> list[_Stage]:
    """What each pipeline stage holds: :func:`megatron_ru.plan.params.stage_tensors`' tensors and the
    optimizer's flat groups of the trainable ones (:func:`megatron_ru.plan.states.optimizer_groups`)."""
    tp, pp, dp = layout.tp, layout.pp, layout.data_axis
    descs = model_spec.model_description(cfg)
    bounds = model_spec.stage_bounds(cfg, pp) if pp > 1 else [(0, len(descs))]
    out = []
    for (start, stop), tensors in zip(bounds, stage_tensors(cfg, vocab_size, tp, pp)):
        groups = tuple(padded_flat_size(sum(t.numel for t in g), dp) for g in optimizer_groups(tensors))
        kinds = [descs[j].kind for j in range(start, stop)]
        tied_copy = start > 0 and any(descs[j].tied_output for j in range(start, stop))
        out.append(_Stage(layers=kinds.count("transformer"), embedding="embedding" in kinds,
                          output="output" in kinds, final_norm="final_norm" in kinds, tied_copy=tied_copy,
                          groups=groups, trainable=sum(t.numel for t in tensors if t.trainable),
                          params=tuple(t.numel for t in tensors)))
    return out


def _dim(group: str, layout: Layout) -> str:
    """The audit's dimension of an op in ``group`` (a group whose ranks equal another's is named as
    the audit names it: TP first, then DP, PP, the model-parallel group)."""
    sizes = {"tp": layout.tp, "dp": layout.data_axis, "pp": layout.pp, "mp": layout.tp * layout.pp, "cp": layout.cp}
    if sizes[group] <= 1:
        return "local"
    if group == "mp":
        if layout.pp == 1:
            return "tp"
        if layout.tp == 1:
            return "pp"
    return group


#: DeepSpeed's ZeRO-3 defaults: parameters under this many elements stay gathered (persistent), and
#: a gathered parameter is kept for reuse within this many elements of later fetches
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000


class _Ops:
    """The ops of one rank, as they are added: ops in one-rank groups, and none-sized ones, left out."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.ops: list[CommOp] = []

    def add(self, name: str, group: str, kind: str, payload: int, count: int) -> None:
        lay = self.layout
        dim = _dim(group, lay)
        n = {"tp": lay.tp, "dp": lay.data_axis, "pp": lay.pp, "mp": lay.tp * lay.pp, "cp": lay.cp}[group]
        if dim != "local" and count > 0 and (payload > 0 or kind == "barrier"):
            self.ops.append(CommOp(name, dim, kind, 2 if kind in ("send", "recv") else n, payload, count))


def _activation_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """One [s, b, h] activation in the model's dtype (s: this rank's tokens of the sample)."""
    return layout.rank_tokens * layout.micro_batch * cfg.hidden_size * layout.param_bytes


def _tp_ops(out: _Ops, cfg: ModelConfig, layout: Layout, st: _Stage) -> None:
    """Tensor parallelism: activations of every micro batch."""
    t, m = layout.tp, layout.num_micro_batches
    if t == 1:
        return
    add, full, h, act = out.add, _activation_bytes(cfg, layout), cfg.hidden_size, layout.param_bytes
    rc = 1 if layout.recompute == "full" else 0
    # Recomputation replays a layer's forward in backward only up to its last saved tensor (torch's
    # non-reentrant checkpoint stops early): the MLP output's reduction is not replayed.
    if not layout.sequence_parallel:
        add("tp.layers", "tp", "all_reduce", full, m * st.layers * 4)          # forward 2, backward 2
        add("tp.layers.recompute", "tp", "all_reduce", full, m * st.layers * rc)
        add("tp.embedding", "tp", "all_reduce", full, m * st.embedding)
        add("tp.output_head", "tp", "all_reduce", full, m * st.output)
    else:
        add("sp.layers.all_gather", "tp", "all_gather", full, m * st.layers * 4)
        add("sp.layers.reduce_scatter", "tp", "reduce_scatter", full, m * st.layers * 4)
        add("sp.layers.recompute.all_gather", "tp", "all_gather", full, m * st.layers * 2 * rc)
        add("sp.layers.recompute.reduce_scatter", "tp", "reduce_scatter", full, m * st.layers * rc)
        add("sp.embedding.all_reduce", "tp", "all_reduce", full, m * st.embedding)
        add("sp.embedding.all_gather", "tp", "all_gather", full, m * st.embedding)
        add("sp.output_head.all_gather", "tp", "all_gather", full, m * st.output)
        add("sp.output_head.reduce_scatter", "tp", "reduce_scatter", full, m * st.output)
        norm = h * (2 if cfg.normalization == "LayerNorm" else 1) * act
        norms = 2 * st.layers + st.final_norm
        add("sp.norm_grads", "tp", "all_reduce", norm, m * norms)
        if cfg.add_bias_linear:
            add("sp.row_bias_grads", "tp", "all_reduce", h * act, m * 2 * st.layers)
    if st.output:
        add("tp.cross_entropy", "tp", "all_reduce", layout.rank_tokens * layout.micro_batch * _FP32, 3 * m)


def _pp_ops(out: _Ops, cfg: ModelConfig, vocab_size: int, layout: Layout, stage: int, extra_losses: int) -> None:
    """Pipeline parallelism: activations forward, gradients backward, per micro batch."""
    t, p, m = layout.tp, layout.pp, layout.num_micro_batches
    if p == 1:
        return
    first, last = stage == 0, stage == p - 1
    add, full = out.add, _activation_bytes(cfg, layout)
    sp = layout.sequence_parallel and t > 1
    partitioned = t > 1 and not sp                  # DeepSpeed splits them over TP (pipe_partitioned)
    boundary = full // t if (partitioned or sp) else full
    meta = _PARTITION_META(t) if partitioned else 0
    for direction, active in (("next", not last), ("prev", not first)):
        if not active:
            continue
        for kind in ("send", "recv"):
            add(f"pp.{'activations' if (kind == 'send') == (direction == 'next') else 'gradients'}.{kind}",
                "pp", kind, boundary, m)
            if meta:
                add(f"pp.partition_meta.{kind}", "pp", kind, meta, m)
    if layout.cp > 1:
        # a CP rank's tokens are two chunks of the sample, not a contiguous run: their positions (int64
        # [b, s/CP]) travel with the activations (megatron_ru/model/gpt.py, pipeline_carry), no gradient back
        ids = layout.micro_batch * layout.rank_tokens * 8
        if not last:
            add("pp.positions.send", "pp", "send", ids, m)
        if not first:
            add("pp.positions.recv", "pp", "recv", ids, m)
    if partitioned:
        # the receiving stage rebuilds the activation; the sending stage rebuilds its output and
        # the received gradient before its backward (PartitionedTensor.full: all-gather over TP)
        add("pp.partition_gather.input", "tp", "all_gather", full, m * (not first))
        add("pp.partition_gather.backward", "tp", "all_gather", full, 2 * m * (not last))
    add("pp.loss_broadcast", "pp", "broadcast", (2 + extra_losses) * _FP32, 1)
    if cfg.tied_embeddings and (first or last):
        rows = padded_vocab_rows(cfg, vocab_size, t)
        out.ops.append(CommOp("pp.tied_embedding_grad", "pp", "all_reduce", 2, rows // t * cfg.hidden_size * _FP32, 1))


def _cp_ops(out: _Ops, cfg: ModelConfig, layout: Layout, st: _Stage) -> None:
    """Context parallelism, per layer and micro batch (megatron_ru/parallel/context.py). Ring: the forward passes
    this rank's key/value block on CP - 1 times; the backward passes it on again CP - 1 times and its fp32
    gradient CP times (home after a full turn). All-to-all: q, k, v (key/value groups repeated up to CP) and the
    output, forward and backward. Full recomputation replays the forward."""
    c, m = layout.cp, layout.num_micro_batches
    if c == 1 or st.layers == 0:
        return
    t, e = layout.tp, layout.param_bytes
    T = layout.rank_tokens * layout.micro_batch
    qw, kw = cfg.num_attention_heads * cfg.head_dim // t, cfg.query_groups * cfg.head_dim // t
    forwards = 2 if layout.recompute == "full" else 1
    n = m * st.layers
    if layout.cp_comm == "p2p":
        block = 2 * T * kw
        for kind in ("send", "recv"):
            out.add(f"cp.ring.kv.{kind}", "cp", kind, block * e, n * (c - 1) * (forwards + 1))
            out.add(f"cp.ring.grads.{kind}", "cp", kind, block * _FP32, n * c)
    else:
        groups = max(kw, cfg.head_dim * c) if cfg.query_groups // t < c else kw  # repeated up to CP groups
        payload = T * (2 * qw + 2 * groups) * e                                   # q, k, v, output
        out.add("cp.all_to_all", "cp", "all_to_all", payload, n * (forwards + 1))


def _dp_ops(out: _Ops, layout: Layout, st: _Stage, stage: int, extra_losses: int,
            zero3_persistence_threshold: int, zero3_max_reuse_distance: int) -> None:
    """Data parallelism: gradients, ZeRO's parameter gathers, the loss averaged for the log."""
    d, m, add = layout.data_axis, layout.num_micro_batches, out.add
    bf16_optimizer = layout.precision == "bf16" and layout.zero_stage == 1  # DeepSpeed's BF16_Optimizer
    elem = layout.param_bytes  # gradients are sent in the model's dtype (DeepSpeed's communication_data_type)
    if layout.zero_stage == 0:
        # fp32: the gradients themselves; bf16 and fp16 are refused by DeepSpeed at ZeRO 0 without a pipeline
        add("dp.grads", "dp", "all_reduce", st.trainable * elem, 1)
    elif bf16_optimizer:
        # fp32 gradient buffers (flat groups padded to 2 x DP), sent in bf16 (communication_data_type),
        # then each flat bf16 parameter group all-gathered after the step
        add("dp.grads", "dp", "all_reduce", sum(st.groups) * 2, 1)
        for i, numel in enumerate(st.groups):
            add(f"dp.params.group{i}", "dp", "all_gather", numel * 2, 1)
    elif layout.zero_stage in (1, 2):
        # DeepSpeed 0.19's ZeRO optimizer: an all-reduce of the whole gradient (allreduce_and_scatter; each
        # rank keeps its partition) at the accumulation boundary (ZeRO 1) or after every micro batch's
        # backward (ZeRO 2); after the step an all-gather of each flat parameter group
        add("dp.grads", "dp", "all_reduce", st.trainable * elem, 1 if layout.zero_stage == 1 else m)
        for i, numel in enumerate(st.groups):
            add(f"dp.params.group{i}", "dp", "all_gather", numel * elem, 1)
    else:
        # ZeRO 3: each parameter partitioned on its own (padded to a multiple of DP); small ones stay
        # gathered (persistent, re-gathered once after the step); the others are gathered for each micro
        # batch's forward and kept for its backward while within the reuse distance
        padded = [-(-n // d) * d for n in st.params]
        gathered = sum(n for n in padded if n >= zero3_persistence_threshold)
        persistent = sum(padded) - gathered
        add("dp.params.forward", "dp", "all_gather", gathered * elem, m)
        add("dp.params.backward", "dp", "all_gather", max(0, gathered - zero3_max_reuse_distance) * elem, m)
        add("dp.params.persistent", "dp", "all_gather", persistent * elem, 1)
        add("dp.grads", "dp", "reduce_scatter", sum(padded) * elem, m)
    if layout.pp == 1:
        add("dp.loss_mean", "dp", "all_reduce", 8, 1)    # the loop's float64 mean loss for the log
    elif stage == layout.pp - 1:
        add("dp.loss_mean", "dp", "all_reduce", _FP32 * (1 + extra_losses), 1)  # DeepSpeed's agg_loss


def _norm_ops(out: _Ops, layout: Layout, st: _Stage, clip_grad: bool) -> None:
    """The gradient norm for clipping and the overflow check."""
    add, groups = out.add, len(st.groups)
    if layout.zero_stage == 0 and layout.precision == "fp32":
        if clip_grad:
            add("grad_norm", "mp", "all_reduce", 8, 1)  # ours: float64 over TP x PP
    elif layout.precision == "bf16" and layout.zero_stage == 1:
        add("grad_norm", "mp", "all_reduce", _FP32, 1)  # BF16_Optimizer's get_global_norm_of_tensors: TP x PP
    else:
        # DeepSpeed's get_grad_norm_direct, once per parameter group: DP then model-parallel group
        norm = 8 if layout.zero_stage == 3 else _FP32
        add("grad_norm.dp", "dp", "all_reduce", norm, groups)
        add("grad_norm.mp", "mp", "all_reduce", norm, groups)
        if layout.zero_stage in (1, 2) and layout.precision != "fp32":
            add("overflow.dp", "dp", "all_reduce", 1, 1)  # has_overflow: a uint8 over DP, then TP x PP
            add("overflow.mp", "mp", "all_reduce", 1, 1)


def stage_comm_ops(cfg: ModelConfig, vocab_size: int, layout: Layout, stage: int,
                   *, clip_grad: bool = True, extra_losses: int = 0,
                   zero3_persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD,
                   zero3_max_reuse_distance: int = ZERO3_MAX_REUSE_DISTANCE) -> list[CommOp]:
    """Every op one rank of pipeline stage ``stage`` issues in one training step (ops in one-rank
    groups left out). ``clip_grad``: --clip-grad > 0 (our fp32 ZeRO-0 clipping all-reduces the norm).
    ``zero3_*``: DeepSpeed's ``stage3_param_persistence_threshold`` and ``stage3_max_reuse_distance``."""
    if layout.global_batch % (layout.micro_batch * layout.dp):
        raise ValueError(f"global batch {layout.global_batch} is not a multiple of micro batch x DP "
                         f"({layout.micro_batch} x {layout.dp})")
    st = _stages(cfg, vocab_size, layout)[stage]
    out = _Ops(layout)
    _tp_ops(out, cfg, layout, st)
    _pp_ops(out, cfg, vocab_size, layout, stage, extra_losses)
    _cp_ops(out, cfg, layout, st)
    _dp_ops(out, layout, st, stage, extra_losses, zero3_persistence_threshold, zero3_max_reuse_distance)
    _norm_ops(out, layout, st, clip_grad)
    return out.ops


def rank_comm_bytes(cfg: ModelConfig, vocab_size: int, layout: Layout, stage: int, **kw: int) -> dict[str, int]:
    """Wire bytes per dimension of one rank of ``stage`` in one step."""
    out: dict[str, int] = defaultdict(int)
    for op in stage_comm_ops(cfg, vocab_size, layout, stage, **kw):
        out[op.dim] += op.bytes
    return {k: out.get(k, 0) for k in DIMENSIONS}


def step_comm_bytes(cfg: ModelConfig, vocab_size: int, layout: Layout) -> dict[str, int]:
    """Wire bytes per step of the busiest rank of each parallel dimension (the maximum over the
    pipeline stages, taken per dimension): keys ``tp``, ``pp``, ``dp`` and ``mp`` (the small
    gradient-norm all-reduce over TP x PP). Divide by a link's bandwidth for the time on it."""
    per_stage = [rank_comm_bytes(cfg, vocab_size, layout, k) for k in range(layout.pp)]
    return {k: max(r[k] for r in per_stage) for k in DIMENSIONS}


def step_comm_terms(cfg: ModelConfig, vocab_size: int, layout: Layout,
                    stage: Optional[int] = None) -> dict[str, int]:
    """Wire bytes per named term (``tp.layers``, ``dp.grads``, ...) of one rank of ``stage``; without a
    stage, each term's value on the stage where it is largest."""
    stages = range(layout.pp) if stage is None else [stage]
    out: dict[str, int] = {}
    for k in stages:
        for op in stage_comm_ops(cfg, vocab_size, layout, k):
            out[op.name] = max(out.get(op.name, 0), op.bytes)
    return out


def compare_with_audit(records: list[dict], cfg: ModelConfig, vocab_size: int, layout: Layout,
                       **kw: int) -> list[dict]:
    """Counted (:class:`~megatron_ru.parallel.comm_audit.CommAudit` records of one iteration, one per
    rank, rank order) against :func:`stage_comm_ops` for each rank's stage: one row per rank and
    dimension with ``counted``, ``analytic`` (wire bytes) and the same for payload bytes."""
    rows = []
    per_stage = [stage_comm_ops(cfg, vocab_size, layout, k, **kw) for k in range(layout.pp)]
    for rank, rec in enumerate(records):
        stage = rank // (layout.tp * layout.data_axis)  # rank order tp-cp-dp-pp
        wire: dict[str, int] = defaultdict(int)
        payload: dict[str, int] = defaultdict(int)
        for op in per_stage[stage]:
            wire[op.dim] += op.bytes
            payload[op.dim] += op.payload_bytes
        for dim in sorted(set(wire) | set(rec["dims"])):
            rows.append({"rank": rank, "stage": stage, "dim": dim, "counted": rec["dims"].get(dim, 0),
                         "analytic": wire.get(dim, 0), "counted_payload": rec["payload"].get(dim, 0),
                         "analytic_payload": payload.get(dim, 0)})
    return rows
