"""Faults under the launchers users run, reproduced for real: every one ends the whole job within
--distributed-timeout-minutes (plus a few seconds; torchrun adds its own 30 s grace before it
SIGKILLs a worker that does not exit) and is reported once, by the rank that found it.

* bare ``mpirun`` without MASTER_ADDR/MASTER_PORT (the README's command): rank 0 shares its address
  over MPI; MPI is finalised right after, so a failing rank exits instead of blocking in
  MPI_Finalize at interpreter exit while the others wait in a collective;
* every process group, DeepSpeed's own included, gives up after the timeout (torch gives groups
  created without ``timeout=`` 30 minutes);
* a damaged pointer file every rank reads → one error line, exit 2; a corrupt ``.idx`` → the same.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import free_port
from tests.integration._train_helpers import REPO, make_corpus, tiny_argv, trained_iterations
from tests.integration.schedulers.system import wait_while_running

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
TIMEOUT_MIN = 0.5  # --distributed-timeout-minutes of the faulty jobs
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
LAUNCHERS = ("mpirun", "torchrun")
#: how long a launcher may take to end the job after its ranks gave up: mpirun kills at once,
#: torchrun SIGTERMs the others and SIGKILLs after 30 s one that does not exit (a stopped one)
LAUNCHER_GRACE_S = {"mpirun": 20, "torchrun": 50}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "MEGATRON_RU_DEBUG")}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}:{env.get('PATH', '')}",
                "PYTHONPATH": REPO, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1"}, **extra)
    return env


def _command(launcher: str, argv: list[str], nproc: int = 4) -> list[str]:
    if launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        assert mpirun, "Open MPI's mpirun is not on PATH: run scripts/setup_env.sh (installs openmpi-bin)"
        return [mpirun, "-np", str(nproc), "--oversubscribe", "--allow-run-as-root", sys.executable,
                "pretrain_gpt.py", *argv]
    return [os.path.join(BIN, "torchrun"), "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
            "pretrain_gpt.py", *argv]


class Job:
    """A launcher running pretrain_gpt.py, its output going to a file that the test can watch."""

    def __init__(self, launcher: str, argv: list[str], log: Path) -> None:
        self.launcher, self.log = launcher, log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(_command(launcher, argv), cwd=REPO, env=_env(), stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, limit_s: float, what: str, interval: float = 0.3) -> float:
        """When PREDICATE first held; fails, with the job's status and output, if the job ends first."""
        wait_while_running(self.proc, predicate, limit_s, what, self.text, interval)
        return time.time()

    def wait(self, limit_s: float, since: float, what: str) -> int:
        try:
            code = self.proc.wait(timeout=max(1.0, since + limit_s - time.time()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.launcher}: the job still runs {limit_s:.0f} s after {what} (a hang):\n"
                                 f"{self.text()[-4000:]}") from None
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in rank_pids(str(self.log.parent)).values():  # stopped ranks the launcher left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._out.close()


def run_to_end(launcher: str, argv: list[str], log: Path, limit_s: float) -> tuple[int, str]:
    """Start a job, wait for it to end by itself (a hang fails the test), return (status, output)."""
    job = Job(launcher, argv, log)
    try:
        code = job.wait(limit_s, time.time(), "start")
    finally:
        job.close()
    return code, job.text()


