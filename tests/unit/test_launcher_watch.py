"""A rank whose launcher is gone before the rank could look for it (killed during the rank's first second, while
the interpreter started) ends at once with one line, instead of training on unwatched: the rank is init's child and
Open MPI's server named in PMIX_SERVER_TMPDIR no longer runs, or torchrun's agent is gone. A process started by hand
is left alone."""
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = "from megatron_ru.parallel.launcher_watch import watch_launcher; w = watch_launcher(); print('watched', w is not None)"
ENDING = CODE + "; print('ended', flush=True)"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _run(extra: dict, orphan: bool = False, tmp_path=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=REPO, **extra)
    if not orphan:
        return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=60)
    # the rank's parent exits at once: the rank is init's child when it starts looking for its launcher
    out = tmp_path / "out.txt"
    orphan_code = (f"import os, sys, time\nif os.fork(): os._exit(0)\ntime.sleep(0.5)\n"
                   f"fd = os.open({str(out)!r}, os.O_WRONLY | os.O_CREAT)\nos.dup2(fd, 1)\nos.dup2(fd, 2)\n"
                   f"os.execv(sys.executable, [sys.executable, '-c', {ENDING!r}])\n")
    subprocess.run([sys.executable, "-c", orphan_code], env=env, check=True, timeout=60)
    deadline = time.time() + 60
    while time.time() < deadline:  # the orphan's output is complete when it names how it ended
        text = out.read_text() if out.exists() else ""
        if "ended" in text or "ERROR" in text:
            time.sleep(0.5)
            return subprocess.CompletedProcess([], 0, out.read_text(), "")
        time.sleep(0.1)
    raise AssertionError(f"the orphaned rank said nothing: {text!r}")


def test_open_mpi_rank_whose_server_is_gone_ends_with_one_line(tmp_path):
    pid = _dead_pid()
    env = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_SERVER_TMPDIR": f"/tmp/ompi.vm.0/pid.{pid}"}
    proc = _run(env, orphan=True, tmp_path=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if "ERROR" in line]
    assert "watched" not in proc.stdout and len(lines) == 1, proc.stdout
    assert f"the launcher (mpirun, PID {pid}) is gone before this rank" in lines[0], proc.stdout
    # the same server gone while this rank's parent still runs (not init's child): nothing is decided at start
    assert "watched" in _run(env).stdout


def test_torchrun_worker_orphaned_before_it_looks_ends(tmp_path):
    proc = _run({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0"}, orphan=True, tmp_path=tmp_path)
    assert "(torchrun, its agent: this worker is now a child of init)" in proc.stdout, proc.stdout
    assert "watched" not in proc.stdout


def test_a_run_started_by_hand_is_not_ended(tmp_path):
    proc = _run({"RANK": "0", "LOCAL_RANK": "0"}, orphan=True, tmp_path=tmp_path)  # set by hand, its shell gone
    assert "watched False" in proc.stdout and "ended" in proc.stdout and "ERROR" not in proc.stdout, proc.stdout
