"""Parallel core: rank discovery (env), process groups (state), pure grid math (topology)."""
from megatron_ru.parallel.topology import ParallelLayout, RankCoord, layout_problems

__all__ = ["ParallelLayout", "RankCoord", "layout_problems"]
