"""Exit status and who prints an error (megatron_ru.parallel.failure), before a process group exists."""
import logging
import time

import torch.distributed as dist

import pytest

from megatron_ru.parallel import failure
from megatron_ru.utils.logging import current_rank


class CheckpointLikeError(ValueError):
    pass


@pytest.mark.parametrize("error, code", [
    (ValueError("bad flag"), 2), (CheckpointLikeError("bad file"), 2), (FileNotFoundError("no .idx"), 2),
    (RuntimeError("Connection closed by peer"), 1), (FloatingPointError("loss is nan"), 1),
    (OSError(28, "No space left on device"), 1)])
def test_exit_status_2_for_input_errors_1_for_failures(error, code):
    assert failure.exit_code_of(error) == code


@pytest.mark.parametrize("env, prints", [
    ({}, True),                                                              # one process
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, True),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, False),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, False),
    ({"RANK": "1", "WORLD_SIZE": "two", "LOCAL_RANK": "1"}, True),          # cannot tell its rank: prints
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      failure.DEBUG_VAR: "1"}, True),                                       # debugging: every rank
])
def test_before_the_process_group_rank_0_prints(env, prints):
    assert failure.should_report(env) is prints


def test_report_prints_one_line_without_traceback(records, monkeypatch):
    caplog = records
    monkeypatch.setattr(failure, "SILENT_GRACE_S", (0.0, 0.0))
    try:
        raise ValueError("/data/x.idx: truncated index; rebuild it with tools/preprocess_data.py")
    except ValueError as e:
        with caplog.at_level(logging.INFO, logger="megatron_ru"):
            assert failure.report_failure(e, 0.5, env={}) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "/data/x.idx: truncated index; rebuild it with tools/preprocess_data.py"]
    caplog.clear()
    try:
        raise RuntimeError("Timed out waiting 30000ms")
    except RuntimeError as e:
        with caplog.at_level(logging.INFO, logger="megatron_ru"):
            assert failure.report_failure(e, 0.5, env={failure.DEBUG_VAR: "1"}) == 1
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("Traceback (most recent call last)") and "RuntimeError: Timed out" in first
    assert second.startswith("training failed: RuntimeError: Timed out waiting 30000ms.")
    assert "--distributed-timeout-minutes (0.5)" in second
    # a rank that is not rank 0 before the group exists stays silent
    caplog.clear()
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert failure.report_failure(ValueError("x"), None, env=env) == 2
    assert caplog.records == []


def test_log_lines_name_the_launchers_rank_before_discovery(monkeypatch):
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert current_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert current_rank() == 5
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert current_rank() == 3
    monkeypatch.setenv("RANK", "2")  # written back by rank discovery: wins
    assert current_rank() == 2


# ---- the failure path never blocks on the rendezvous store -------------------------------------------

def _store_host(port: int):
    import subprocess
    import sys
    code = ("import time, torch.distributed as dist\n"
            "from datetime import timedelta\n"
            f"s = dist.TCPStore('127.0.0.1', {port}, 2, True, timedelta(seconds=60), wait_for_workers=False)\n"
            "print('up', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _wait_until_stopped(pid: int, limit_s: float) -> None:
    """Until every thread of ``pid`` is in the stopped state (T in /proc/PID/task/*/stat)."""
    import os
    import time
    deadline = time.monotonic() + limit_s
    states: list[str] = []
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(st == "T" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the store host {pid} did not stop within {limit_s} s (thread states {states})")


def _client(port: int):
    from datetime import timedelta
    import torch.distributed as dist
    return dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30)))


