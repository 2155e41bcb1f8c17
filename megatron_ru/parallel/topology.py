"""Pure grid math for the TP × CP × DP × PP layout (no processes, no torch.distributed).

Rank order is Megatron's (tp-cp-dp-pp): the tensor-parallel rank varies fastest, then the
context-parallel rank, then the data-parallel rank, then the pipeline stage::

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)),   DP = WORLD / (TP x CP x PP)

8 ranks, TP=2, PP=2 (so DP=2)::

    TP groups [0,1] [2,3] [4,5] [6,7]    DP groups [0,2] [1,3] [4,6] [5,7]
    PP groups [0,4] [1,5] [2,6] [3,7]    model-parallel (TP×PP) groups [0,1,4,5] [2,3,6,7]

This is the order of DeepSpeed's ``PipeModelDataParallelTopology(num_pp=PP, num_mp=TP,
num_dp=DP)`` (axes pipe, data, model; the last axis varies fastest), so DeepSpeed's pipeline
engine and our groups agree (``tests/unit/test_state_topology.py`` checks it). With context
parallelism DeepSpeed's data axis is DP x CP (the CP rank varying fastest within it): its
data-parallel groups are our ``dp_cp`` groups, the ranks over which gradients are reduced
(the CP ranks of one sample hold the same weights and different tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class RankCoord:
    """Where one global rank sits in the grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_pairs(world_size: int) -> list[tuple[int, int]]:
    """Every (TP, PP) whose product divides ``world_size``."""
    return [(tp, pp) for tp in divisors(world_size) for pp in divisors(world_size // tp)]


def nearby_world_sizes(world_size: int, tp: int, pp: int, count: int = 2) -> list[int]:
    """The multiples of TP×PP closest to ``world_size`` (one below if any, then above)."""
    mp = tp * pp
    below = (world_size // mp) * mp
    above = below + mp
    out = [below] if below >= mp else []
    while len(out) < count:
        out.append(above)
        above += mp
    return out


def layout_problems(world_size: int, tp: int, pp: int, cp: int = 1) -> list[str]:
    """Why (world_size, TP, PP[, CP]) is not a valid layout; empty when it is."""
    problems = []
    for name, flag, value in (("TP", "--tensor-model-parallel-size", tp),
                              ("PP", "--pipeline-model-parallel-size", pp),
                              ("CP", "--context-parallel-size", cp)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1 (set {flag})")
    if not isinstance(world_size, int) or world_size < 1:
        problems.append(f"WORLD_SIZE={world_size!r} must be an integer >= 1 (the number of processes "
                        "the launcher started)")
    if problems:
        return problems
    if cp > 1 and world_size % (tp * cp * pp):
        problems.append(
            f"WORLD_SIZE={world_size} is not divisible by TP x CP x PP = {tp} x {cp} x {pp} = {tp * cp * pp}, "
            f"so the data-parallel size WORLD_SIZE/(TP x CP x PP) is not an integer. Fix: launch a multiple of "
            f"{tp * cp * pp} processes, or choose --context-parallel-size from "
            f"{[c for c in divisors(world_size // math.gcd(world_size, tp * pp)) if world_size % (tp * pp * c) == 0]}"
            f" at TP={tp}, PP={pp}")
        return problems
    if world_size % (tp * pp):
        pairs = ", ".join(f"({a},{b})" for a, b in valid_pairs(world_size))
        sizes = ", ".join(str(s) for s in nearby_world_sizes(world_size, tp, pp))
        problems.append(
            f"WORLD_SIZE={world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}, so the "
            f"data-parallel size WORLD_SIZE/(TP x PP) is not an integer. Fix: choose "
            f"--tensor-model-parallel-size/--pipeline-model-parallel-size from the valid (TP,PP) pairs "
            f"for WORLD_SIZE={world_size}: {pairs}; or launch a world size that works with "
            f"TP={tp}, PP={pp}: {sizes}")
    return problems


def data_parallel_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """DP = WORLD_SIZE / (TP x CP x PP), the one place it is computed; ValueError (naming the flags and the
    valid choices) when TP x CP x PP does not divide the world size. Nothing is clamped."""
    problems = layout_problems(world_size, tp, pp, cp)
    if problems:
        raise ValueError("invalid parallel layout: " + "; ".join(problems))
    return world_size // (tp * cp * pp)


def micro_batches_per_step(global_batch: int, micro_batch: int, dp: int) -> int:
    """Gradient-accumulation steps: micro batches each data-parallel rank runs per iteration (the
    global batch is checked to be a multiple of micro batch x DP where the flags are parsed)."""
    return global_batch // (micro_batch * dp)


class ParallelLayout:
    """The TP × CP × DP × PP grid of ``world_size`` ranks; DP = world_size / (TP × CP × PP).

    Raises ValueError (naming WORLD_SIZE, TP, PP, CP, their product and valid choices) when the world
    size is not divisible; nothing is clamped.
    """

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> None:
        self.dp = data_parallel_size(world_size, tp, pp, cp)
        self.world_size = world_size
        self.tp = tp
        self.pp = pp
        self.cp = cp

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"ParallelLayout(world_size={self.world_size}, tp={self.tp}, pp={self.pp}{cp}, dp={self.dp})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelLayout) and (self.world_size, self.tp, self.pp, self.cp) == (
            other.world_size, other.tp, other.pp, other.cp)

    def __hash__(self) -> int:
        return hash((self.world_size, self.tp, self.pp, self.cp))

    # ---- rank <-> coordinates -------------------------------------------------------------
    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        if not (0 <= tp < self.tp and 0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= cp < self.cp):
            raise IndexError(f"coordinate (tp={tp}, cp={cp}, dp={dp}, pp={pp}) outside {self!r}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside {self!r}")
        rest = rank // self.tp
        return RankCoord(tp=rank % self.tp, dp=(rest // self.cp) % self.dp, pp=rest // (self.cp * self.dp),
                         cp=rest % self.cp)

    def _cells(self) -> Iterator[tuple[int, int, int, int]]:
        """Every (tp, cp, dp, pp), in rank order."""
        for p in range(self.pp):
            for d in range(self.dp):
                for c in range(self.cp):
                    for t in range(self.tp):
                        yield t, c, d, p

    def _groups(self, varying: str) -> list[list[int]]:
        """The ranks that differ only in the ``varying`` axes ('t', 'c', 'd', 'p'), one list per value of the
        others, in the order of their first rank."""
        out: dict[tuple, list[int]] = {}
        for t, c, d, p in self._cells():
            key = tuple(v for axis, v in zip("tcdp", (t, c, d, p)) if axis not in varying)
            out.setdefault(key, []).append(self.rank(t, d, p, c))
        return sorted(out.values(), key=lambda g: g[0])  # each group's ranks ascending (cells are in rank order)

    # ---- groups (each a list of global ranks; every list of groups partitions ranks) --------
    def tp_groups(self) -> list[list[int]]:
        """Ranks that split one layer's weights: same (cp, dp, pp)."""
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        """Ranks that split one sample's sequence: same (tp, dp, pp)."""
        return self._groups("c")

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same shard of the model and the same tokens' positions of other samples:
        same (tp, cp, pp)."""
        return self._groups("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks that hold the same shard of the model (gradients are reduced over them): same (tp, pp)."""
        return self._groups("cd")

    def pp_groups(self) -> list[list[int]]:
        """One pipeline: same (tp, cp, dp), stages in order."""
        return self._groups("p")

    def mp_groups(self) -> list[list[int]]:
        """All ranks holding one full model replica (TP × PP): same (cp, dp)."""
        return self._groups("tp")

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline (tied embedding/output weights); none when PP=1."""
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.pp_groups()]

    def groups(self) -> Iterator[tuple[str, list[list[int]]]]:
        """Every kind of group in the order process groups are created (same on every rank); the CP kinds
        only with CP > 1."""
        yield "tp", self.tp_groups()
        yield "dp", self.dp_groups()
        yield "pp", self.pp_groups()
        yield "mp", self.mp_groups()
        yield "embedding", self.embedding_groups()
        if self.cp > 1:
            yield "cp", self.cp_groups()
            yield "dp_cp", self.dp_cp_groups()

    def group_of(self, kind: str, rank: int) -> list[int] | None:
        """The group of ``kind`` ('tp', 'cp', 'dp', 'dp_cp', 'pp', 'mp', 'embedding') containing ``rank``."""
        c = self.coord(rank)
        if kind == "tp":
            return [self.rank(t, c.dp, c.pp, c.cp) for t in range(self.tp)]
        if kind == "cp":
            return [self.rank(c.tp, c.dp, c.pp, x) for x in range(self.cp)]
        if kind == "dp":
            return [self.rank(c.tp, d, c.pp, c.cp) for d in range(self.dp)]
        if kind == "dp_cp":
            return sorted(self.rank(c.tp, d, c.pp, x) for d in range(self.dp) for x in range(self.cp))
        if kind == "pp":
            return [self.rank(c.tp, c.dp, p, c.cp) for p in range(self.pp)]
        if kind == "mp":
            return sorted(self.rank(t, c.dp, p, c.cp) for p in range(self.pp) for t in range(self.tp))
        if kind == "embedding":
            if self.pp == 1 or c.pp not in (0, self.pp - 1):
                return None
            return [self.rank(c.tp, c.dp, 0, c.cp), self.rank(c.tp, c.dp, self.pp - 1, c.cp)]
        raise KeyError(f"unknown group kind {kind!r}; one of tp, cp, dp, dp_cp, pp, mp, embedding")

    def describe(self) -> dict:
        """JSON-able summary: sizes, every group, and rank -> [tp, dp, pp] ([tp, dp, pp, cp] with CP > 1)."""
        out: dict = {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.cp > 1:
            out["cp"] = self.cp
        for name, groups in self.groups():
            out[f"{name}_groups"] = groups
        out["coords"] = {r: [c.tp, c.dp, c.pp] + ([c.cp] if self.cp > 1 else [])
                         for r in range(self.world_size) for c in [self.coord(r)]}
        return out

    def format(self) -> str:
        """Human-readable layout, as printed by ``python -m megatron_ru.parallel.state``."""
        def fmt(groups: list[list[int]]) -> str:
            return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups) or "(none: PP=1)"
        cp = self.cp > 1
        lines = [f"WORLD_SIZE={self.world_size} TP={self.tp} PP={self.pp} DP={self.dp} "
                 + (f"CP={self.cp} (rank = tp + TP*(cp + CP*(dp + DP*pp)))" if cp else "(rank = tp + TP*(dp + DP*pp))"),
                 f"tensor-parallel groups:        {fmt(self.tp_groups())}"]
        if cp:
            lines.append(f"context-parallel groups:       {fmt(self.cp_groups())}")
        lines.append(f"data-parallel groups:          {fmt(self.dp_groups())}")
        if cp:
            lines.append(f"gradient (DPxCP) groups:       {fmt(self.dp_cp_groups())}")
        lines += [f"pipeline groups:               {fmt(self.pp_groups())}",
                  f"model-parallel (TPxPP) groups: {fmt(self.mp_groups())}",
                  f"embedding groups:              {fmt(self.embedding_groups())}",
                  "rank: (tp, dp, pp, cp)" if cp else "rank: (tp, dp, pp)"]
        for r in range(self.world_size):
            c = self.coord(r)
            lines.append(f"  {r}: ({c.tp}, {c.dp}, {c.pp}{f', {c.cp}' if cp else ''})")
        return "\n".join(lines)
