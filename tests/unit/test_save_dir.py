"""The --save directory's guard (megatron_ru/checkpointing/save_dir.py): the lock against a second job, the
refusal to overwrite checkpoints a run does not continue, the leftovers of killed saves, and the pointer's
errors. Real processes hold the lock here; the end-to-end jobs are in
tests/integration/test_save_dir_jobs.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_ru.checkpointing import save_dir as sd
from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.meta import TRACKER_FILE, pointed_checkpoint
from megatron_ru.flags.checkpoint_args import read_checkpoint_meta
from megatron_ru.utils.processes import start_time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HOLDER = """
import sys, time
from megatron_ru.checkpointing.save_dir import SaveDirLock
SaveDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(save: str, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, save], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO, **env})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _complete(save, it: int) -> None:
    d = save / f"iter_{it:07d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "metadata.json").write_text(json.dumps({"iteration": it}))


def _no_job_env(monkeypatch) -> None:
    for var in sd.JOB_ID_VARS:
        monkeypatch.delenv(var, raising=False)


def test_a_second_job_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(tmp_path, monkeypatch):
    _no_job_env(monkeypatch)
    save = str(tmp_path / "run")
    proc = _holder(save)
    try:
        with pytest.raises(sd.SaveDirBusy) as e:
            sd.SaveDirLock(save).acquire()
        msg = str(e.value)
        assert msg.startswith(f"--save {save} is in use by another job (PID {proc.pid} on {socket.gethostname()}")
        assert "it holds the lock now" in msg and f"remove {os.path.join(save, sd.LOCK_FILE)}" in msg
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # the holder died without releasing it: its record stays, the flock is gone
    assert json.load(open(os.path.join(save, sd.LOCK_FILE)))["pid"] == proc.pid
    lock = sd.SaveDirLock(save).acquire()
    assert lock.note.startswith(f"took over {os.path.join(save, sd.LOCK_FILE)} from a job that ended without "
                                f"releasing it (PID {proc.pid} on {socket.gethostname()}")
    record = json.load(open(lock.path))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["pid_start"] == start_time(os.getpid())
    lock.release()
    assert not os.path.exists(lock.path)  # a released lock leaves nothing behind
    assert sd.SaveDirLock(save).acquire().note is None


def test_a_lock_recorded_on_another_host_is_refused_with_its_age(tmp_path, monkeypatch):
    _no_job_env(monkeypatch)
    save = tmp_path / "run"
    save.mkdir()
    now = time.time()
    for beat, says in ((now - 30, "it was refreshed 30 s ago; its host is another machine"),
                       (now - 3600, "it was last refreshed 60 min ago (a running job refreshes it every 60 s), so "
                                    "that job is almost certainly gone")):
        (save / sd.LOCK_FILE).write_text(json.dumps({"host": "node-b17", "pid": 4242, "job": "SLURM_JOB_ID=77",
                                                     "started": now - 7200, "heartbeat": beat}))
        with pytest.raises(sd.SaveDirBusy) as e:
            sd.SaveDirLock(str(save)).acquire()
        assert "(PID 4242 on node-b17, job SLURM_JOB_ID=77, started " in str(e.value)
        assert says in str(e.value), str(e.value)
        assert str(e.value).endswith(f"if that job is no longer running, remove {save / sd.LOCK_FILE}")
    # the same job id (a requeued Slurm job on another node) takes it over
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    lock = sd.SaveDirLock(str(save)).acquire()
    assert "from an earlier run of this job (PID 4242 on node-b17" in lock.note
    lock.release()


def test_a_reused_pid_is_not_a_holder(tmp_path, monkeypatch):
    """The recorded PID runs, but it is another process (its start time differs): the holder is gone."""
    _no_job_env(monkeypatch)
    save = tmp_path / "run"
    save.mkdir()
    (save / sd.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                 "pid_start": "1", "started": time.time(), "heartbeat": time.time()}))
    lock = sd.SaveDirLock(str(save)).acquire()
    assert "took over" in lock.note
    lock.release()


