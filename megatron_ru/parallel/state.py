"""ParallelState: the TP / DP / PP process groups of this rank, built once and passed around.

    denv = init_distributed()                       # megatron_ru.parallel.env
    state = ParallelState.build(tp=2, pp=2)         # every rank, same arguments
    layer = ColumnParallelLinear(..., group=state.tp_group)
    engine, *_ = deepspeed.initialize(model=..., mpu=state, ...)

The object also is DeepSpeed's ``mpu``: the ``get_*`` methods DeepSpeed calls come from the
:class:`~megatron_ru.deepspeed_bridge.compat.DeepSpeedMpu` mixin, which lives with the other
DeepSpeed-specific code (what they mean, and why no ``get_sequence_parallel_*``, is said there).

``python -m megatron_ru.parallel.state --world-size 8 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2`` prints the layout without starting processes.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ru.deepspeed_bridge.compat import DeepSpeedMpu
from megatron_ru.parallel.topology import ParallelLayout, RankCoord, layout_problems
from megatron_ru.utils.logging import get_logger, log_rank0
from megatron_ru.utils import cli

log = get_logger(__name__)

__all__ = ["ParallelState", "ParallelLayout", "RankCoord", "layout_problems"]


class ParallelState(DeepSpeedMpu):
    """Process groups and coordinates of this rank on its :class:`ParallelLayout` (the grid: sizes and rank
    arithmetic come from it, not copies). Build with :meth:`build`."""

    def __init__(self, layout: ParallelLayout, rank: int, groups: dict[str, Any],
                 ranks: dict[str, list[int] | None], device: torch.device,
                 sequence_parallel: bool = False) -> None:
        self.layout = layout
        self.rank = rank
        coord = layout.coord(rank)
        self.coord: RankCoord = coord
        self.tp_rank, self.pp_rank = coord.tp, coord.pp
        cp = layout.cp > 1
        #: the context-parallel rank and group (None at CP 1: the whole sequence on every rank)
        self.cp_rank = coord.cp
        self.cp_group = groups["cp"] if cp else None
        self.cp_ranks: list[int] | None = ranks["cp"] if cp else None
        #: the ranks that read different samples (the sampler's DP; the CP ranks of one sample read the same)
        self.data_rank, self.data_size = coord.dp, layout.dp
        self.data_group = groups["dp"]
        #: DeepSpeed's data-parallel axis: the ranks holding the same weights, over which gradients are reduced
        #: and ZeRO partitions (DP x CP; rank cp + CP x dp): what it reads through the mpu methods
        self.dp_rank = coord.cp + layout.cp * coord.dp
        self.tp_group = groups["tp"]
        self.dp_group = groups["dp_cp"] if cp else groups["dp"]
        self.pp_group = groups["pp"]
        self.mp_group = groups["mp"]
        #: first + last stage of this rank's pipeline; None when PP=1 or this rank is a middle stage
        self.embedding_group = groups["embedding"]
        #: global ranks of each of this rank's groups (embedding: None when not a member)
        self.tp_ranks: list[int] = ranks["tp"]  # type: ignore[assignment]
        self.dp_ranks: list[int] = ranks["dp_cp" if cp else "dp"]  # type: ignore[assignment]
        self.pp_ranks: list[int] = ranks["pp"]  # type: ignore[assignment]
        self.mp_ranks: list[int] = ranks["mp"]  # type: ignore[assignment]
        self.embedding_ranks: list[int] | None = ranks["embedding"]
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        self.device = device
        self.sequence_parallel = sequence_parallel

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        """DeepSpeed's data-parallel size: DP x CP (:attr:`data_size` is DP)."""
        return self.layout.dp * self.layout.cp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @classmethod
    def build(cls, tp: int, pp: int = 1, *, world_size: int | None = None,
              sequence_parallel: bool = False, timeout_minutes: float | None = None,
              device: torch.device | None = None, cp: int = 1) -> "ParallelState":
        """Create every group with ``torch.distributed.new_group`` (collective: all ranks call
        it with the same arguments). Needs an initialised default process group."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelState.build needs torch.distributed initialised first: call "
                               "megatron_ru.parallel.env.init_distributed() before it")
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(f"ParallelState.build(world_size={world_size}) but the process group has "
                             f"WORLD_SIZE={actual}; drop world_size= or launch {world_size} processes")
        layout = ParallelLayout(actual, tp, pp, cp)
        if sequence_parallel and tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 (got 1)")
        rank = dist.get_rank()
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
        groups: dict[str, Any] = {}
        ranks: dict[str, list[int] | None] = {}
        for kind, all_groups in layout.groups():
            groups[kind], ranks[kind] = None, None
            # every rank creates every group in the same order (torch requires it)
            for members in all_groups:
                pg = dist.new_group(ranks=members, timeout=timeout)
                if rank in members:
                    groups[kind], ranks[kind] = pg, list(members)
        if device is None:
            from megatron_ru.parallel.env import default_device
            device = default_device()
        state = cls(layout, rank, groups, ranks, device, sequence_parallel)
        log_rank0(log, f"parallel layout: {layout!r}")
        return state

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, world_size={self.world_size}, tp={self.tp_rank}/"
                f"{self.tp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size})")

    def describe(self) -> dict:
        """This rank's coordinates and group memberships (JSON-able)."""
        return {"rank": self.rank, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank,
                "pp_rank": self.pp_rank, "tp_size": self.tp_size, "dp_size": self.dp_size,
                "pp_size": self.pp_size, "tp_group": self.tp_ranks, "dp_group": self.dp_ranks,
                "pp_group": self.pp_ranks, "mp_group": self.mp_ranks,
                "embedding_group": self.embedding_ranks}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the layout for a world size and TP/PP (or the error); starts no processes."""
    import argparse
    import json

    from megatron_ru.config.base import add_config_arguments, from_namespace
    from megatron_ru.config.parallel import ParallelConfig

    parser = cli.ArgumentParser(prog="python -m megatron_ru.parallel.state",
                                     description="Print the TP/DP/PP process-group layout of a world size.")
    parser.add_argument("--world-size", type=int, required=True, help="number of processes")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_config_arguments(parser, ParallelConfig)
    ns = parser.parse_args(argv)
    cfg = from_namespace(ParallelConfig, ns)
    problems = cfg.problems()
    if cfg.tensor_model_parallel_size >= 1 and cfg.pipeline_model_parallel_size >= 1 and cfg.context_parallel_size >= 1:
        problems += layout_problems(ns.world_size, cfg.tensor_model_parallel_size,
                                    cfg.pipeline_model_parallel_size, cfg.context_parallel_size)
    if problems:
        cli.error("\n       ".join(problems))
        return 2
    layout = ParallelLayout(ns.world_size, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                            cfg.context_parallel_size)
    cli.emit(json.dumps(layout.describe()) if ns.json else layout.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
