"""scripts/slurm/*.sbatch submitted with a real `sbatch` to a real one-node Slurm.

The node advertises two fake GPUs (count-only GRES), so `--gres=gpu:2` is accepted; the ranks
run on CPU with gloo. pyxis/enroot are not installed: submit_pyxis.sbatch runs without
CONTAINER_IMAGE, i.e. plain `srun` (its container flags are checked in test_scripts_dry_run).
1. submit_pyxis.sbatch: srun starts one task per "GPU"; ranks from SLURM_*; trains and saves;
2. submit_torchrun.sbatch: one torchrun per node with a c10d rendezvous on the head node,
   submitted with a short --time and more iterations than fit: it resumes from the first
   job's checkpoint and the --exit-duration-in-mins derived from the time left makes it save
   and exit 0 before Slurm's limit (test_abci_qsub shows such a checkpoint resumes).
"""
from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from tests.integration.schedulers.fixtures import REPO, slurm_cluster, tiny_corpus  # noqa: F401
from tests.integration.schedulers.slurm import is_final
from tests.integration.schedulers.system import run, wait_for
from tests.integration.schedulers.training import (check_fresh_run, check_ranks, check_resumed, job_env,
                                                   latest_iteration, train_records)

pytestmark = pytest.mark.slow  # a real Slurm, installed when absent

#: a hang guard, not a speed limit: beside the suite's other workers and a CPU hog (load ~19 on 2 cores) two ranks
#: were still importing torch 150 s after the job started
JOB_TIMEOUT = 500


def sbatch(cluster, script: str, env: dict[str, str], log: Path, time_limit: str = "10:00",
           extra: tuple[str, ...] = ()) -> int:
    # one node with two GPUs instead of the script's production allocation
    return cluster.sbatch(["--nodes=1", "--gres=gpu:2", f"--time={time_limit}", f"--output={log}",
                           *(["--ntasks-per-node=2"] if "pyxis" in script else []), *extra, script],
                          cwd=REPO, env=env)


def finish(cluster, job_id: int, script: str, log: Path, timeout: float = JOB_TIMEOUT) -> str:
    """Wait for the job's end; it must be COMPLETED. Its log."""
    try:
        state = cluster.wait(job_id, timeout)
    except TimeoutError as e:
        raise AssertionError(f"{e}; the job's log ends:\n{log.read_text()[-8000:] if log.exists() else ''}") from None
    text = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job_id} ({script}) ended {state} " \
                                 f"(exit {cluster.exit_code(job_id)}):\n{text[-4000:]}"
    return text


def submit(cluster, script: str, env: dict[str, str], log: Path, time_limit: str = "10:00",
           extra: tuple[str, ...] = (), timeout: float = JOB_TIMEOUT) -> str:
    return finish(cluster, sbatch(cluster, script, env, log, time_limit, extra), script, log, timeout)


@pytest.mark.slow
def test_slurm_srun_then_torchrun_resume(slurm_cluster, tiny_corpus, tmp_path):  # noqa: F811
    save = tmp_path / "checkpoints"
    m1, m2 = tmp_path / "metrics_1.jsonl", tmp_path / "metrics_2.jsonl"

    # 8 iterations well inside the time left: the default margin left ~60 s, which a CPU hog's start-up used up
    log = submit(slurm_cluster, "scripts/slurm/submit_pyxis.sbatch",
                 job_env(tiny_corpus, save, m1, 8, extra={"EXIT_MARGIN_SECONDS": "120"}), tmp_path / "job1.log")
    first = check_fresh_run(log, m1, save, 8)
    check_ranks(log, save, "slurm")
    assert "1 node(s) x 2 GPU(s), head " in log
    assert "--container-image" not in log  # no image given: plain srun

    # --time=4: about 240 s left at start, 225 s kept for start-up, save and exit; 15 s is below the tenth of the limit
    # a short job keeps for training, so ~24 s of training (with 105 s of a 2-minute limit, beside a CPU hog, start-up
    # alone took more than the limit)
    env = job_env(tiny_corpus, save, m2, 100000, extra={"EXIT_MARGIN_SECONDS": "225", "SAVE_INTERVAL": "100000"})
    log = submit(slurm_cluster, "scripts/slurm/submit_torchrun.sbatch", env, tmp_path / "job2.log", time_limit="4")
    second = check_resumed(log, m2, save, 8, first)
    assert re.search(r"--exit-duration-in-mins 0\.(3[89]|40)\b", log), log[-3000:]  # ~240 s / 10 / 60
    assert "exiting at iteration" in log and "--exit-duration-in-mins" in log.split("exiting at iteration")[1]
    assert latest_iteration(save) == second[-1]["iteration"] > 8
    check_ranks(log, save, "torchrun")
    assert "--rdzv-backend=c10d" in log


