"""Signals at the time limit, with the real launchers and the options the job scripts give them.

Each test takes the launcher options from the job script's own DRY_RUN=1 output, runs the real
torchrun or mpirun with a small rank program that "saves" (two seconds, then the checkpoint
pointer, written last) on SIGTERM/SIGUSR1 as pretrain_gpt.py --exit-signal-handler does, and
sends a real signal: to the launcher itself (what Slurm's --signal / time limit do to a job
step) or to the job shell (scripts/lib/launch.sh's run_or_print, which passes SIGUSR1 on).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.schedulers.system import wait_for_exit, wait_while_running

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "DRY_RUN": "1"}
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}

# torchrun as the venv's (the job scripts activate it first), found without relying on PATH
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# How long torchrun may take to end after a signal, whatever its workers do: it waits up to 30 s
# for them after passing the signal on, then SIGKILLs them and waits up to 30 s more
# (torch.distributed.elastic's SubprocessContext._close). The second wait is not only for a
# stuck worker: when the signal interrupts torchrun's own poll of a worker between
# Popen._waitpid_lock.acquire() and the try that releases it (CPython; about 1 in 70 signals
# that land in a busy poll loop here), that worker exits and saves but torchrun can no longer
# reap it and sits out both waits. Seen once beside the full suite with a CPU hog.
TORCHRUN_TEARDOWN_S = 30 + 30
TORCHRUN_END_S = TORCHRUN_TEARDOWN_S + 30  # + the 2 s save, start-up of the exit path, a loaded machine

RANK_PROGRAM = """
import os, signal, sys, time
out, save = sys.argv[1], sys.argv[2]
rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
def save_and_exit(signum, frame):
    time.sleep(2)  # the save
    if rank == "0":
        with open(os.path.join(save, "latest.tmp"), "w") as f:
            f.write("7\\n")
        os.replace(os.path.join(save, "latest.tmp"), os.path.join(save, "latest_checkpointed_iteration.txt"))
    open(os.path.join(out, f"saved{rank}"), "w").write(signal.Signals(signum).name)
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, save_and_exit)
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
time.sleep(90)
sys.exit(3)
"""


def dry_run(script: str, env: dict[str, str]) -> list[str]:
    proc = subprocess.run(["bash", script], cwd=REPO, env={**BASE_ENV, **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def torchrun_signal_options(tmp_path: Path) -> list[str]:
    """The options submit_torchrun.sbatch gives torchrun (besides nodes and rendezvous)."""
    cmd = dry_run("scripts/slurm/submit_torchrun.sbatch",
                  {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1",
                   "SLURM_GPUS_ON_NODE": "2", "TIME_LIMIT": "1:00:00", "SAVE_DIR": str(tmp_path / "ckpt")})
    opts = [w for w in cmd[cmd.index("torchrun") + 1:cmd.index(str(REPO / "pretrain_gpt.py"))]
            if not w.startswith(("--nnodes", "--nproc-per-node", "--rdzv"))]
    return opts


def mpirun_options(tmp_path: Path, grace_s: int) -> list[str]:
    """The options submit_single_node.sh gives mpirun after its host file and exports."""
    (tmp_path / "hosts").write_text("localhost\n")
    cmd = dry_run("scripts/abci/submit_single_node.sh",
                  {"JOB_ID": "5", "SGE_JOB_HOSTLIST": str(tmp_path / "hosts"), "SGE_LOCALDIR": str(tmp_path),
                   "SAVE_DIR": str(tmp_path / "ckpt"), "SAVE_GRACE_SECONDS": str(grace_s)})
    opts = cmd[cmd.index("--mca"):cmd.index("python")]
    assert opts[:3] == ["--mca", "odls_base_sigkill_timeout", str(grace_s)], opts
    return opts


def start(tmp_path: Path, launcher: list[str], via_shell: bool) -> subprocess.Popen:
    """LAUNCHER (mpirun ... | torchrun ..., which runs a script with its own python) on the rank program."""
    torchrun = launcher[:len(TORCHRUN)] == TORCHRUN
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROGRAM)
    python = [] if torchrun else [sys.executable]
    cmd = [*launcher, *python, str(prog), str(tmp_path), str(tmp_path / "ckpt")]
    env = {**os.environ, **MPI_ENV, "SAVE_DIR": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1"}
    if via_shell:
        cmd = ["bash", "-c", 'set -euo pipefail; source scripts/lib/launch.sh; run_or_print "$@"', "job", *cmd]
    # a session of its own: a signal to the group reaches the shell, the launcher and the ranks,
    # as Slurm signals every process of a job step; its output goes to a file, readable while it runs
    log = tmp_path / "launcher.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_while_running(proc, lambda: all((tmp_path / f"pid{r}").exists() for r in range(2)), 90,
                           "both ranks' pid files", log.read_text)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    time.sleep(0.5)  # the pid file is written after the handlers are installed
    return proc


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float) -> tuple[int, str]:
    """The launcher's status and output, once it ended; no rank may outlive it (torchrun starts
    its workers in sessions of their own: a rank it failed to stop would train on, orphaned)."""
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    ended = False
    states = "-"
    try:
        proc.wait(timeout=timeout)
        ended = True
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    except subprocess.TimeoutExpired:
        states = ", ".join(f"{p} {process_state(p)}" for p in pids)  # Z: exited, not reaped by the launcher
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        orphans = [p for p in pids if Path(f"/proc/{p}").exists()]
        for p in orphans:
            os.kill(p, signal.SIGKILL)
    out = (tmp_path / "launcher.txt").read_text()
    assert ended, f"the launcher did not end within {timeout:.0f} s of the signal (workers then: {states}):\n{out}"
    assert not orphans, f"ranks {orphans} outlived their launcher:\n{out}"
    return proc.returncode, out


def process_state(pid: int) -> str:
    """The state letter in /proc/PID/stat (R, S, D, Z...) or 'gone'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


