"""A real `mpirun -np 4`: no MASTER_ADDR, no --use-mpi; every rank reports what it discovered."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ru.parallel.topology import ParallelLayout

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def test_mpirun_four_ranks_discover_ranks_master_and_groups():
    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI's mpirun is not on PATH: run scripts/setup_env.sh (installs openmpi-bin)"
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [mpirun, "-np", "4", "--oversubscribe", "--allow-run-as-root", "--timeout", "150",
           sys.executable, "-m", "megatron_ru.parallel.env", "--tensor-model-parallel-size", "2",
           "--distributed-timeout-minutes", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], proc.stdout
    layout = ParallelLayout(4, 2, 1)
    for r in reports:
        rank = r["rank"]
        discovered = (r["source"], r["world_size"], r["local_rank"], r["local_world_size"])
        assert discovered == ("openmpi", 4, rank, 4)
        assert r["master_from"] == "mpi" and r["backend"] == "gloo" and r["device"] == "cpu"
        assert (r["master_addr"], r["master_port"]) == (reports[0]["master_addr"], reports[0]["master_port"])
        assert (r["tp_size"], r["dp_size"], r["pp_size"]) == (2, 2, 1)
        assert r["tp_group"] == layout.group_of("tp", rank) and r["dp_group"] == layout.group_of("dp", rank)
        assert r["pp_group"] == [rank] and r["embedding_group"] is None
        assert r["allreduce_ok"] == {"tp": True, "dp": True, "pp": True, "mp": True}
    assert [r["tp_group"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group"] for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert "rank discovery: source=openmpi" in proc.stderr  # logged once, by rank 0
    assert proc.stderr.count("rank discovery:") == 1


def _free_slurm_job_id() -> int:
    """A job id whose derived port is free right now (the port rule is base + id % span)."""
    import socket
    from megatron_ru.parallel.env import SLURM_PORT_BASE, SLURM_PORT_SPAN
    for offset in range(1000, SLURM_PORT_SPAN, 97):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", SLURM_PORT_BASE + offset))
            except OSError:
                continue
        return 5 * SLURM_PORT_SPAN + offset
    raise AssertionError("no free port in the Slurm port range")


def test_srun_style_environment_two_ranks_rendezvous_on_derived_master():
    """What srun gives each task (no MASTER_*): both find node list host 0 and the job-id port."""
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    job_id = _free_slurm_job_id()
    procs = []
    for rank in range(2):
        env = {**base, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "SLURM_PROCID": str(rank),
               "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "SLURM_JOB_ID": str(job_id), "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
        cmd = [sys.executable, "-m", "megatron_ru.parallel.env", "--pipeline-model-parallel-size", "2",
               "--distributed-timeout-minutes", "1"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=150)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, err = p.communicate()
                raise AssertionError(f"rank {rank} still ran after 150 s (killed); its output:\n{out}{err}") from None
            assert p.returncode == 0, out + err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    from megatron_ru.parallel.env import SLURM_PORT_BASE, SLURM_PORT_SPAN
    for rank, r in enumerate(outs):
        assert (r["rank"], r["world_size"], r["local_rank"], r["local_world_size"]) == (rank, 2, rank, 2)
        assert (r["source"], r["master_from"], r["master_addr"]) == ("slurm", "slurm", "localhost")
        assert r["master_port"] == SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
        assert r["pp_group"] == [0, 1] and r["embedding_group"] == [0, 1] and r["tp_group"] == [rank]
        assert all(r["allreduce_ok"].values())