def test_slurm_dry_run_inside_a_real_job(slurm_cluster, tmp_path):  # noqa: F811
    """What the scripts derive from a real allocation: GPUs per node from --gres=gpu:2, the head
    node from `scontrol show hostnames`, the port from the job id, the exit duration from the time
    left (30 min - 900 s margin)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "DRY_RUN": "1",
           "SAVE_DIR": str(tmp_path / "ckpt")}
    host = socket.gethostname()
    for script, ntasks in (("scripts/slurm/submit_pyxis.sbatch", 2), ("scripts/slurm/submit_torchrun.sbatch", 1)):
        log = tmp_path / f"{Path(script).stem}.log"
        job_id = slurm_cluster.sbatch(["--nodes=1", f"--ntasks-per-node={ntasks}", "--gres=gpu:2", "--time=30",
                                       f"--output={log}", script], cwd=REPO, env=env)
        assert slurm_cluster.wait(job_id, 60) == "COMPLETED", log.read_text()
        text = log.read_text()
        cmd = [ln for ln in text.splitlines() if ln.startswith("srun ")][0].split()
        minutes = float(cmd[cmd.index("--exit-duration-in-mins") + 1])
        assert 14.9 <= minutes <= 15.0, minutes
        assert f"head {host}, master {host}:{15000 + job_id % 16384}" in text
        if ntasks == 2:
            assert cmd[:6] == ["srun", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks-per-node=2", "--ntasks=2",
                               "--cpus-per-task=1"]
        else:
            t = cmd.index("torchrun")
            assert cmd[t + 1:t + 6] == ["--nnodes=1", "--nproc-per-node=2", f"--rdzv-id={job_id}",
                                        "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{15000 + job_id % 16384}"]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain TEXT (a test's own temporary path)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmd:
            found.append(f"{proc.name}: {cmd[:200]}")
    return found


@pytest.mark.slow
def test_slurm_torchrun_signal_saves_and_ends(slurm_cluster, tiny_corpus, tmp_path):  # noqa: F811
    """Slurm's warning before the time limit (sbatch --signal=B:USR1@T) is SIGUSR1 to the job's batch shell; here
    `scancel --batch --signal=USR1` sends it so, once training runs. The job shell passes it to srun, srun to
    torchrun, torchrun (told to handle it with --signals-to-handle) to its workers, which save at the next iteration
    and exit; torchrun then reports 1, but the checkpoint completed after the signal makes the job COMPLETED. No
    worker outlives the job. (Before, torchrun died of SIGUSR1 and its workers, orphaned, trained on.) The moment
    is the test's: with --signal=B:USR1@150 of --time=4, beside a CPU hog, it came while torchrun was still
    importing torch, before it handled the signal (the window a job with a short limit has)."""
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    env = job_env(tiny_corpus, save, metrics, 100000, extra={"EXIT_MARGIN_SECONDS": "30", "SAVE_INTERVAL": "100000"})
    script, log_path = "scripts/slurm/submit_torchrun.sbatch", tmp_path / "job.log"
    job_id = sbatch(slurm_cluster, script, env, log_path, time_limit="10")

    def training() -> bool:
        if is_final(slurm_cluster.state(job_id)):
            raise AssertionError(f"job {job_id} ended before it trained:\n{log_path.read_text()[-4000:]}")
        return bool(train_records(metrics))
    try:
        wait_for(training, JOB_TIMEOUT, f"job {job_id}'s first iteration", interval=1.0)
    except TimeoutError as e:
        stacks = slurm_cluster.dump_stacks(job_id)
        run(["scancel", str(job_id)], check=False)
        raise AssertionError(f"{e}{stacks}; the job's log ends:\n{log_path.read_text()[-8000:]}") from None
    run(["scancel", "--batch", "--signal=USR1", str(job_id)])
    log = finish(slurm_cluster, job_id, script, log_path)
    assert "signal received: asking every rank to save and exit" in log, log[-3000:]
    stop = re.search(r"exiting at iteration (\d+): exit signal", log)
    assert stop, log[-3000:]
    assert latest_iteration(save) == int(stop.group(1)) >= 1
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2" in log
    assert "after it: ending with status 0" in log, log[-3000:]
    check_ranks(log, save, "torchrun")
    deadline = time.monotonic() + 15
    while processes_mentioning(str(save)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(str(save)), processes_mentioning(str(save))
