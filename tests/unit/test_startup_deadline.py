"""Start-up is bounded like training (issue 31, hang 2): MPI's exchange of rank 0's address has no
timeout, so a watchdog process ends a rank stuck in it with one line; a rank waiting for rank 0's
rendezvous store gives up after the timeout and says so itself (rank 0 is the one missing)."""
import subprocess
import sys
import time

import pytest

from megatron_ru.parallel import env as penv
from megatron_ru.parallel import failure
from tests.dist_utils import free_port
from tests.integration._train_helpers import REPO

_STUCK = """
import sys, time
from megatron_ru.parallel.watchdog import StartupWatchdog
with StartupWatchdog(float(sys.argv[1]), "stuck in the test's exchange"):
    time.sleep(float(sys.argv[2]))
print("done", flush=True)
"""


def _run(deadline: float, block: float) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO, "OMPI_COMM_WORLD_RANK": "0"}
    return subprocess.run([sys.executable, "-c", _STUCK, str(deadline), str(block)], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.timeout(90)
def test_watchdog_ends_a_stuck_step_with_one_line():
    started = time.time()
    proc = _run(1.0, 40)
    assert time.time() - started < 20
    assert proc.returncode == -9 and "done" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 0] ERROR megatron_ru.parallel.env: start-up did not finish: stuck in the" in lines[0]


@pytest.mark.timeout(90)
def test_watchdog_is_silent_when_the_step_finishes():
    proc = _run(20.0, 0.2)
    assert proc.returncode == 0 and proc.stdout.strip() == "done" and proc.stderr == ""


def test_waiting_for_a_missing_rank0_store_gives_up_naming_it():
    port = free_port()
    started = time.time()
    with pytest.raises(penv.RendezvousTimeout, match=f"rank 2 waited --distributed-timeout-minutes \\(0.02\\) for "
                                                     f"rank 0's rendezvous store at 127.0.0.1:{port}"):
        penv.wait_for_store("127.0.0.1", port, 0.02, rank=2)
    assert 1.2 <= time.time() - started < 1.2 + penv.DEADLINE_GRID_S + 5  # 0.02 min, ended on the clocks' grid


def test_ranks_that_began_waiting_apart_give_up_together(monkeypatch):
    """A failed wait for rank 0's store ends on the wall clock's 10 s grid: ranks whose start-ups ended seconds
    apart give up in the same instant, so that the failure report's stagger orders their lines (beside a CPU
    hog, ranks 1 and 2 of test_rank0_faults.py's master-addr-rank0 case gave up 2 s apart and both printed)."""
    clock = {"wall": 1_000_003.5, "mono": 50.0}
    monkeypatch.setattr(penv.time, "time", lambda: clock["wall"])
    monkeypatch.setattr(penv.time, "monotonic", lambda: clock["mono"])
    first = penv.common_deadline(30.0)           # wall 1,000,033.5 -> ends at 1,000,040
    assert first == 50.0 + 36.5
    clock["wall"] += 3.2                          # the second rank begins 3.2 s later (both clocks)
    clock["mono"] += 3.2
    assert penv.common_deadline(30.0) == first
    clock["wall"] += 3.4                          # at least the timeout, always: this one ends on the next point
    clock["mono"] += 3.4
    assert penv.common_deadline(30.0) == first + 10.0


def test_every_rank_that_waited_for_rank0_reports_it(monkeypatch):
    monkeypatch.setattr(failure, "LOST_STAGGER_S", 0.0)
    error = penv.RendezvousTimeout("rank 2 waited ... for rank 0's rendezvous store")
    ranks = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    decided = failure.verdict(ranks, error)
    assert decided.report and failure.message_of(error, 0.5, lost=decided.lost) == \
        "training failed: rank 2 waited ... for rank 0's rendezvous store."
    assert not failure.verdict(ranks, RuntimeError("other")).report  # any other error: rank 0 prints


def test_a_store_that_accepts_but_never_answers_is_waited_for_then_named():
    """Rank 0 stopped right after it began to listen: the kernel completes connections to its socket, nothing
    reads them. A plain connect took that for a living store, and torch's client then printed a C++ stack trace
    per retry (test_rank0_faults.py's master-addr-rank0 case beside a CPU hog)."""
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # never accepted, never read: a stopped process's socket
    port = server.getsockname()[1]
    started = time.time()
    try:
        with pytest.raises(penv.RendezvousTimeout, match=f"rank 1 waited --distributed-timeout-minutes \\(0.05\\) "
                                                         f"for rank 0's rendezvous store at 127.0.0.1:{port} \\(it "
                                                         f"accepted the connection and did not answer\\)"):
            penv.wait_for_store("127.0.0.1", port, 0.05, rank=1)
    finally:
        server.close()
    assert 3.0 <= time.time() - started < 3.0 + penv.DEADLINE_GRID_S + 6  # 0.05 min on the grid, a 5 s try


def test_a_living_torch_store_answers_at_once():
    from datetime import timedelta

    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    started = time.time()
    penv.wait_for_store("127.0.0.1", port, 0.5, rank=1)
    assert time.time() - started < 2
    # the store still serves torch's own clients after our ping
    client = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