def test_two_processes_racing_for_the_lock_one_wins(tmp_path):
    save = str(tmp_path / "run")
    # the winner holds the lock until the other three have tried (it once held it 3 s: a racer whose start-up
    # beside a loaded suite took longer found it released and won too)
    racer = ("import glob, os, sys, time\nfrom megatron_ru.checkpointing.save_dir import SaveDirLock, SaveDirBusy\n"
             "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
             "done = os.path.join(sys.argv[3], f'{os.getpid()}.done')\n"
             "try:\n    SaveDirLock(sys.argv[1]).acquire(); print('won', flush=True); open(done, 'w').close()\n"
             "    end = time.time() + 60\n"
             "    while len(glob.glob(os.path.join(sys.argv[3], '*.done'))) < 4 and time.time() < end:\n"
             "        time.sleep(0.05)\n"
             "except SaveDirBusy:\n    print('refused', flush=True); open(done, 'w').close()\n")
    at = str(time.time() + 4)
    (tmp_path / "done").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", racer, save, at, str(tmp_path / "done")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
             for _ in range(4)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["refused", "refused", "refused", "won"], outs


def test_checkpoints_a_run_does_not_continue_are_never_overwritten(tmp_path):
    save = tmp_path / "run"
    assert sd.overwrite_problem(str(save), str(save), None) is None  # nothing there: resume-or-start
    _complete(save, 10)
    (save / "iter_0000020").mkdir()  # a killed save: not a checkpoint
    # the pointer deleted, --load is --save: was "starting from scratch" and iter_0000010 replaced
    problem = sd.overwrite_problem(str(save), str(save), None)
    assert problem == (f"--load {save} is also --save and holds iter_0000010 but no {TRACKER_FILE} (it was deleted, "
                       f"or copied without it): this run would start from scratch and overwrite them. To continue, "
                       f"pass --ckpt-step N to resume iteration N (10 is the newest), give another --save, or move "
                       f"those directories away to start over")
    assert sd.overwrite_problem(str(save), str(save), 10) is None  # --ckpt-step 10 says where to continue
    # another --load (or none) writing into a --save that holds checkpoints
    for load in (str(tmp_path / "base"), None):
        problem = sd.overwrite_problem(str(save), load, None)
        assert problem.startswith(f"--save {save} holds iter_0000010 (pointer: none) that this run, starting from "
                                  f"{'--load ' + load if load else 'no --load'}, does not continue"), problem
        assert f"pass --load {save}" in problem
    (save / TRACKER_FILE).write_text("10\n")
    assert sd.overwrite_problem(str(save), str(save), None) is None
    _complete(save, 15)
    problem = sd.overwrite_problem(str(save), str(save), 10)
    assert problem.startswith(f"--ckpt-step 10 resumes iteration 10 of --load {save}, which is also --save and holds "
                              f"later checkpoints (iter_0000015)"), problem


def test_leftovers_of_killed_saves_are_removed_and_nothing_else(tmp_path):
    save = tmp_path / "run"
    for it in (5, 10, 20):
        _complete(save, it)
    (save / TRACKER_FILE).write_text("10\n")
    for it in (3, 12, 14):  # 3: older than the pointer (kept); 12, 14: killed saves after it
        (save / f"iter_{it:07d}").mkdir()
        (save / f"iter_{it:07d}" / "layer_01-model_00-model_states.pt.tmp").write_bytes(b"x")
    (save / f"{TRACKER_FILE}.tmp.4242").write_text("12\n")
    (save / "metrics.jsonl").write_text("{}\n")
    removed = sd.remove_leftovers(str(save))
    assert sorted(os.path.relpath(p, save) for p in removed) == [
        "iter_0000012", "iter_0000014", f"{TRACKER_FILE}.tmp.4242"]
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000005", "iter_0000010", "iter_0000020",
                                        TRACKER_FILE, "metrics.jsonl"]
    assert sd.remove_leftovers(str(save)) == []
    # no complete checkpoint at all (the first save was killed): everything incomplete goes
    first = tmp_path / "first"
    (first / "iter_0000004").mkdir(parents=True)
    assert [os.path.basename(p) for p in sd.remove_leftovers(str(first))] == ["iter_0000004"]


