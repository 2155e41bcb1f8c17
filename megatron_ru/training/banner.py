"""The start-up banner: what this run is, in a few lines logged once on global rank 0 before the first
iteration: the layout, the parameters (counted from the tensors every rank holds), tokens per step, the
dataset sizes and the planner's memory prediction for the layout.

The parameter counts need one all-gather of three integers per rank (every rank calls
:func:`parameter_counts`); everything else is local.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.parallel.topology import ParallelLayout
from megatron_ru.utils.logging import get_logger, log_rank0

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments
    from megatron_ru.parallel.state import ParallelState

log = get_logger(__name__)


@dataclass(frozen=True)
class ParameterCounts:
    """``total``/``trainable``: the model's parameters once (tensor-parallel shards summed, replicated
    tensors and the pipeline's tied copy once, vocabulary padding included); ``per_rank[s]``: the most
    elements one rank of pipeline stage ``s`` holds (its TP shard of the stage)."""

    total: int
    trainable: int
    per_rank: tuple[int, ...]


def combine_counts(rows: Sequence[Sequence[int]], tp: int, dp: int, pp: int) -> ParameterCounts:
    """``rows[rank] = (held, counted, counted trainable)``: elements the rank holds, and those it counts
    for the model once (:func:`megatron_ru.training.engine._counts_here`). Data-parallel replicas are the
    same model: only DP rank 0 is summed."""
    grid = ParallelLayout(tp * dp * pp, tp, pp)  # Megatron's rank order: TP fastest, then DP, then PP
    total = trainable = 0
    per_rank = [0] * pp
    for rank, (held, counted, counted_trainable) in enumerate(rows):
        coord = grid.coord(rank)
        per_rank[coord.pp] = max(per_rank[coord.pp], int(held))
        if coord.dp == 0:
            total += int(counted)
            trainable += int(counted_trainable)
    return ParameterCounts(total, trainable, tuple(per_rank))


def parameter_counts(model: torch.nn.Module, state: "ParallelState") -> ParameterCounts:
    """Counts of the model as built on every rank (a collective: every rank calls it)."""
    from megatron_ru.training.engine import _counts_here
    held = counted = counted_trainable = 0
    for p in model.parameters():
        held += p.numel()
        if _counts_here(p, state.tp_rank):
            counted += p.numel()
            counted_trainable += p.numel() if p.requires_grad else 0
    mine = torch.tensor([held, counted, counted_trainable], dtype=torch.int64, device=state.device)
    if dist.is_initialized() and state.world_size > 1:
        rows = [torch.zeros_like(mine) for _ in range(state.world_size)]
        dist.all_gather(rows, mine)
    else:
        rows = [mine]
    return combine_counts([r.tolist() for r in rows], state.tp_size, state.dp_size, state.pp_size)


def _n(x: int) -> str:
    """1,234,567 (1.23M)."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= div:
            return f"{x:,} ({x / div:.2f}{suffix})"
    return f"{x:,}"


def memory_prediction(args: "Arguments", vocab_size: int) -> Optional[Any]:
    """The planner's prediction for this run's layout (``megatron_ru.plan.predict_for_arguments``: peak bytes
    of one GPU on the busiest pipeline stage, by term), or None where the planner cannot say (its reason is
    logged: a start-up banner must not stop a run)."""
    try:
        from megatron_ru.plan import predict_for_arguments
    except ImportError:
        return None
    try:
        return predict_for_arguments(args, args.layout.world_size, vocab_size=vocab_size)
    except Exception as e:  # noqa: BLE001 - the banner reports, it does not decide
        log_rank0(log, f"no memory prediction for this run: {type(e).__name__}: {e}")
        return None


def banner_lines(args: "Arguments", counts: ParameterCounts, dataset_sizes: Sequence[Optional[int]],
                 prediction: Optional[Any] = None) -> list[str]:
    """The banner, one string per line."""
    t, m = args.training, args.model
    seq = args.data.seq_length
    tokens_per_step = args.global_batch_size * seq
    ramp = args.batch_ramp
    samples = args.train_iters * args.global_batch_size if ramp is None else ramp.consumed_after(args.train_iters)
    method, n = m.recompute_plan
    recompute = (f"full ({method}, {n} layer{'s' if n != 1 else ''}"
                 f"{', inputs split over TP' if m.distribute_saved_activations else ''})" if m.recompute else
                 "selective (core attention)" if m.recompute_granularity == "selective" else "none")
    cp_comm = {"a2a": "all-to-all"}.get(args.parallel.cp_comm_type, "ring")
    lines = [
        f"layout: TP {args.tp} x {f'CP {args.cp} ({cp_comm}) x ' if args.cp > 1 else ''}PP {args.pp} x DP {args.dp} = "
        f"{args.layout.world_size} ranks | micro batch "
        f"{t.micro_batch_size} x gradient accumulation {args.grad_accum} x DP {args.dp} = global batch "
        f"{args.global_batch_size} | ZeRO {t.zero_stage} | {args.precision} | sequence parallel "
        f"{'on' if args.sequence_parallel else 'off'} | recomputation {recompute}",
        f"parameters: {_n(counts.total)} total, {_n(counts.trainable)} trainable | per rank: "
        + ", ".join(f"stage {s} {_n(n)}" for s, n in enumerate(counts.per_rank)),
        f"tokens per step: {tokens_per_step:,} (global batch {args.global_batch_size} x sequence {seq}) | "
        f"training: {args.train_iters:,} iterations = {samples:,} samples = {samples * seq:,} tokens",
        "datasets (samples): " + ", ".join(f"{name} {'none' if n is None else f'{n:,}'}"
                                           for name, n in zip(("train", "valid", "test"), dataset_sizes)),
    ]
    if ramp is not None:
        lines.append(f"batch size ramp-up (--rampup-batch-size): {ramp.describe()}")
    lines.append(f"memory (planner): {'not available' if prediction is None else prediction.summary()}")
    if args.logging.wandb_requested:
        from megatron_ru.training.wandb_writer import wandb_project
        project, source = wandb_project(args.logging.wandb_project)
        lines.append(f"Weights & Biases: project {project} ({source})"
                     + (f", run {args.logging.wandb_exp_name}" if args.logging.wandb_exp_name else "")
                     + (f", id {args.logging.wandb_id}" if args.logging.wandb_id else ""))
    return lines


def log_banner(args: "Arguments", model: torch.nn.Module, state: "ParallelState",
               datasets: Sequence[Optional[Any]], vocab_size: int) -> Optional[Any]:
    """Count (a collective), predict and log the banner on global rank 0; returns the prediction.
    ``vocab_size``: the model's vocabulary rows (before padding)."""
    counts = parameter_counts(model, state)
    prediction = memory_prediction(args, vocab_size)
    sizes = [None if ds is None else len(ds) for ds in datasets]
    for line in banner_lines(args, counts, sizes, prediction):
        log_rank0(log, line)
    for notice in args.notices:
        log_rank0(log, notice, level=30)
    if args.megatron_spellings:
        log_rank0(log, f"Megatron flags mapped onto megatron_ru's (docs/megatron_flags.md): "
                       f"{' '.join(args.megatron_spellings)}", level=10)
    if args.megatron_no_effect:
        log_rank0(log, f"Megatron flags accepted without effect here (docs/megatron_flags.md): "
                       f"{' '.join(args.megatron_no_effect)}", level=10)
    return prediction
