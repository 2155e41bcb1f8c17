"""Small system helpers shared by the Slurm and Grid Engine harnesses and by the tests that wait on a
process they started."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import pytest

_APT_STAMP = Path("/tmp/.megatron_ru_apt_updated")
_APT_LOCK = Path("/tmp/.megatron_ru_apt.lock")
#: the most one apt_install may take, retry included (below pytest.ini's per-test timeout)
APT_BUDGET_S = 900


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def unavailable(reason: str) -> None:
    """Skip outside CI when the machine cannot host a scheduler; in CI that is a failure."""
    if in_ci():
        pytest.fail(f"scheduler harness cannot run in CI: {reason}")
    pytest.skip(reason)


def run(cmd: Sequence[str], *, check: bool = True, timeout: float = 60, env: dict | None = None,
        input: str | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env,
                          input=input, cwd=cwd)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def apt_install(packages: Sequence[str], debconf: str = "") -> None:
    """Install Debian packages (apt-get update at most once per machine boot). One install at a time on
    the machine (``make test`` runs two pytest workers; dpkg refuses a second install while one runs)."""
    if os.geteuid() != 0:
        unavailable(f"installing {' '.join(packages)} needs root")
    if shutil.which("apt-get") is None:
        unavailable(f"apt-get not found; cannot install {' '.join(packages)}")
    with open(_APT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _apt_install(packages, debconf)


def _apt_install(packages: Sequence[str], debconf: str) -> None:
    deadline = time.monotonic() + APT_BUDGET_S

    def left(cap: float) -> float:
        return max(1.0, min(cap, deadline - time.monotonic()))

    if debconf:
        run(["debconf-set-selections"], input=debconf)
    if not _APT_STAMP.exists():
        run(["apt-get", "update", "-qq"], timeout=left(300))
        _APT_STAMP.touch()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    if run(install, timeout=left(600), env=env, check=False).returncode != 0:
        # package lists from an older `apt-get update` may point at files that are gone
        run(["apt-get", "update", "-qq"], timeout=left(300))
        run(install, timeout=left(600), env=env)


def spawn(cmd: Sequence[str], log_path: Path, *, user: str | None = None,
          env: dict | None = None) -> int:
    """Start a daemon in the foreground as our own child, detached from the test's terminal and
    pipes (a daemon holding pytest's capture pipes can stall), and return its PID."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, user=user, group=user)
    return proc.pid


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2,
             describe: Callable[[], str] | None = None) -> None:
    """Poll PREDICATE until it holds; a timeout names WHAT and, given DESCRIBE, what was last seen
    (a daemon's answer, a job's state) so the failure says where the wait stood."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    seen = f"; last seen: {describe()}" if describe is not None else ""
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{seen}")


def wait_while_running(proc: subprocess.Popen, predicate: Callable[[], bool], timeout: float, what: str,
                       output: Callable[[], str], interval: float = 0.1) -> None:
    """Poll PREDICATE while PROC runs. Fails as soon as PROC has ended without it, or TIMEOUT s have
    passed, naming WHAT, PROC's exit status (or that it still runs) and the end of OUTPUT(): what it
    printed so far (a log file; a pipe cannot be read before the process ends)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        code = proc.poll()
        if code is not None and predicate():   # it came true just before the process ended
            return
        if code is not None or time.monotonic() >= deadline:
            how = f"exited with status {code}" if code is not None else f"still runs after {timeout:.0f} s"
            raise AssertionError(f"{what}: not seen; the process {how}; its output ends:\n{output()[-4000:]}")
        time.sleep(interval)


def wait_for_exit(proc: subprocess.Popen, timeout: float, what: str, output: Callable[[], str]) -> int:
    """PROC's exit status; if it still runs after TIMEOUT s, a failure naming WHAT with the end of OUTPUT()."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: the process still runs after {timeout:.0f} s; its output ends:\n"
                             f"{output()[-4000:]}") from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); reap it if it is ours
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def read_pid(pid_file: Path) -> int | None:
    """PID from a daemon's pid file, or None (and the stale file removed) when it is not running."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid_file.unlink(missing_ok=True)
        return None
    if pid_alive(pid):
        return pid
    pid_file.unlink(missing_ok=True)
    return None


def stop_pids(pids: Sequence[int], timeout: float = 20, sig: int = signal.SIGTERM) -> None:
    """Stop daemons by PID: the signal to all of them at once (they shut down in parallel),
    then SIGKILL to any still running after ``timeout``."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout, f"PIDs {list(pids)} to exit", interval=0.1)
    except TimeoutError:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _processes() -> dict[int, tuple[str, int]]:
    """Every process: pid -> (command name, parent pid)."""
    from megatron_ru.utils.processes import proc_stat
    out = {}
    for entry in os.listdir("/proc"):
        stat = proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None:
            out[int(entry)] = (stat[0], int(stat[2]))
    return out


def kill_job_processes(names: Sequence[str]) -> list[int]:
    """SIGKILL every process named one of ``names`` (a scheduler's per-job process: slurmstepd, sge_shepherd) and
    all its descendants (the job's script, srun, mpirun, the ranks): a job still running when its cluster's daemons
    stop would otherwise run on without them, holding its ports (seen: a Slurm job's srun, 15 minutes after the
    harness had stopped slurmctld). Returns the PIDs killed."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid) in procs.items():
        children.setdefault(ppid, []).append(pid)
    doomed, todo = [], [pid for pid, (name, _) in procs.items() if name in names]
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += children.get(pid, [])
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return doomed


#: the job environments start Python with this: SIGABRT then prints every thread's Python stack to stderr
FAULTHANDLER_ENV = {"PYTHONFAULTHANDLER": "1"}


def abort_for_stacks(variable: str, value: str, settle_s: float = 3.0) -> str:
    """SIGABRT every Python process whose environment has VARIABLE=VALUE (a scheduler job's: JOB_ID,
    SLURM_JOB_ID) and wait SETTLE_S for them to write: started with ``FAULTHANDLER_ENV`` they print their
    Python stacks into the job's log, so a job that outlived the harness's wait says where it stood. Returns
    what to add to the wait's failure ("" when no process was found)."""
    wanted, sent = f"{variable}={value}".encode(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if not os.path.basename(os.readlink(f"/proc/{entry}/exe")).startswith("python"):
                continue
            if wanted not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            os.kill(int(entry), signal.SIGABRT)
            sent += 1
        except OSError:
            continue
    if not sent:
        return ""
    time.sleep(settle_s)
    return f"; {sent} Python processes of the job were sent SIGABRT: their stacks end its log"
