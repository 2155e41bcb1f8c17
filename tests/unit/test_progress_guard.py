"""tests/progress_guard.py: the long runs' limits stop a hung or runaway run, not a starved one."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.progress_guard import ProgressGuard, Stalled, run_guarded, tree_cpu_seconds


def test_a_run_that_finishes_returns_its_output():
    done = run_guarded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       cpu_budget_s=60, stall_s=30, poll_s=0.2)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_run_using_no_cpu_is_stopped_as_hung():
    started = time.monotonic()
    with pytest.raises(Stalled, match=r"used 0\.\d CPU-s in \d+ s \(hung\); its output ends:\nwaiting"):
        run_guarded([sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(600)"],
                    cpu_budget_s=60, stall_s=3, poll_s=0.2)
    assert time.monotonic() - started < 30


def test_a_run_over_its_cpu_budget_is_stopped_with_its_children():
    """A child process's CPU counts too (the parent only waits for it)."""
    child = "while True: pass"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    started = time.monotonic()
    with pytest.raises(Stalled, match=r"used \d+ CPU-s, more than its budget of 1"):
        run_guarded([sys.executable, "-c", parent], cpu_budget_s=1, stall_s=30, poll_s=0.2)
    assert time.monotonic() - started < 60


def test_tree_cpu_counts_live_and_reaped_children():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    code = (f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {busy!r}])\n"
            "print('reaped', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "reaped\n"
        assert tree_cpu_seconds([proc.pid]) >= 0.5  # the child's 0.5 s, now in its parent's cutime
    finally:
        proc.kill()
        proc.wait()


def test_a_guard_counts_from_its_start():
    guard = ProgressGuard(cpu_budget_s=0.5, stall_s=60)
    assert guard.check([os.getpid()]) is None  # this process's CPU so far is not the run's
    t = time.process_time()
    while time.process_time() - t < 0.7:
        pass
    assert "more than its budget" in guard.check([os.getpid()])


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_distributed_ranks_that_use_no_cpu_are_stopped_as_hung():
    from tests.dist_utils import run_distributed
    with pytest.raises(TimeoutError, match=r"its ranks used 0\.\d CPU-s in (\d+) s \(hung\) \(process group timeout 2 s\)"
                       ) as failed:
        run_distributed(_sleeps, 2, timeout=2)
    window = int(re.search(r"CPU-s in (\d+) s", str(failed.value)).group(1))
    assert 2 + 30 <= window <= 2 + 30 + 10  # the stall limit, and the queue's 5 s poll
