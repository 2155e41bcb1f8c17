"""Suite-wide hooks and fixtures: the fast suite's budget; the real model's cache; the package logger's records.

``make test-fast`` (``pytest -m "not slow" tests``) is the edit-test loop and must stay under 3 minutes
on 2 cores. Wall time depends on what else the machine runs, so the check counts CPU time (this
process and its children): more than 2 cores x 3 minutes of it cannot fit, and the run fails,
naming the budget; over 3 minutes of wall time is reported only. A test that runs tools, ranks or
schedulers belongs in the slow set (``pytestmark = pytest.mark.slow``).
"""
from __future__ import annotations

import logging
import resource
import time

import pytest

FAST_BUDGET_S = 180
FAST_CORES = 2
_STARTED = time.monotonic()


def _cpu_seconds() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("markexpr") != "not slow" or session.testscollected < 100:
        return  # not the fast suite (a file, a -k selection, the full suite)
    wall, cpu = time.monotonic() - _STARTED, _cpu_seconds()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = (f"fast suite: {wall:.0f} s wall, {cpu:.0f} CPU-s for {session.testscollected} tests "
            f"(budget: {FAST_BUDGET_S} s on {FAST_CORES} cores)")
    if reporter is not None:
        reporter.write_line(line)
    if cpu > FAST_BUDGET_S * FAST_CORES:
        if reporter is not None:
            reporter.write_line(f"the fast suite cannot fit its budget: mark the slowest tests slow "
                                f"(pytest --durations=20 -m 'not slow' names them)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def real_model_cache() -> str:
    """SmolLM2-135M-Instruct and the Russian/English man pages (tools/real_model.py), built here when
    missing: CI installs them and never skips. Returns the cache directory."""
    from tools.real_model import ensure
    return ensure()


@pytest.fixture
def records(caplog):
    """caplog for the package's logger (it does not propagate to the root logger)."""
    root = logging.getLogger("megatron_ru")
    root.addHandler(caplog.handler)
    yield caplog
    root.removeHandler(caplog.handler)
