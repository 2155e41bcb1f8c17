"""Limits for the suite's long runs that tell a hung run from a starved one.

A wall-clock limit that fits a quiet machine fires on a loaded one: beside the suite's other workers and a
CPU hog (load ~19 on 2 cores) the real-model walkthrough got 710 CPU-s in 2,400 s of wall time and the 4-rank
layout runs 800 CPU-s in 1,100 s, both working, both killed. What a hang looks like is another thing: the
processes stop using the CPU (a deadlock, a wait on a peer that never answers) or use far more of it than
the work needs (a livelock). So these limits watch the CPU time of the run's processes (every live process of
the tree, with the children it has reaped): a run fails when it used (almost) no CPU for ``stall_s`` seconds of
wall time, or more than ``cpu_budget_s`` CPU-seconds; how long the machine made it wait for a core is not held
against it. pytest-timeout's guard stays the last resort (set above what these allow).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterable, Sequence

from megatron_ru.utils.processes import proc_stat

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_by_root(roots: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each process of ROOTS with all its live descendants, with what each has reaped of its
    children (utime + stime + cutime + cstime): a child's time counts while it runs and, once waited for, in
    its parent's. A root that is gone is left out."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        fields = proc_stat(int(entry)) if entry.isdigit() else None
        if fields is not None:  # [name, state, ppid, ...]; a zombie too: its time is its parent's only once reaped
            parents[int(entry)] = int(fields[2])
            cpu[int(entry)] = sum(int(x) for x in fields[12:16]) / _TICK  # utime, stime, cutime, cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for root in roots:
        if root not in cpu:
            continue
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            total += cpu[pid]
            todo += children.get(pid, [])
        out[root] = total
    return out


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """The CPU seconds of :func:`tree_cpu_by_root`, summed."""
    return sum(tree_cpu_by_root(roots).values())


class Stalled(AssertionError):
    """A guarded run that hung (no CPU for the stall limit) or ran away (over its CPU budget)."""


class ProgressGuard:
    """Fails (:meth:`check` returns why) when the watched processes used less than 1 % of a core over ``stall_s``
    seconds, or more than ``cpu_budget_s`` CPU-seconds since the guard was made."""

    #: less CPU than this share of one core over ``stall_s`` is no progress: idle threads (a queue's feeder, a
    #: watchdog) tick now and then in a hung process; a starved working one got 10 % of a core at load ~19
    MIN_SHARE = 0.01

    def __init__(self, cpu_budget_s: float, stall_s: float) -> None:
        self.cpu_budget_s, self.stall_s = cpu_budget_s, stall_s
        self.start: dict[int, float] = {}  # each root's CPU when first seen (not the run's)
        self.seen: dict[int, float] = {}   # and the most seen since: a root that has exited keeps it
        self.samples: list[tuple[float, float]] = [(time.monotonic(), 0.0)]  # (when, CPU-s used by then)

    def check(self, roots: Sequence[int]) -> str | None:
        for root, cpu in tree_cpu_by_root(roots).items():
            self.start.setdefault(root, cpu)
            self.seen[root] = max(cpu, self.seen.get(root, cpu))
        used = sum(self.seen[r] - self.start[r] for r in self.seen)
        now = time.monotonic()
        self.samples.append((now, used))
        if used > self.cpu_budget_s:
            return f"used {used:.0f} CPU-s, more than its budget of {self.cpu_budget_s:.0f}"
        old = [s for s in self.samples if s[0] <= now - self.stall_s]
        if old:
            self.samples = self.samples[len(old) - 1:]  # the newest sample at least stall_s old, and after it
            if used - old[-1][1] < self.MIN_SHARE * self.stall_s:
                return f"used {used - old[-1][1]:.1f} CPU-s in {now - old[-1][0]:.0f} s (hung)"
        return None


def run_guarded(cmd: Sequence[str], *, cpu_budget_s: float, stall_s: float = 600, poll_s: float = 5.0,
                **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` under a :class:`ProgressGuard` instead of a
    wall-clock timeout. A run the guard stops is killed with its process group and raises :class:`Stalled`,
    saying why, with what it printed."""
    guard = ProgressGuard(cpu_budget_s, stall_s)
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen_kwargs)
    while True:
        try:
            out, err = proc.communicate(timeout=poll_s)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            why = guard.check([proc.pid])
            if why is None:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise Stalled(f"{' '.join(map(str, cmd[:3]))} ...: {why}; its output ends:\n{(out or '')[-3000:]}\n"
                      f"{(err or '')[-3000:]}")