def test_claim_refuses_and_releases(tmp_path, monkeypatch):
    _no_job_env(monkeypatch)
    save = tmp_path / "run"
    _complete(save, 10)
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        sd.claim_save_dir(str(save), str(save), None)
    assert not (save / sd.LOCK_FILE).exists()  # a refused run holds nothing
    lock = sd.claim_save_dir(str(save), str(save), 10)
    assert sd.claim_save_dir(str(save), str(save), 10) is not lock  # a second run in this process replaces it
    sd.release_all()
    assert not (save / sd.LOCK_FILE).exists()


def test_a_pointer_to_no_checkpoint_says_what_it_said(tmp_path):
    """Was: "iter_0000001/metadata.json is missing" for a pointer cut from "10" to "1"."""
    save = tmp_path / "run"
    _complete(save, 5)
    _complete(save, 10)
    (save / TRACKER_FILE).write_text("1")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint_meta(str(save))
    assert str(e.value) == (f"{save / TRACKER_FILE} says 1, but {save / 'iter_0000001'} does not exist; the complete "
                            f"checkpoints there are iterations 5, 10: write one of them into {save / TRACKER_FILE} "
                            f"(or pass --ckpt-step N), or point --load elsewhere")
    (save / "iter_0000001").mkdir()
    with pytest.raises(CheckpointError, match=r"says 1, but .*iter_0000001 is incomplete \(no metadata.json: its "
                                              r"save never finished\)"):
        read_checkpoint_meta(str(save))
    with pytest.raises(CheckpointError, match=r"^--ckpt-step 7 asks for iteration 7, but .*iter_0000007 does not"):
        read_checkpoint_meta(str(save), 7)
    assert pointed_checkpoint(str(save), 5) == (5, str(save / "iter_0000005"))


def test_load_without_save_and_without_the_pointer_names_the_complete_checkpoints(tmp_path):
    from megatron_ru.training.checkpoint import missing_checkpoint_problem
    load = tmp_path / "ckpt"
    _complete(load, 4)
    _complete(load, 8)
    assert missing_checkpoint_problem(str(load), False, None) == (
        f"--load {load} holds complete checkpoints (iter_0000004, iter_0000008) but no {TRACKER_FILE} (it was "
        f"deleted, or copied without it): pass --ckpt-step N to load iteration N (8 is the newest), or write its "
        f"number into {load / TRACKER_FILE}")
    assert missing_checkpoint_problem(str(tmp_path / "empty"), False, str(tmp_path / "empty")) is None


def test_a_dead_holders_children_holding_the_lock_are_waited_for(tmp_path, monkeypatch):
    """Rank 0 SIGKILLed: its forked data-loader workers keep the flock for a moment; the next job waits for them."""
    _no_job_env(monkeypatch)
    save = str(tmp_path / "run")
    forker = ("import os, sys, time\nfrom megatron_ru.checkpointing.save_dir import SaveDirLock\n"
              "SaveDirLock(sys.argv[1]).acquire()\n"
              "if os.fork() == 0:\n    time.sleep(3)\n    os._exit(0)\n"
              "print('held', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", forker, save], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert proc.stdout.readline().strip() == "held"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.monotonic()
    with pytest.raises(sd.SaveDirBusy, match="that process is gone, but processes it started still hold the lock"):
        sd.SaveDirLock(save).acquire(orphan_wait_s=0.5)
    lock = sd.SaveDirLock(save).acquire()  # the child ends within 3 s
    assert "took over" in lock.note and time.monotonic() - started < 10
    lock.release()
