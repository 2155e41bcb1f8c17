"""The integration tests' waits on a process (tests/integration/schedulers/system.py) and on its
metrics file (tests/integration/_train_helpers.py): each ends on the right condition, and a failed
one says what it saw last."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration._train_helpers import trained_iterations
from tests.integration.schedulers.system import wait_for, wait_for_exit, wait_while_running


def test_trained_iterations_counts_complete_train_records(tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert trained_iterations(metrics) == 0  # not written yet
    train = [json.dumps({"type": "train", "iteration": i, "lm_loss": 4.0}) for i in (1, 2)]
    evaluation = json.dumps({"type": "eval", "iteration": 2, "val_loss": 4.1})
    metrics.write_text(f"{train[0]}\n{evaluation}\n")
    assert trained_iterations(metrics) == 1
    metrics.write_text(f"{train[0]}\n{evaluation}\n{train[1][:20]}")  # the second one half-written
    assert trained_iterations(metrics) == 1
    metrics.write_text(f"{train[0]}\n{evaluation}\n{train[1]}\n")
    assert trained_iterations(metrics) == 2


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_wait_while_running_returns_once_the_condition_holds():
    proc = _python("import time; time.sleep(30)")
    try:
        calls = []
        wait_while_running(proc, lambda: calls.append(1) or len(calls) >= 3, 30, "three polls", str, interval=0.01)
        assert len(calls) == 3
    finally:
        proc.kill()
        proc.wait()


def test_wait_while_running_fails_as_soon_as_the_process_ended():
    proc = _python("import sys; sys.exit(7)")
    with pytest.raises(AssertionError, match=r"(?s)the ready file: not seen; the process exited with status 7; "
                                             r"its output ends:\nlast words"):
        wait_while_running(proc, lambda: False, 60, "the ready file", lambda: "last words")


def test_wait_while_running_names_a_process_that_still_runs():
    proc = _python("import time; time.sleep(30)")
    try:
        with pytest.raises(AssertionError, match="the ready file: not seen; the process still runs after 0 s"):
            wait_while_running(proc, lambda: False, 0.2, "the ready file", lambda: "")
        with pytest.raises(AssertionError, match=r"(?s)exit: the process still runs after 0 s; its output ends:\n"
                                                 r"\.\.\.working"):
            wait_for_exit(proc, 0.2, "exit", lambda: "...working")
    finally:
        proc.kill()
        proc.wait()
    assert wait_for_exit(_python("import sys; sys.exit(3)"), 30, "exit", str) == 3


def test_wait_for_names_what_it_saw_last():
    with pytest.raises(TimeoutError, match=r"waiting for the node to become idle; last seen: sinfo: drained"):
        wait_for(lambda: False, 0.05, "the node to become idle", interval=0.01, describe=lambda: "sinfo: drained")
    with pytest.raises(TimeoutError, match=r"waiting for the node to become idle$"):
        wait_for(lambda: False, 0.05, "the node to become idle", interval=0.01)