@pytest.mark.timeout(60)
def test_a_stopped_store_host_is_named_within_the_deadline(monkeypatch):
    """TCPStore.add on a stopped host waits for ever whatever set_timeout says (issue 31, hang 1)."""
    import signal
    import time
    from tests.dist_utils import free_port
    monkeypatch.setattr(failure, "STORE_DEADLINE_S", 2.0)
    port = free_port()
    host = _store_host(port)
    try:
        store = _client(port)
        assert failure.claim_report(store, {}).report  # the first claim
        assert not failure.claim_report(store, {}).report  # a later one stays silent
        host.send_signal(signal.SIGSTOP)
        # a stop is not immediate: until a thread of the host handles it, its store thread still answers (seen
        # on a loaded machine: the claim got the store's count). Claim once every thread is stopped
        _wait_until_stopped(host.pid, 20)
        started = time.time()
        verdict = failure.claim_report(store, {})
        assert time.time() - started < 15, verdict  # the probe (up to 2 s) and the claim's deadline (2 s)
        assert verdict.report and verdict.lost.startswith("lost rank 0: the job's rendezvous store at 127.0.0.1:"), \
            verdict
        assert "does not answer within 2 s" in verdict.lost, verdict
    finally:
        host.kill()
        host.wait()


@pytest.mark.timeout(60)
def test_a_dead_store_host_is_named_without_a_cpp_stack_trace(capfd):
    import time
    from tests.dist_utils import free_port
    port = free_port()
    host = _store_host(port)
    store = _client(port)
    host.kill()
    host.wait()
    time.sleep(0.5)
    capfd.readouterr()  # what an earlier test's abandoned claim printed when its store host went
    verdict = failure.claim_report(store, {"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert verdict.report and "lost rank 0" in verdict.lost and "refuses connections" in verdict.lost
    assert "Exception raised from" not in capfd.readouterr().err


def test_messages_of_cpp_errors_are_one_line():
    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                         "by peer [127.0.0.1]:1691\nException raised from recvBytes at Utils.hpp:787 (most recent "
                         "call first):\nframe #0: c10::Error::Error() + 0x9d\nframe #1: x\n<omitting python frames>\n")
    text = failure.message_of(error, 0.5)
    assert text.startswith("training failed: RuntimeError: Connection closed by peer [127.0.0.1]:1691.")
    assert "\n" not in text and "frame #" not in text and "pair.cc" not in text
    lost = failure.message_of(error, 0.5, lost="lost rank 0: the store ...")
    assert lost == ("training failed: lost rank 0: the store ...; this rank gave up at RuntimeError: Connection "
                    "closed by peer [127.0.0.1]:1691.")


def test_the_census_names_the_ranks_that_never_check_in():
    """A reporter that failed because of a peer names the ranks that do not reach their failure handler
    (a stopped or killed rank); it stops waiting as soon as everybody else has checked in."""
    store = dist.HashStore()
    for rank in (1, 3):
        failure.check_in(store, rank)
    started = time.monotonic()
    assert failure.missing_ranks(store, 0, 5, wait_s=0.6) == [2, 4]
    assert time.monotonic() - started >= 0.6
    for rank in (2, 4):
        failure.check_in(store, rank)
    started = time.monotonic()
    assert failure.missing_ranks(store, 0, 5, wait_s=30) == []
    assert time.monotonic() - started < 5


def test_a_peers_failure_names_the_lost_rank_and_the_timeout_flag():
    lost = failure._lost_peers([3], 5.0)
    text = failure.message_of(RuntimeError("Timed out waiting 30000ms for recv operation to complete"), 0.5,
                              lost=lost, peers_lost=True)
    assert text.startswith("training failed: lost rank 3: no word from it within 5 s"), text
    assert "gave up after --distributed-timeout-minutes (0.5) at RuntimeError: Timed out" in text
    assert failure._caused_by_peer(RuntimeError("Connection closed by peer [127.0.0.1]:1691"))
    assert not failure._caused_by_peer(FileNotFoundError("no such file: ...timeout..."))
    assert not failure._caused_by_peer(RuntimeError("loss is NaN at iteration 3"))
    many = failure._lost_peers(list(range(1, 12)), 5.0)
    assert many.startswith("lost ranks 1, 2, 3, 4, 5, 6, 7, 8 and 3 more: no word from them")


def test_the_census_skips_ranks_already_known_to_be_missing():
    store = dist.HashStore()
    failure.check_in(store, 1)
    started = time.monotonic()
    assert failure.missing_ranks(store, 0, 3, wait_s=30, known=[2]) == []  # rank 2 is not waited for
    assert time.monotonic() - started < 5
