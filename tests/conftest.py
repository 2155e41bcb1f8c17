"""Suite-wide hooks and fixtures: the fast suite's budget; the real model's cache; the package logger's records.

``make test-fast`` (``pytest -m "not slow" tests``) is the edit-test loop and must stay under 3 minutes
on 2 cores. Wall time depends on what else the machine runs, so the check counts CPU time (this
process and its children): more than 2 cores x 3 minutes of it cannot fit, and the run fails,
naming the budget; over 3 minutes of wall time is reported only. A test that runs tools, ranks or
schedulers belongs in the slow set (``pytestmark = pytest.mark.slow``).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import time

import pytest

FAST_BUDGET_S = 180
FAST_CORES = 2
_STARTED = time.monotonic()


def _cpu_seconds() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def _forkserver_cpu_seconds() -> float:
    """CPU time of this process's multiprocessing fork server and its reaped children (tests/dist_utils.py's
    ranks are forked from it, not from this process)."""
    import multiprocessing.forkserver as fs
    pid = getattr(fs._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


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


#: MEGATRON_RU_TEST_CPU_LOG=FILE: one JSON line per test (setup, call and teardown) with its wall time and CPU
#: time, this process's and its reaped children's (tools, launchers, ranks, the fork server's ranks; not a
#: scheduler daemon's jobs), so that the suite's budget is spent where it is measured: ``python tests/cpu_log.py
#: FILE`` sums it per file. Each line also has the outcome (and a failure's last line), written as the test ends
CPU_LOG = os.environ.get("MEGATRON_RU_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if not CPU_LOG:
        yield
        return
    wall, cpu, served = time.monotonic(), _cpu_seconds(), _forkserver_cpu_seconds()
    yield
    # (a fork server the test started counts whole)
    cpu = _cpu_seconds() - cpu + max(0.0, _forkserver_cpu_seconds() - served)
    reports = item.__dict__.pop("_cpu_log_reports", [])
    failed = [r for r in reports if r.failed]
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2), "cpu_s": round(cpu, 2),
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
              "outcome": "failed" if failed else "skipped" if any(r.skipped for r in reports) else "passed"}
    if failed:  # the run's summary comes at its end: a run stopped early still says what failed and why
        lines = failed[0].longreprtext.strip().splitlines() or [""]
        said = [line for line in lines if line.startswith("E ")] or lines
        record["error"] = f"{failed[0].when}: {said[0][:500]} ({lines[-1][-200:]})"
    with open(CPU_LOG, "a", encoding="utf-8") as f:  # one short line per write: workers' lines never interleave
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    if CPU_LOG:
        item.__dict__.setdefault("_cpu_log_reports", []).append(outcome.get_result())


#: the tests that share the machine's schedulers (one Slurm and one Grid Engine per machine, and apt): one worker
#: runs them all. Every test that uses a scheduler's fixture, wherever it is, and the files that apt-install
#: packages of their own beside them (slurm-client, shellcheck)
MACHINE_GROUP = "machine"
MACHINE_FIXTURES = frozenset({"grid_engine", "slurm_cluster"})
MACHINE_FILES = frozenset({"test_scripts_dry_run.py", "test_shellcheck.py"})


def _on_the_machine(item: pytest.Item) -> bool:
    return item.path.name in MACHINE_FILES or bool(MACHINE_FIXTURES & set(getattr(item, "fixturenames", ())))


#: the files that take longest (pytest --durations), started first under xdist; then the other slow files, then the rest
LONGEST_FILES = ("test_adapt_real.py", "test_fault_hangs.py", "test_rank0_faults.py", "test_real_model.py",
                 "test_adapt_demo.py", "test_train_layouts.py", "test_megatron_scripts.py", "test_real_gemma3.py")


def _start_order(item: pytest.Item) -> tuple[int, int]:
    name = item.path.name
    if name in LONGEST_FILES:
        return 0, LONGEST_FILES.index(name)
    if _on_the_machine(item):
        return 0, len(LONGEST_FILES)
    return (1 if item.get_closest_marker("slow") else 2), 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 3 --dist loadgroup``): the tests of one file go to one
    worker, so that a module's fixtures (a trained checkpoint, a corpus, a converted real model) are built
    once; the files that bring up the schedulers go to one worker together. Runs before xdist's own hook,
    which turns the mark into the group."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    # the longest files first, the many short unit tests last: no worker is left with a long test at the end
    # (with --no-loadscope-reorder, xdist hands out the files in this order)
    items.sort(key=_start_order)
    for item in items:
        group = MACHINE_GROUP if _on_the_machine(item) else str(item.path.relative_to(config.rootpath))
        item.add_marker(pytest.mark.xdist_group(group))


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
