"""Rank discovery: every launcher environment, precedence, and inconsistent environments."""
import json
import os
import sys

import pytest
import torch.distributed as dist

from megatron_ru.parallel import env as penv
from megatron_ru.parallel.env import (DistEnv, apply_environment, choose_backend, default_device,
                                      discover_environment, init_distributed)

SLURM_BASE = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
              "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x4)"}
SLURM_PORT = penv.SLURM_PORT_BASE + 123456 % penv.SLURM_PORT_SPAN
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
TORCHRUN = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "host-a", "MASTER_PORT": "29555"}

# (id, environment, expected DistEnv)
CASES = [
    ("none", {}, DistEnv(0, 1, 0, 1, None, None, "single", "none")),
    ("torchrun", TORCHRUN, DistEnv(6, 8, 2, 4, "host-a", 29555, "torchrun", "environment")),
    ("deepspeed-launcher-LOCAL_SIZE", {**TORCHRUN, "LOCAL_WORLD_SIZE": None, "LOCAL_SIZE": "4"},
     DistEnv(6, 8, 2, 4, "host-a", 29555, "torchrun", "environment")),
    ("torchrun-one-process-no-master", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
     DistEnv(0, 1, 0, 1, None, None, "torchrun", "environment")),
    ("openmpi-no-master", OMPI, DistEnv(3, 4, 1, 2, None, None, "openmpi", "mpi")),
    ("openmpi-with-master", {**OMPI, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"},
     DistEnv(3, 4, 1, 2, "10.0.0.1", 4000, "openmpi", "environment")),
    ("slurm-node[01-03,07]", {**SLURM_BASE, "SLURM_JOB_NODELIST": "node[01-03,07]"},
     DistEnv(5, 8, 1, 2, "node01", SLURM_PORT, "slurm", "slurm")),
    ("slurm-a[1-2],b3", {**SLURM_BASE, "SLURM_JOB_NODELIST": "a[1-2],b3"},
     DistEnv(5, 8, 1, 2, "a1", SLURM_PORT, "slurm", "slurm")),
    ("slurm-gpu-[001-004]", {**SLURM_BASE, "SLURM_JOB_NODELIST": "gpu-[001-004]"},
     DistEnv(5, 8, 1, 2, "gpu-001", SLURM_PORT, "slurm", "slurm")),
    ("slurm-two-brackets", {**SLURM_BASE, "SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]"},
     DistEnv(5, 8, 1, 2, "rack1-node01", SLURM_PORT, "slurm", "slurm")),
    ("slurm-step-nodelist-wins", {**SLURM_BASE, "SLURM_JOB_NODELIST": "big[1-9]",
                                  "SLURM_STEP_NODELIST": "big[4-5]"},
     DistEnv(5, 8, 1, 2, "big4", SLURM_PORT, "slurm", "slurm")),
    ("slurm-uneven-tasks-per-node", {**SLURM_BASE, "SLURM_PROCID": "6", "SLURM_NTASKS": "7",
                                     "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
                                     "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "n[1-4]"},
     DistEnv(6, 7, 0, 1, "n1", SLURM_PORT, "slurm", "slurm")),
    ("slurm-with-master", {**SLURM_BASE, "SLURM_JOB_NODELIST": "n[1-4]", "MASTER_ADDR": "login",
                           "MASTER_PORT": "6000"},
     DistEnv(5, 8, 1, 2, "login", 6000, "slurm", "environment")),
    ("torchrun-beats-mpi-and-slurm", {**TORCHRUN, **OMPI, **SLURM_BASE, "SLURM_JOB_NODELIST": "n1"},
     DistEnv(6, 8, 2, 4, "host-a", 29555, "torchrun", "environment")),
    ("mpi-beats-slurm", {**OMPI, **SLURM_BASE, "SLURM_JOB_NODELIST": "n1"},
     DistEnv(3, 4, 1, 2, None, None, "openmpi", "mpi")),
]


def _env(d):
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("environ, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_discovery_table(environ, expected):
    assert discover_environment(_env(environ)) == expected


def test_slurm_port_is_derived_from_the_job_id():
    env = {**SLURM_BASE, "SLURM_JOB_NODELIST": "n1"}
    a = discover_environment({**env, "SLURM_JOB_ID": "1000"}).master_port
    b = discover_environment({**env, "SLURM_JOB_ID": "1001"}).master_port
    assert (a, b) == (penv.SLURM_PORT_BASE + 1000, penv.SLURM_PORT_BASE + 1001)
    wrapped = discover_environment({**env, "SLURM_JOB_ID": str(1000 + penv.SLURM_PORT_SPAN)}).master_port
    assert wrapped == a and 1024 < a < 32768


# (id, environment, fragments the message must contain)
BAD = [
    ("rank>=world", {**TORCHRUN, "RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
    ("negative-rank", {**TORCHRUN, "RANK": "-1"}, ["RANK=-1"]),
    ("world-zero", {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0", ">= 1"]),
    ("local>=local-world", {**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
    ("local-world>world", {**TORCHRUN, "LOCAL_WORLD_SIZE": "16", "LOCAL_RANK": "9"},
     ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"]),
    ("rank-only", {"RANK": "0"}, ["RANK='0'", "WORLD_SIZE, LOCAL_RANK missing"]),
    ("no-local-rank", {"RANK": "1", "WORLD_SIZE": "2"}, ["LOCAL_RANK missing", "WORLD_SIZE='2'"]),
    ("non-integer-world", {**TORCHRUN, "WORLD_SIZE": "eight"}, ["WORLD_SIZE='eight'", "not an integer"]),
    ("torchrun-no-master", {**TORCHRUN, "MASTER_ADDR": None}, ["MASTER_ADDR=None", "WORLD_SIZE=8"]),
    ("bad-port", {**TORCHRUN, "MASTER_PORT": "29x"}, ["MASTER_PORT='29x'", "not an integer"]),
    ("port-range", {**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "1-65535"]),
    ("ompi-partial", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     ["incomplete openmpi", "OMPI_COMM_WORLD_LOCAL_RANK missing"]),
    ("ompi-rank>=size", {**OMPI, "OMPI_COMM_WORLD_RANK": "4"},
     ["OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4"]),
    ("slurm-partial", {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, ["incomplete slurm", "SLURM_NTASKS"]),
    ("slurm-non-integer", {**SLURM_BASE, "SLURM_PROCID": "x", "SLURM_JOB_NODELIST": "n1"},
     ["SLURM_PROCID='x'"]),
    ("slurm-no-nodelist", SLURM_BASE, ["SLURM_JOB_NODELIST", "MASTER_ADDR"]),
    ("slurm-bad-nodelist", {**SLURM_BASE, "SLURM_JOB_NODELIST": "node[01-"},
     ["SLURM_JOB_NODELIST='node[01-'", "unclosed"]),
    ("slurm-no-job-id", {**SLURM_BASE, "SLURM_JOB_ID": None, "SLURM_JOB_NODELIST": "n1"},
     ["SLURM_JOB_ID", "MASTER_PORT"]),
]


@pytest.mark.parametrize("environ, fragments", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_inconsistent_environments_name_variables_and_values(environ, fragments):
    with pytest.raises(ValueError) as err:
        discover_environment(_env(environ))
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_discovery_is_pure():
    environ = {**SLURM_BASE, "SLURM_JOB_NODELIST": "n[1-4]"}
    before = dict(environ)
    discover_environment(environ)
    assert environ == before


@pytest.fixture
def clean_environ():
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("OMPI_", "SLURM_", "PMI", "MASTER_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            del os.environ[name]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_apply_writes_ranks_and_only_derived_master(clean_environ):
    apply_environment(DistEnv(5, 8, 1, 2, "node01", 20000, "slurm", "slurm"))
    written = [clean_environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT")]
    assert written == ["5", "8", "1", "2", "node01", "20000"]
    del clean_environ["MASTER_ADDR"], clean_environ["MASTER_PORT"]
    apply_environment(DistEnv(3, 4, 1, 2, None, None, "openmpi", "mpi"))  # address still pending
    assert clean_environ["RANK"] == "3" and "MASTER_ADDR" not in clean_environ


def test_missing_mpi4py_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    with pytest.raises(RuntimeError, match="mpi4py is not installed.*MASTER_ADDR"):
        penv.share_master_over_mpi(DistEnv(1, 2, 1, 2, None, None, "openmpi", "mpi"))


def test_backend_choice_without_cuda():
    assert choose_backend(None) == choose_backend("auto") == "gloo"
    assert choose_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="--distributed-backend nccl needs CUDA"):
        choose_backend("nccl")
    with pytest.raises(ValueError, match="--distributed-backend 'mpi'"):
        choose_backend("mpi")
    assert default_device().type == "cpu"


def test_init_single_process_is_idempotent(clean_environ):
    assert not dist.is_initialized()
    try:
        denv = init_distributed(timeout_minutes=1)
        assert denv.source == "single" and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert clean_environ["RANK"] == "0" and clean_environ["WORLD_SIZE"] == "1"
        again = init_distributed()                 # second call: no re-initialisation
        # the written-back RANK/WORLD_SIZE now read as a torchrun-style environment, same numbers
        assert (again.rank, again.world_size, again.local_rank, again.source) == (0, 1, 0, "torchrun")
        clean_environ.update({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "x", "MASTER_PORT": "1"})
        with pytest.raises(RuntimeError, match="already initialised as rank 0 of 1.*rank 1 of 2"):
            init_distributed()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_env_cli_reports_mistakes_without_traceback(clean_environ, capsys):
    clean_environ.update({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert penv.main([]) == 2
    assert capsys.readouterr().err.strip() == ("error: inconsistent launcher environment: "
                                               "RANK=3 must be in [0, WORLD_SIZE=2)")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        del clean_environ[name]
    assert penv.main(["--tensor-model-parallel-size", "2"]) == 2    # one process cannot hold TP=2
    assert "WORLD_SIZE=1 is not divisible by TP x PP = 2 x 1 = 2" in capsys.readouterr().err
    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # written back by the run above
        del clean_environ[name]
    assert penv.main([]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["source"], report["rank"], report["world_size"], report["tp_group"]) == ("single", 0, 1, [0])
    assert report["allreduce_ok"] == {"tp": True, "dp": True, "pp": True, "mp": True}