def saved(tmp_path: Path) -> list[str]:
    return [(tmp_path / f"saved{r}").read_text() if (tmp_path / f"saved{r}").exists() else "-" for r in range(2)]


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_torchrun_passes_slurms_signal_to_its_workers(tmp_path, sig):
    """Slurm's --signal=USR1@T (or the SIGTERM at the limit) reaches torchrun itself: with the
    script's options torchrun passes it on, the workers save and exit, none is orphaned.
    (torchrun ends 1 after any signal it handled, whatever its workers did.)"""
    proc = start(tmp_path, [*TORCHRUN, "--nproc-per-node=2", *torchrun_signal_options(tmp_path)], via_shell=False)
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    rc, out = finish(proc, tmp_path, TORCHRUN_END_S)
    assert saved(tmp_path) == [f"SIG{sig}"] * 2, out
    assert rc == 1, out


def test_torchrun_job_ends_0_after_a_signal_triggered_save(tmp_path):
    """SIGTERM to the whole job step (shell, torchrun, workers): the workers save, torchrun
    reports 1, and the job shell, seeing a checkpoint completed after the signal, ends 0."""
    proc = start(tmp_path, [*TORCHRUN, "--nproc-per-node=2", *torchrun_signal_options(tmp_path)], via_shell=True)
    os.killpg(proc.pid, signal.SIGTERM)
    rc, out = finish(proc, tmp_path, TORCHRUN_END_S)
    assert saved(tmp_path)[0] in ("SIGTERM", "SIGUSR1") and "-" not in saved(tmp_path), out
    assert "the launcher exited with status 1 after the signal, but the ranks saved iteration 7 in " \
           f"{tmp_path / 'ckpt'} after it: ending with status 0" in out
    assert rc == 0, out


def test_job_keeps_the_launchers_failure_when_nothing_was_saved(tmp_path):
    """The exception is only for a save after the signal: an old checkpoint does not count."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")
    prog = tmp_path / "fail.py"
    prog.write_text("import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(1))\n"
                    f"open({str(tmp_path / 'ready')!r}, 'w').close()\ntime.sleep(60)\n")
    log = tmp_path / "job.txt"
    with open(log, "w") as out_file:
        proc = subprocess.Popen(["bash", "-c", 'set -euo pipefail; source scripts/lib/launch.sh; run_or_print "$@"',
                                 "job", sys.executable, str(prog)], cwd=REPO, stdout=out_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "SAVE_DIR": str(tmp_path / "ckpt")}, start_new_session=True)
    try:
        wait_while_running(proc, (tmp_path / "ready").exists, 30, "the program's ready file", log.read_text)
        proc.send_signal(signal.SIGTERM)
        code = wait_for_exit(proc, 30, "the job shell after SIGTERM", log.read_text)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert code == 1 and "ending with status 0" not in out, out


def test_mpirun_gives_ranks_the_grace_to_save_on_sigterm(tmp_path):
    """A SIGTERM to mpirun itself: Open MPI SIGKILLs the ranks odls_base_sigkill_timeout seconds
    later (1 s by default: no save). With the ABCI scripts' option the ranks save; mpirun itself
    reports 1 and the job shell, which also got the signal, ends 0."""
    plain = tmp_path / "plain"
    plain.mkdir()
    proc = start(plain, ["mpirun", "-np", "2"], via_shell=False)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc, plain, 30)
    assert rc != 0 and saved(plain) == ["-", "-"], out  # Open MPI's default: killed mid-save
    job = tmp_path / "job"
    job.mkdir()
    proc = start(job, ["mpirun", "-np", "2", *mpirun_options(tmp_path, 5)], via_shell=True)
    os.killpg(proc.pid, signal.SIGTERM)  # the shell, mpirun and the ranks, as a scheduler does
    rc, out = finish(proc, job, 60)
    assert "-" not in saved(job), out
    assert "ending with status 0" in out and rc == 0, out
