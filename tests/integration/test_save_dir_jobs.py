"""No job loses another's work, with real jobs under torchrun and mpirun (megatron_ru/checkpointing/save_dir.py,
megatron_ru/parallel/launcher_watch.py):

* a ``--load DIR --save DIR`` whose pointer is gone refuses (it used to start from scratch and replace the
  checkpoint), and ``--ckpt-step N`` resumes iteration N without the pointer;
* two jobs started together on one ``--save``: one trains, the other refuses naming the holder;
* a job SIGKILLed with everything it runs leaves a lock that the next job takes over, and the
  leftovers of its interrupted save are removed before the next job resumes;
* a launcher killed with SIGKILL, at start-up and mid-run, takes its ranks with it within seconds, and no
  checkpoint is written after it died.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_ru.checkpointing.save_dir import LOCK_FILE
from tests.integration._train_helpers import REPO, make_corpus, tiny_argv, trained_iterations
from tests.integration.test_fault_hangs import Job, _command, _env, _error_lines, _no_traceback_of_ours, rank_pids

pytestmark = pytest.mark.slow

POINTER = "latest_checkpointed_iteration.txt"
#: a rank must be gone this long after its launcher died (the watcher checks once a second)
ORPHAN_LIMIT_S = 15


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("corpus")
    return make_corpus(str(d)), str(d / "cache")


def _argv(corpus, *extra: str, iters: int = 6, seed: int = 7) -> list[str]:
    argv = tiny_argv(*corpus, iters=iters, extra=["--eval-iters", "0", "--distributed-timeout-minutes", "1", *extra])
    argv[argv.index("--seed") + 1] = str(seed)
    return argv


class Job2(Job):
    """A 2-rank job (test_fault_hangs.Job starts 4)."""

    def __init__(self, launcher: str, argv: list[str], log: Path) -> None:
        self.launcher, self.log = launcher, log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(_command(launcher, argv, 2), cwd=REPO, env=_env(), stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)


def _run(launcher: str, argv: list[str], log: Path, limit_s: float = 240, nproc: int = 2) -> tuple[int, str]:
    with open(log, "w") as out:
        proc = subprocess.run(_command(launcher, argv, nproc), cwd=REPO, env=_env(), stdout=out,
                              stderr=subprocess.STDOUT, timeout=limit_s)
    return proc.returncode, log.read_text(errors="replace")


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under ``path``."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus) -> Path:
    """A 2-rank (DP 2, ZeRO 1) checkpoint at iteration 4."""
    save = tmp_path_factory.mktemp("base") / "ckpt"
    code, text = _run("torchrun", _argv(corpus, "--zero-stage", "1", "--save", str(save), "--exit-interval", "4"),
                      save.parent / "out.txt")
    assert code == 0 and (save / POINTER).read_text().strip() == "4", text[-3000:]
    return save


@pytest.mark.timeout(600)
def test_a_missing_pointer_never_lets_a_job_overwrite_the_checkpoint(corpus, checkpoint, tmp_path):
    """Was: "no latest_checkpointed_iteration.txt: starting from scratch", exit 0, iter_0000004 replaced."""
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run)
    (run / POINTER).unlink()
    before = _tree(run)
    argv = _argv(corpus, "--zero-stage", "1", "--load", str(run), "--save", str(run), "--save-interval", "2")
    code, text = _run("torchrun", argv, tmp_path / "refused.txt")
    lines = _error_lines(text)
    assert code == 1 and "exitcode  : 2" in text and len(lines) == 1, text[-4000:]
    assert f"--load {run} is also --save and holds iter_0000004 but no {POINTER}" in lines[0]
    assert "pass --ckpt-step N to resume iteration N (4 is the newest)" in lines[0], lines[0]
    _no_traceback_of_ours(text)
    assert _tree(run) == before  # nothing written, nothing removed, no lock left
    # --ckpt-step names the iteration: the run resumes it (under mpirun, the other launcher) and continues
    metrics = tmp_path / "m.jsonl"
    code, text = _run("mpirun", [*argv, "--ckpt-step", "4", "--metrics-file", str(metrics)], tmp_path / "resumed.txt")
    assert code == 0, text[-4000:]
    iters = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()
             if json.loads(line).get("type") == "train"]
    assert iters == [5, 6], iters
    assert (run / POINTER).read_text().strip() == "6" and (run / "iter_0000004" / "metadata.json").is_file()
    assert not (run / LOCK_FILE).exists()


@pytest.mark.timeout(600)
def test_two_jobs_on_one_save_directory_one_refuses_and_a_killed_jobs_lock_is_taken_over(corpus, tmp_path):
    """Was: both exit 0, every iter_* and the pointer hold whichever saved last."""
    save = tmp_path / "shared"
    jobs = [Job2("torchrun", _argv(corpus, "--save", str(save), "--save-interval", "2", "--seed", str(seed),
                                  "--metrics-file", str(tmp_path / f"m{seed}.jsonl")), tmp_path / f"job{seed}.txt")
            for seed in (11, 12)]
    try:
        codes = [job.wait(300, time.time(), "start") for job in jobs]
    finally:
        for job in jobs:
            job.close()
    texts = [job.text() for job in jobs]
    assert sorted(codes) == [0, 1], (codes, [t[-2000:] for t in texts])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    lines = _error_lines(texts[loser])
    assert len(lines) == 1 and f"--save {save} is in use by another job (PID " in lines[0], texts[loser][-3000:]
    assert "it holds the lock now" in lines[0] and "exitcode  : 2" in texts[loser]
    seed = (11, 12)[winner]
    meta = json.loads((save / "iter_0000006" / "metadata.json").read_text())
    assert meta["args"]["training"]["seed"] == seed  # the checkpoint is the winner's alone
    assert not (tmp_path / f"m{(11, 12)[loser]}.jsonl").exists()
    assert not (save / LOCK_FILE).exists()

    # a job killed with every process it has (scheduler's SIGKILL): its lock stays, the next job takes it over
    metrics = tmp_path / "killed.jsonl"
    job = Job2("torchrun", _argv(corpus, "--load", str(save), "--save", str(save), "--save-interval", "1",
                                "--metrics-file", str(metrics), iters=100000), tmp_path / "killed.txt")
    try:
        job.wait_for(lambda: trained_iterations(metrics) >= 3, 240, "3 iterations trained")
        for pid in [job.proc.pid, *rank_pids(str(tmp_path)).values()]:
            os.kill(pid, signal.SIGKILL)
    finally:
        job.close()
    holder = json.loads((save / LOCK_FILE).read_text())
    pointer = int((save / POINTER).read_text())
    partial = save / f"iter_{pointer + 1:07d}"  # what a save killed before its metadata leaves behind
    partial.mkdir(exist_ok=True)
    # the kill can land between a save's metadata.json and its pointer: that iteration is then complete and kept
    # (by design, see remove_leftovers); take its metadata away so that it is the half-written save described here
    (partial / "metadata.json").unlink(missing_ok=True)
    (partial / "layer_01-model_00-model_states.pt.tmp").write_bytes(b"half a file")
    (save / f"{POINTER}.tmp.{holder['pid']}").write_text(f"{pointer + 1}\n")
    code, text = _run("torchrun", _argv(corpus, "--load", str(save), "--save", str(save), iters=pointer + 2),
                      tmp_path / "after.txt")
    assert code == 0, text[-4000:]
    assert f"took over {save / LOCK_FILE} from a job that ended without releasing it (PID {holder['pid']}" in text
    assert (f"removed what interrupted saves left in {save}: iter_{pointer + 1:07d}, {POINTER}.tmp.{holder['pid']}"
            in text), text[-3000:]
    assert (save / POINTER).read_text().strip() == str(pointer + 2)
    assert not (save / f"iter_{pointer + 1:07d}").exists()  # removed, not saved again (no --save-interval)
    assert (save / f"iter_{pointer + 2:07d}" / "metadata.json").is_file()
    assert not (save / LOCK_FILE).exists() and not list(save.rglob("*.tmp*"))


def _complete(save: Path) -> set[str]:
    return {p.parent.name for p in save.glob("iter_*/metadata.json")}


def _watch_ranks_end(job: Job, tag: str, save: Path) -> None:
    """SIGKILL the launcher alone; every rank must be gone within ORPHAN_LIMIT_S. Between the kill and the
    watcher's next check (1 s) a save in flight may complete; nothing is written after that."""
    pids = rank_pids(tag)
    assert sorted(pids) == [0, 1], pids
    before = _complete(save)
    os.kill(job.proc.pid, signal.SIGKILL)
    killed = time.time()
    while time.time() < killed + ORPHAN_LIMIT_S and any(_running(p) for p in pids.values()):
        time.sleep(0.2)
    alive = {r: p for r, p in pids.items() if _running(p)}
    assert not alive, f"ranks {sorted(alive)} still run {ORPHAN_LIMIT_S} s after the launcher died:\n{job.text()[-3000:]}"
    assert len(_complete(save) - before) <= 1, (sorted(before), sorted(_complete(save)))
    settled = (_complete(save), sorted(p.name for p in save.glob("*")) if save.exists() else [])
    time.sleep(3)
    assert (_complete(save), sorted(p.name for p in save.glob("*")) if save.exists() else []) == settled


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ("mpirun", "torchrun"))
@pytest.mark.parametrize("when", ("startup", "training"))
def test_killing_the_launcher_ends_every_rank(launcher, when, corpus, tmp_path):
    """Was: SIGKILL to mpirun (or torchrun) left the ranks training to the end and saving into --save."""
    save = tmp_path / "save"
    metrics = tmp_path / "m.jsonl"
    job = Job2(launcher, _argv(corpus, "--save", str(save), "--save-interval", "1", "--metrics-file", str(metrics),
                               iters=100000), tmp_path / "out.txt")
    try:
        if when == "startup":  # the ranks exist and are importing torch: no process group yet
            job.wait_for(lambda: len(rank_pids(str(tmp_path))) == 2, 60, "both ranks' processes")
            time.sleep(1.0)
        else:
            job.wait_for(lambda: trained_iterations(metrics) >= 2, 240, "2 iterations trained")
        _watch_ranks_end(job, str(tmp_path), save)
    finally:
        job.close()
    if launcher == "torchrun":  # torchrun's workers write to the job's output themselves (mpirun's pipes die with it)
        # a rank says why it ends: its watcher, its save (checked before a commit), or its lost rendezvous store
        said = [line for line in job.text().splitlines() if f"the launcher (torchrun, PID {job.proc.pid}) is gone" in line
                or "lost the torchrun agent" in line]
        assert said, job.text()[-3000:]
