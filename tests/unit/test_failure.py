"""Exit status and who prints an error (megatron_ru.training.failure), before a process group exists."""
import logging

import pytest

from megatron_ru.training import failure
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


@pytest.fixture
def records(caplog):
    """caplog for the package's logger (it does not propagate to the root logger)."""
    root = logging.getLogger("megatron_ru")
    root.addHandler(caplog.handler)
    yield caplog
    root.removeHandler(caplog.handler)


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