def rank_pids(tag: str) -> dict[int, int]:
    """{global rank: pid} of the rank processes whose command line mentions ``tag``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if not any(tag.encode() in part for part in cmdline) or b"pretrain_gpt.py" not in cmdline[1:3]:
                continue
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
        except OSError:
            continue
        rank = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"RANK")
        if rank is not None:
            found[int(rank)] = int(entry)
    return found


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "ERROR megatron_ru" in line]


def _no_traceback_of_ours(text: str) -> None:
    for ours in ("megatron_ru", "pretrain_gpt.py"):
        assert f'File "{os.path.join(REPO, ours)}' not in text, text[-4000:]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("corpus")
    return make_corpus(str(d)), str(d / "cache")


@pytest.fixture(scope="module")
def tp2pp2_checkpoint(tmp_path_factory, corpus) -> Path:
    """A 3-iteration TP2 x PP2 checkpoint (one file per rank for each layer, DP = 1)."""
    save = tmp_path_factory.mktemp("ckpt") / "ckpt"
    argv = tiny_argv(*corpus, iters=3, extra=[*LAYOUT, "--eval-iters", "0", "--save", str(save)])
    proc = subprocess.run(_command("torchrun", argv), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return save


def _faulty_argv(corpus, tmp_path: Path, *extra: str, iters: int = 6) -> list[str]:
    return tiny_argv(*corpus, iters=iters, extra=[*LAYOUT, "--eval-iters", "0", "--distributed-timeout-minutes",
                                                  str(TIMEOUT_MIN), "--metrics-file", str(tmp_path / "m.jsonl"),
                                                  *extra])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("reader", [3, 0], ids=["rank3", "rank0"])
def test_truncated_checkpoint_file_one_rank_reads_ends_the_job(launcher, reader, corpus, tp2pp2_checkpoint,
                                                               tmp_path):
    """One line and, under mpirun, exit 2, whichever rank alone reads the damaged file. Rank 0 hosts the
    rendezvous store under mpirun: its peers, blocked in collectives of other groups, used to fail only
    when it exited, find the store gone and print a second line ("lost rank 0")."""
    load = tmp_path / "ckpt"
    shutil.copytree(tp2pp2_checkpoint, load)
    (tag,) = [p for p in load.iterdir() if p.is_dir()]
    if reader == 3:  # the last layer's second TP shard: read by rank 3 only (TP rank 1 of the last stage)
        victim = sorted(tag.glob("layer_*-model_01-model_states.pt"))[-1]
    else:            # the first transformer layer's first TP shard: rank 0 only (TP rank 0 of stage 0)
        victim = tag / "layer_01-model_00-model_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    job = Job(launcher, _faulty_argv(corpus, tmp_path, "--load", str(load)), tmp_path / "out.txt")
    try:
        seen = job.wait_for(lambda: _error_lines(job.text()) or "Traceback" in job.text(), 240,
                            "the truncated file reported")
        code = job.wait(TIMEOUT_MIN * 60 + LAUNCHER_GRACE_S[launcher], seen, "the first error")
    finally:
        job.close()
    text = job.text()
    assert code != 0, text[-4000:]
    assert len(_error_lines(text)) == 1, text[-4000:]
    assert victim.name in _error_lines(text)[0], text[-4000:]
    if launcher == "mpirun":
        assert code == 2, text[-4000:]  # the input error's status, not a survivor's 1
    _no_traceback_of_ours(text)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_stopped_rank_ends_the_job_within_the_timeout(launcher, corpus, tmp_path):
    job = Job(launcher, _faulty_argv(corpus, tmp_path, iters=100000), tmp_path / "out.txt")
    metrics = tmp_path / "m.jsonl"
    try:
        job.wait_for(lambda: trained_iterations(metrics) >= 2, 240, "2 iterations trained")
        pids = rank_pids(str(tmp_path))
        assert sorted(pids) == [0, 1, 2, 3], pids
        os.kill(pids[3], signal.SIGSTOP)  # a rank of the last stage: pipeline p2p and DeepSpeed's groups
        stopped = time.time()
        code = job.wait(TIMEOUT_MIN * 60 + LAUNCHER_GRACE_S[launcher], stopped, "SIGSTOP of rank 3")
    finally:
        job.close()
    text = job.text()
    assert code != 0
    lines = _error_lines(text)
    assert len(lines) == 1 and "training failed:" in lines[0] and "--distributed-timeout-minutes" in lines[0], text[-4000:]
    assert "lost rank 3: no word from it" in lines[0], lines  # the survivors name the stopped rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_damaged_pointer_file_every_rank_reads_is_one_error_exit_2(launcher, corpus, tmp_path):
    load = tmp_path / "ckpt"
    load.mkdir()
    pointer = load / "latest_checkpointed_iteration.txt"
    pointer.write_text("garbage\n")
    code, text = run_to_end(launcher, _faulty_argv(corpus, tmp_path, "--load", str(load)), tmp_path / "out.txt",
                            240)
    lines = _error_lines(text)
    assert len(lines) == 1 and str(pointer) in lines[0] and "'garbage'" in lines[0], text[-4000:]
    _no_traceback_of_ours(text)
    # mpirun passes the rank's status on; torchrun reports 1 for any failed worker (its report
    # names the root cause's exitcode)
    assert code == 2 if launcher == "mpirun" else (code == 1 and "exitcode  : 2" in text), text[-4000:]


@pytest.mark.timeout(200)
def test_corrupt_idx_under_mpirun_is_one_error_line_exit_2(tmp_path):
    prefix = make_corpus(str(tmp_path))
    idx = Path(prefix + ".idx")
    idx.write_bytes(idx.read_bytes()[:-40])
    argv = tiny_argv(prefix, str(tmp_path / "cache"), iters=3, extra=LAYOUT)
    code, text = run_to_end("mpirun", argv, tmp_path / "out.txt", 150)
    lines = _error_lines(text)
    assert code == 2 and len(lines) == 1, text[-4000:]
    assert "rank 0]" in lines[0] and f"{idx}: truncated index" in text, text[-4000:]
    _no_traceback_of_ours(text)


def test_groups_deepspeed_creates_get_the_distributed_timeout():
    """torch gives a group created without ``timeout=`` 30 minutes, not the default group's timeout;
    DeepSpeed creates its pipeline and comm groups that way."""
    code = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from megatron_ru.parallel.env import init_distributed
init_distributed("gloo", timeout_minutes=0.25)
import deepspeed.comm as ds_comm
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid
from megatron_ru.deepspeed_bridge.engine import attach_comm
attach_comm()
grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1))
groups = [ds_comm.new_group([0]), grid.get_data_parallel_group(), grid.get_slice_parallel_group()]
print(sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}))
"""
    env = _env()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[15.0]", proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags, expected", [
    (["--num-layers", "four"], "argument --num-layers: invalid int value: 'four'"),  # argparse's own error
    (["--lr", "-1e-3"], "--lr and --min-lr must be >= 0"),                             # our validation
])
def test_invalid_flag_under_mpirun_is_printed_once_exit_2(flags, expected, corpus, tmp_path):
    code, text = run_to_end("mpirun", tiny_argv(*corpus, iters=3, extra=flags), tmp_path / "out.txt", 150)
    assert code == 2, text[-4000:]
    assert text.count(expected) == 1, text[-4000:]
    _no_traceback_of_ours(text)
