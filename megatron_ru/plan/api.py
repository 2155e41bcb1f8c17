"""The planner for one run's own arguments: what ``pretrain_gpt.py`` logs at start-up next to the
measured peak (``predict_for_arguments``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_ru.plan.layout import Layout
from megatron_ru.plan.memory import MemoryPrediction, predict_memory
from megatron_ru.plan.states import BucketSizes

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments


def layout_for_arguments(args: "Arguments", world_size: Optional[int] = None) -> Layout:
    """The :class:`Layout` a parsed command line runs with on ``world_size`` ranks (default: its own grid,
    ``args.layout``), laid on that grid (a world size TP x PP does not divide is its ValueError)."""
    from megatron_ru.parallel.topology import ParallelLayout
    grid = getattr(args, "layout", None) if world_size is None else None
    if grid is None:
        grid = ParallelLayout(args.world_size if world_size is None else world_size, args.tp, args.pp, args.cp)
    t = args.training
    global_batch = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * grid.dp
    return Layout.on(grid, micro_batch=t.micro_batch_size, global_batch=global_batch,
                  seq_length=args.data.seq_length, sequence_parallel=args.sequence_parallel,
                  recompute="full" if args.model.recompute else (args.model.recompute_granularity or "none"),
                  recompute_method=args.model.recompute_plan[0] if args.model.recompute else "uniform",
                  recompute_num_layers=args.model.recompute_plan[1] if args.model.recompute else 1,
                  distribute_saved_activations=args.model.distribute_saved_activations, zero_stage=t.zero_stage,
                  precision=args.precision, cp_comm="a2a" if args.parallel.cp_comm_type == "a2a" else "p2p")


def vocab_size_for_arguments(args: "Arguments") -> int:
    """The model's vocabulary rows: the checkpoint's (``--use-checkpoint-args``) or the tokenizer's."""
    if args.model_vocab_size is not None:
        return args.model_vocab_size
    return args.built_tokenizer().vocab_size


def buckets_for_arguments(args: "Arguments") -> BucketSizes:
    """DeepSpeed's bucket sizes from the config the engine will be built with."""
    from megatron_ru.flags.deepspeed import build_ds_config
    return BucketSizes.from_ds_config(build_ds_config(args))


def predict_for_arguments(args: "Arguments", world_size: Optional[int] = None, *, vocab_size: Optional[int] = None,
                          device: Optional[str] = None) -> MemoryPrediction:
    """Predicted peak memory per GPU (per process on CPU) of this run. ``device``: "cuda" adds the
    CUDA context allowance; default: the device the arguments were validated for."""
    vocab = vocab_size if vocab_size is not None else vocab_size_for_arguments(args)
    return predict_memory(args.model, vocab, layout_for_arguments(args, world_size),
                          device=device or args.device_type, optimizer=args.optimizer.optimizer,
                          buckets=buckets_for_arguments(args))
