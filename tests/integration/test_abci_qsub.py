"""scripts/abci/*.sh submitted with a real `qsub` to a real Grid Engine configured like ABCI.

Two jobs on one node with two "GPUs" (CPU ranks under mpirun, gloo):
1. submit_multinode.sh, with a short h_rt and far more iterations than fit, trains from
   scratch; the --exit-duration-in-mins derived from h_rt makes it save a checkpoint and exit 0
   before Grid Engine would kill it;
2. submit_single_node.sh, submitted again, resumes from that checkpoint and finishes.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.integration.schedulers.fixtures import REPO, grid_engine, tiny_corpus  # noqa: F401
from tests.integration.schedulers.gridengine import SGE_CELL, SGE_ROOT, QSUB_WRAPPER_DIR
from tests.integration.schedulers.training import (check_fresh_run, check_ranks, check_resumed, job_env,
                                                   latest_iteration)

pytestmark = pytest.mark.slow  # a real Grid Engine, installed when absent

#: a hang guard, not a speed limit: beside the suite's other workers and a CPU hog (load ~19 on 2 cores) a Slurm job's
#: two ranks were still importing torch 150 s after the job started
JOB_TIMEOUT = 500
SHORT_H_RT = 360  # seconds; the job must save and exit 0 before Grid Engine kills it: 90 s to train after the
#                   270 s margin (with 20 s, start-up alone took 18 s beside the suite's other workers and left one
#                   iteration, too few to see the loss fall; with an 80 s margin, beside a CPU hog, start-up,
#                   save and exit did not fit and Grid Engine killed the job at h_rt; with 50 s to train, the two
#                   ranks' start-up beside the suite's three workers took 48 s and left one iteration, twice; the
#                   margin covers a start-up of minutes: the training time, not the limit, sets the job's length)
EXIT_MARGIN = 270


def submit(ge, script: str, env: dict[str, str], log: Path, h_rt: str = "0:10:00") -> tuple[dict, str, float]:
    start = time.monotonic()
    job_id = ge.qsub(["-g", "ci-group", "-V", "-l", "rt_F=1", "-l", f"h_rt={h_rt}", "-o", str(log), script],
                     cwd=REPO, env=env)
    try:
        acct = ge.wait(job_id, JOB_TIMEOUT)
    except TimeoutError as e:
        raise AssertionError(f"{e}; the job's log ends:\n{log.read_text()[-8000:] if log.exists() else ''}") from None
    text = log.read_text() if log.exists() else ""
    assert acct.get("failed", "").split()[0] == "0" and acct.get("exit_status") == "0", \
        f"job {job_id} ({script}) failed: failed={acct.get('failed')} exit_status={acct.get('exit_status')}\n{text[-4000:]}"
    return acct, text, time.monotonic() - start


@pytest.mark.slow
def test_abci_train_time_limit_and_resume(grid_engine, tiny_corpus, tmp_path):  # noqa: F811
    save = tmp_path / "checkpoints"
    base = {"SGE_ROOT": str(SGE_ROOT), "SGE_CELL": SGE_CELL}

    def env(step: int, iters: int, **extra: str) -> tuple[dict[str, str], Path]:
        metrics = tmp_path / f"metrics_{step}.jsonl"
        e = job_env(tiny_corpus, save, metrics, iters, extra=extra, base=base)
        e["PATH"] = f"{QSUB_WRAPPER_DIR}:{e['PATH']}"  # qsub that accepts -g GROUP, as on ABCI
        return e, metrics

    # 1. from scratch, killed by its time limit unless it saves and exits first; no periodic
    #    saves: the only checkpoint is the one the exit path writes
    e, metrics = env(1, 100000, EXIT_MARGIN_SECONDS=str(EXIT_MARGIN), SAVE_INTERVAL="100000")
    acct, log, _ = submit(grid_engine, "scripts/abci/submit_multinode.sh", e, tmp_path / "job1.log",
                          h_rt=f"0:0:{SHORT_H_RT}")
    first = check_fresh_run(log, metrics, save)
    check_ranks(log, save, "openmpi")
    assert "1 node(s) x 2 GPU(s) (rt_F)" in log
    # h_rt read back from the job (the script's own line says 24:00:00): (360 s - 270 s) / 60
    assert f"h_rt={SHORT_H_RT}" in log and "--exit-duration-in-mins 1.50" in log, log[-3000:]
    assert "exiting at iteration" in log and "--exit-duration-in-mins" in log.split("exiting at iteration")[1]
    assert float(acct["ru_wallclock"].rstrip("s")) < SHORT_H_RT
    stopped_at = latest_iteration(save)

    # 2. the checkpoint it left is resumable: a second submission (the single-node script) resumes. Its 10 minutes
    #    with the default 15-minute exit margin would leave a tenth of them (--exit-duration-in-mins 1.0) to train:
    #    beside a CPU hog the two ranks' start-up took that long and the job saved and exited after one iteration
    e, metrics = env(2, stopped_at + 2, EXIT_MARGIN_SECONDS="60")
    _, log, _ = submit(grid_engine, "scripts/abci/submit_single_node.sh", e, tmp_path / "job2.log")
    second = check_resumed(log, metrics, save, stopped_at, first)
    assert [r["iteration"] for r in second] == [stopped_at + 1, stopped_at + 2]
    assert latest_iteration(save) == stopped_at + 2
    check_ranks(log, save, "openmpi")


def test_abci_dry_run_inside_a_real_job(grid_engine, tmp_path):  # noqa: F811
    """What the script derives from a real Grid Engine job: GPUs per node from the rt_F request
    (read back with qstat -j), h_rt from the command line, hosts from $SGE_JOB_HOSTLIST, the
    port from the job id."""
    env = {"PATH": f"{QSUB_WRAPPER_DIR}:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "SGE_ROOT": str(SGE_ROOT), "SGE_CELL": SGE_CELL, "DRY_RUN": "1", "SAVE_DIR": str(tmp_path / "ckpt")}
    log = tmp_path / "dry.log"
    job_id = grid_engine.qsub(["-g", "ci-group", "-V", "-l", "rt_F=1", "-l", "h_rt=2:00:00", "-o", str(log),
                               "scripts/abci/submit_multinode.sh"], cwd=REPO, env=env)
    acct = grid_engine.wait(job_id, 60)
    assert acct["exit_status"] == "0", log.read_text()
    lines = [ln for ln in log.read_text().splitlines() if not ln.startswith("[launch]")]
    host = socket.gethostname()
    assert lines[:6] == [f"MASTER_ADDR={host}", f"MASTER_PORT={15000 + job_id % 16384}", lines[2],
                         f"{host} slots=4", "# command", lines[5]]
    cmd = lines[5].split()
    assert cmd[:5] == ["mpirun", "-np", "4", "-npernode", "4"]
    assert cmd[cmd.index("--exit-duration-in-mins") + 1] == "105.00"  # (7200 s - 900 s) / 60


def test_harness_enforces_h_rt(grid_engine, tmp_path):  # noqa: F811
    """Control for the time-limit test above: a job that ignores its h_rt really is killed."""
    script = tmp_path / "sleeper.sh"
    script.write_text("#!/bin/bash\nsleep 60\n")
    script.chmod(0o755)
    job_id = grid_engine.qsub(["-g", "ci-group", "-l", "rt_F=1", "-l", "h_rt=0:0:3", "-o", "/dev/null", str(script)],
                              cwd=tmp_path, env=grid_engine.submit_env())
    acct = grid_engine.wait(job_id, 60)
    assert acct["exit_status"].startswith("137") and "h_rt" in acct["failed"], acct
    assert float(acct["ru_wallclock"].rstrip("s")) < 30
