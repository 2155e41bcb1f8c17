"""Acceptance 4 and 5: every launcher trains the same 4-rank job (TP=2, DP=2, ZeRO 1) to the same
losses as each other and as one process; a killed rank ends the job with a clear message within
the distributed timeout."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import free_port
from tests.integration._train_helpers import REPO, make_corpus, tiny_argv, trained_iterations
from tests.integration.schedulers.system import wait_for_exit, wait_while_running

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}:{env.get('PATH', '')}",
                "PYTHONPATH": REPO}, **extra)
    return env


def _losses(path):
    return [r["lm_loss"] for r in map(json.loads, open(path)) if r["type"] == "train"]


def _launch(cmd, env, tmp_path, name):
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return _losses(tmp_path / f"{name}.jsonl")


def test_all_launchers_train_the_same_job(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")

    def argv(name, layout=True):
        extra = ["--eval-iters", "0", "--metrics-file", str(tmp_path / f"{name}.jsonl")]
        if layout:
            extra += ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]
        return tiny_argv(prefix, cache, iters=3, extra=extra)

    py = sys.executable
    single = _launch([py, "pretrain_gpt.py", *argv("single", layout=False)], _env(), tmp_path, "single")
    torchrun = _launch([os.path.join(BIN, "torchrun"), "--nproc-per-node", "4", "--master-port", str(free_port()),
                        "pretrain_gpt.py", *argv("torchrun")], _env(), tmp_path, "torchrun")
    # root / more ranks than cores need Open MPI's permission, given by environment, not flags
    mpi_env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
    mpirun = _launch([shutil.which("mpirun"), "-np", "4", py, "pretrain_gpt.py", *argv("mpirun")], mpi_env,
                     tmp_path, "mpirun")
    ds = _launch([os.path.join(BIN, "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
                  "pretrain_gpt.py", *argv("deepspeed")], _env(), tmp_path, "deepspeed")
    assert len(single) == 3
    assert torchrun == mpirun == ds  # same layout, same arithmetic: bit-identical
    for a, b in zip(torchrun, single):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_killed_rank_ends_the_job_with_a_message(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    metrics = tmp_path / "m.jsonl"
    args = tiny_argv(prefix, cache, iters=10000, extra=["--eval-iters", "0", "--metrics-file", str(metrics),
                                                        "--distributed-timeout-minutes", "1"])
    port = free_port()
    procs, logs = [], [tmp_path / f"rank{rank}.txt" for rank in range(2)]
    for rank in range(2):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        with open(logs[rank], "w") as out_file:
            procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=env,
                                          stdout=out_file, stderr=subprocess.STDOUT))
    try:
        wait_while_running(procs[0], lambda: trained_iterations(metrics) >= 2, 240, "2 iterations trained",
                           lambda: "\n".join(f"--- rank {r} (status {p.poll()}):\n{log.read_text()[-1800:]}"
                                             for r, (p, log) in enumerate(zip(procs, logs))), interval=0.5)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        code = wait_for_exit(procs[0], 90, "rank 0 after rank 1's SIGKILL", logs[0].read_text)
        took, out = time.time() - killed_at, logs[0].read_text()
        assert took < 75, f"rank 0 ended {took:.0f} s after the kill:\n{out[-3000:]}"  # 1-minute timeout + exit
        assert code == 1, out[-3000:]
        # the survivor names the killed rank (it never reached its failure handler)
        assert "training failed: lost rank 1: no word from it" in out, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
