"""The forked workers of --worker-type process: results in order, and every way of ending them
(the last result, an error, a killed worker, Ctrl-C) ends promptly, with no worker left."""
from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_ru.data.preprocess.workers import ProcessWorkers

pytestmark = pytest.mark.timeout(120)


class _Never:
    POLL_SECONDS = 0.05

    def check(self) -> None:
        pass


class _After:
    """Raises KeyboardInterrupt from the first check made ``seconds`` after it was built."""
    POLL_SECONDS = 0.05

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() >= self.at:
            raise KeyboardInterrupt


def _slow_reverse(batch: bytes) -> bytes:
    time.sleep(0.001 * (batch[0] % 7))  # later batches often finish first
    return batch[::-1]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_results_come_in_submission_order():
    workers = ProcessWorkers(_slow_reverse, 3)
    batches = [bytes([i % 251]) * (1 + 997 * i) for i in range(40)]  # up to ~39 KB: several per pipe
    seqs = [workers.submit(b) for b in batches]
    assert [workers.result(s, _Never()) for s in seqs] == [b[::-1] for b in batches]
    pids = [p.pid for p in workers._procs]
    workers.close()
    assert _alive(pids) == []


def test_kill_returns_while_a_batch_is_stuck_in_the_pipe():
    """multiprocessing.Pool.terminate() could wait forever here: its thread writing a batch into the
    task pipe stays blocked once the workers are gone, as the parent holds the pipe's read end."""
    workers = ProcessWorkers(lambda b: time.sleep(60), 2)
    for _ in range(6):
        workers.submit(b"x" * 4_000_000)  # far over a pipe's 64 KiB: the writer blocks
    time.sleep(0.5)
    assert workers._sender.is_alive()  # still writing: the workers sleep
    pids = [p.pid for p in workers._procs]
    t = time.monotonic()
    workers.kill()
    assert time.monotonic() - t < 10
    assert not workers._sender.is_alive() and _alive(pids) == []


def test_a_killed_worker_is_an_error_that_names_it():
    """A worker killed from outside (the kernel, out of memory) loses its batch: the wait for it
    ends with the worker's pid and signal instead of lasting forever."""
    workers = ProcessWorkers(lambda b: time.sleep(60), 2)
    seq = workers.submit(b"doc")
    victim = workers._procs[0].pid
    time.sleep(0.3)
    os.kill(victim, signal.SIGKILL)
    t = time.monotonic()
    died = rf"worker process {victim} was killed by SIGKILL while tokenizing \(out of memory\?"
    with pytest.raises(ChildProcessError, match=died):
        workers.result(seq, _Never())
    assert time.monotonic() - t < 10
    pids = [p.pid for p in workers._procs]
    workers.kill()
    assert _alive(pids) == []


def _fails(batch: bytes) -> bytes:
    raise OSError(f"cannot tokenize {batch!r}")


def test_an_exception_in_a_worker_carries_its_traceback():
    workers = ProcessWorkers(_fails, 2)
    seq = workers.submit(b"doc 7")
    with pytest.raises(RuntimeError, match=r"(?s)a worker process failed while tokenizing:.*_fails.*"
                                           r"OSError: cannot tokenize b'doc 7'"):
        workers.result(seq, _Never())
    workers.kill()


def test_ctrl_c_does_not_wait_for_a_long_batch():
    workers = ProcessWorkers(lambda b: time.sleep(60), 1)
    seq = workers.submit(b"a book")
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        workers.result(seq, _After(0.3))
    assert time.monotonic() - t < 5
    workers.kill()


def test_workers_ignore_ctrl_c_sent_to_the_whole_process_group():
    """A terminal's Ctrl-C reaches every process of the group: the workers leave it to the parent."""
    workers = ProcessWorkers(_slow_reverse, 2)
    time.sleep(0.3)
    for p in workers._procs:
        os.kill(p.pid, signal.SIGINT)
    seqs = [workers.submit(bytes([i]) * 10) for i in range(8)]
    assert [workers.result(s, _Never()) for s in seqs] == [bytes([i]) * 10 for i in range(8)]
    workers.close()
    assert [p.exitcode for p in workers._procs] == [0, 0]
