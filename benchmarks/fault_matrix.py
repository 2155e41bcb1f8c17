"""The fault matrix: real 4-rank jobs, killed, stopped, signalled, fed corrupt files
and invalid configurations; for each run: did the job end (no hang), did it fail when it had to
(no silent wrong result), and does its error name the file or flag at fault, once, without a
traceback.

    .venv/bin/python benchmarks/fault_matrix.py [--launchers mpirun torchrun] [--layouts tp2pp2 dp4]
                                                [--faults kill9 sigstop ...] [--timeout-minutes 0.5]

Jobs: ``tp2pp2`` (TP 2 x PP 2, ZeRO 1) and ``dp4`` (DP 4, ZeRO 1) of the tiny LLaMA-style model of
the integration tests, under bare ``mpirun`` (no MASTER_ADDR/MASTER_PORT: the README's command),
``mpirun-master`` (MASTER_ADDR/MASTER_PORT exported, as the ABCI scripts do) and ``torchrun``.
Every fault of a job is tried on rank 0 and on another rank, during start-up and during training;
torch's C++ stack traces count as tracebacks. The save directory's cells: a checkpoint whose pointer was
deleted, loaded with and without ``--save`` (refused, nothing written); two jobs started together on one
``--save`` (one trains, the other refuses naming the holder); a whole job SIGKILLed while it saves every
iteration (the next job takes its lock over, removes the partial save and resumes exactly); the launcher
alone SIGKILLed at start-up and during training (every rank must end within 15 s, none is left as an
orphan, no checkpoint completes after it). Every run has ``--distributed-timeout-minutes``
(default 0.5) and a wall limit of ``start-up + timeout + 90 s``; a run still alive at the limit is a
hang. The tools and LoRA (benchmarks/_fault_tools.py: conversion, generation, adaptation,
propagation; overlapping paths, SIGTERM/SIGKILL while writing, a generating rank killed or stopped,
a LoRA base moved or replaced, invalid adapter flags) follow unless ``--tools`` names fewer. Prints
markdown tables (those in docs/training.md) and writes benchmarks/out/fault_matrix.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.context_memory import free_port  # noqa: E402
from tests.integration._train_helpers import make_corpus, tiny_argv  # noqa: E402

BIN = os.path.dirname(sys.executable)
LAYOUTS = {"tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--zero-stage", "1"],
           "dp4": ["--zero-stage", "1"]}


#: length of the runs whose resumed losses are compared with an uninterrupted run's
REFERENCE_ITERS = 200


def train_losses(metrics: str) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(metrics)) if r.get("type") == "train"}


def resume_matches_reference(ws: "Workspace", launcher: str, layout: str, save: str, expect_in_output: str = "") -> str:
    """Resume from whatever the pointer in ``save`` names and train to REFERENCE_ITERS: every loss
    after the resume point must equal the uninterrupted run's bit for bit ("" if so, else why)."""
    pointer = os.path.join(save, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(pointer):
        return "no checkpoint saved"
    start = int(open(pointer).read().strip())
    metrics = os.path.join(save, "resumed.jsonl")
    run = launch(launcher, ws.argv(layout, iters=REFERENCE_ITERS, extra=("--load", save, "--save", save,
                                                                         "--metrics-file", metrics)), limit=900)
    if run.rc != 0:
        return f"resume from iteration {start} failed (exit {run.rc})"
    if expect_in_output and expect_in_output not in run.output:
        return f"the resume did not say {expect_in_output!r}"
    left = leftovers(save)
    if left:
        return f"the resume left what the interrupted run wrote: {', '.join(left[:4])}"
    resumed, reference = train_losses(metrics), ws.reference_losses(layout, launcher)
    if sorted(resumed) != list(range(start + 1, REFERENCE_ITERS + 1)):
        return f"resumed run logged iterations {min(resumed, default=None)}..{max(resumed, default=None)}"
    diff = [i for i in resumed if resumed[i] != reference[i]]
    return f"resumed losses differ from the uninterrupted run at {len(diff)} iterations" if diff else ""


def leftovers(save: str) -> list[str]:
    """What an interrupted save leaves: iteration directories without metadata.json, temporary files, a lock."""
    out = [os.path.basename(d) for d in glob.glob(os.path.join(save, "iter_*"))
           if not os.path.isfile(os.path.join(d, "metadata.json"))]
    out += [os.path.relpath(f, save) for f in glob.glob(os.path.join(save, "**", "*.tmp*"), recursive=True)]
    return out + (["megatron_ru.lock"] if os.path.exists(os.path.join(save, "megatron_ru.lock")) else [])


@dataclass
class Outcome:
    launcher: str
    layout: str
    fault: str
    expect: str            # "error" or "exit0"
    rc: Optional[int]
    seconds: float
    hang: bool
    silent_wrong: bool
    names_culprit: bool
    error_lines: int
    tracebacks: int
    ok: bool
    note: str = ""
    tail: str = field(default="", repr=False)
    #: ranks still running 15 s after their launcher was killed
    orphans: int = 0


# ---- launching ------------------------------------------------------------------------------

def _env(launcher: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}:{env.get('PATH', '')}",
                "PYTHONPATH": REPO})
    if launcher.startswith("mpirun"):
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
    if launcher == "mpirun-master":  # as the ABCI scripts do: rank 0's address exported, no MPI exchange
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def command(launcher: str, argv: list[str], nproc: int = 4, script: str = "pretrain_gpt.py") -> list[str]:
    if launcher == "mpirun":
        return [shutil.which("mpirun") or "mpirun", "-np", str(nproc), sys.executable, script, *argv]
    if launcher == "mpirun-master":
        return [shutil.which("mpirun") or "mpirun", "-np", str(nproc), "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                sys.executable, script, *argv]
    if launcher == "torchrun":
        return [os.path.join(BIN, "torchrun"), "--nproc-per-node", str(nproc), "--master-port",
                str(free_port()), script, *argv]
    return [sys.executable, script, *argv]


def rank_pids(root: int, script: str = "pretrain_gpt.py") -> dict[int, int]:
    """Global rank -> pid of every ``script`` process under ``root``."""
    out = {}
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            if script not in " ".join(child.cmdline()):
                continue
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rank = env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK")
        if rank is not None:
            out[int(rank)] = child.pid
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass


@dataclass
class Run:
    rc: Optional[int]
    seconds: float
    output: str
    hang: bool
    extra: dict = field(default_factory=dict)


def launch(launcher: str, argv: list[str], limit: float, during: Optional[Callable] = None,
           nproc: int = 4, script: str = "pretrain_gpt.py") -> Run:
    """Run a job; ``during(proc, started)`` acts on it while it runs (returns a dict of notes)."""
    log = tempfile.TemporaryFile(mode="w+")
    started = time.time()
    proc = subprocess.Popen(command(launcher, argv, nproc, script), cwd=REPO, env=_env(launcher), stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    extra = {}
    hang = False
    try:
        if during is not None:
            extra = during(proc, started) or {}
        proc.wait(timeout=max(1.0, limit - (time.time() - started)))
    except subprocess.TimeoutExpired:
        hang = True
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.wait()
    seconds = time.time() - started
    log.seek(0)
    return Run(None if hang else proc.returncode, seconds, log.read(), hang, extra)


# ---- the workspace: corpus and a checkpoint per layout ---------------------------------------

class Workspace:
    def __init__(self, root: str, timeout_minutes: float) -> None:
        self.root = root
        self.timeout_minutes = timeout_minutes
        self.prefix = make_corpus(root)
        self.cache = os.path.join(root, "cache")
        self._base: dict[str, str] = {}
        self._reference: dict[str, dict[int, float]] = {}

    def argv(self, layout: str, *, iters: int = 6, extra: tuple = ()) -> list[str]:
        return tiny_argv(self.prefix, self.cache, iters=iters,
                         extra=[*LAYOUTS[layout], "--eval-iters", "0", "--distributed-timeout-minutes",
                                str(self.timeout_minutes), *extra])

    def base_checkpoint(self, layout: str) -> str:
        """A checkpoint at iteration 2 (written once per layout by a clean torchrun job)."""
        path = os.path.join(self.root, f"base_{layout}")
        if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
            self._base[layout] = path  # made by an earlier run in the same --workdir
        if layout not in self._base:
            run = launch("torchrun", self.argv(layout, iters=6, extra=("--save", path, "--exit-interval", "2")),
                         limit=600)
            if run.rc != 0:
                raise RuntimeError(f"could not make the base checkpoint for {layout}:\n{run.output[-3000:]}")
            self._base[layout] = path
        return self._base[layout]

    def reference_losses(self, layout: str, launcher: str) -> dict[int, float]:
        """Per-iteration losses of an uninterrupted REFERENCE_ITERS run (once per layout and launcher)."""
        key = f"{layout}-{launcher}"
        if key not in self._reference:
            metrics = os.path.join(self.root, f"reference_{key}.jsonl")
            if not os.path.isfile(metrics):
                run = launch(launcher, self.argv(layout, iters=REFERENCE_ITERS, extra=("--metrics-file", metrics + ".tmp")),
                             limit=900)
                if run.rc != 0:
                    raise RuntimeError(f"the reference run {key} failed:\n{run.output[-3000:]}")
                os.replace(metrics + ".tmp", metrics)
            self._reference[key] = train_losses(metrics)
        return self._reference[key]

    def fresh_save(self, name: str) -> tuple[str, str]:
        """An empty --save directory for run ``name`` and the metrics file inside it."""
        save = os.path.join(self.root, "runs", name)
        shutil.rmtree(save, ignore_errors=True)
        os.makedirs(save)
        return save, os.path.join(save, "metrics.jsonl")

    def copy_checkpoint(self, layout: str, name: str) -> str:
        dst = os.path.join(self.root, "runs", name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.base_checkpoint(layout), dst)
        return dst


def ckpt_files(ckpt: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(ckpt, "iter_0000002", pattern)))


class _Poison:
    """Unpickling this runs a shell command: a loader that unpickles code would create MARKER."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---- faults ---------------------------------------------------------------------------------
# Each returns (argv, during, culprit regex, expectation, check-after).

def _wait_training(metrics: str, proc: subprocess.Popen, lines: int = 2, limit: float = 300) -> bool:
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= lines:
            return True
        time.sleep(0.2)
    return False


def fault_rank(sig: int, rank: int = 1):
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        metrics = os.path.join(ws.root, "runs", f"{name}.jsonl")
        os.makedirs(os.path.dirname(metrics), exist_ok=True)
        if os.path.exists(metrics):
            os.remove(metrics)
        argv = ws.argv(layout, iters=100000, extra=("--metrics-file", metrics, "--log-interval", "1"))

        def during(proc, started):
            if not _wait_training(metrics, proc):
                return {"injected": False}
            pids = rank_pids(proc.pid)
            if rank not in pids:
                return {"injected": False}
            os.kill(pids[rank], sig)
            return {"injected": True, "injected_at": time.time() - started}
        return argv, during, r"rank|peer|timed out|Timeout|closed|died|signal", "error"
    return make


def stop_at_startup(rank: int):
    """SIGSTOP ``rank`` as soon as its process exists (before MPI, the rendezvous or any collective)."""
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        argv = ws.argv(layout, iters=6)

        def during(proc, started):
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                pids = rank_pids(proc.pid)
                if rank in pids:
                    os.kill(pids[rank], signal.SIGSTOP)
                    return {"injected": True, "injected_at": time.time() - started}
                time.sleep(0.02)
            return {"injected": False}
        return argv, during, r"start-up did not finish|rendezvous store|process group did not form", "error"
    return make


def fault_file(action: Callable[[str, str], str], culprit: str, extra: tuple = ()):
    """``action(ckpt_dir, layout)`` damages a copy of the base checkpoint; the job resumes from it."""
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        ckpt = ws.copy_checkpoint(layout, name)
        action(ckpt, layout)
        return ws.argv(layout, iters=6, extra=("--load", ckpt, "--save", ckpt, *extra)), None, culprit, "error"
    return make


def _one_rank_model_file(ckpt: str, layout: str) -> str:
    # a file that one rank alone reads: the TP-rank-1 shard of stage 0's first layer, or rank 1's
    # optimizer fragments for DP 4 (the layer files are read by every DP rank)
    pattern = "layer_01-model_01-model_states.pt" if layout == "tp2pp2" else "optim_states-pp00-tp00-dp001.pt"
    return ckpt_files(ckpt, pattern)[0]


def truncate_one_rank_file(ckpt: str, layout: str) -> None:
    path = _one_rank_model_file(ckpt, layout)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def delete_optimizer_shard(ckpt: str, layout: str) -> None:
    # rank 1's: the TP-rank-1 file of stage 0 (DP 1), or data-parallel rank 1's ZeRO partition
    pattern = "optim_states-pp00-tp01-dp000.pt" if layout == "tp2pp2" else "optim_states-pp00-tp00-dp001.pt"
    os.remove(ckpt_files(ckpt, pattern)[0])


def delete_tp_shard(ckpt: str, layout: str) -> None:
    pattern = "layer_04-model_01-model_states.pt" if layout == "tp2pp2" else "layer_04-model_00-model_states.pt"
    os.remove(ckpt_files(ckpt, pattern)[0])


def delete_rng(ckpt: str, layout: str) -> None:
    os.remove(ckpt_files(ckpt, "rng_rank_00002.pt")[0])


def poison(ckpt: str, layout: str) -> None:
    """A model file replaced by a torch.save archive whose pickle runs a command, and its size in
    metadata.json updated to match (whoever can write one file can write both): only the refusal
    to unpickle code can catch it."""
    import io

    import torch
    path = ckpt_files(ckpt, "layer_01-model_00-model_states.pt")[0]
    buf = io.BytesIO()
    torch.save({"module": _Poison(os.path.join(ckpt, "POISON_RAN"))}, buf)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    meta_path = ckpt_files(ckpt, "metadata.json")[0]
    meta = json.load(open(meta_path))
    meta["files"][os.path.basename(path)] = len(buf.getvalue())
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def corrupt_metadata(ckpt: str, layout: str) -> None:
    with open(ckpt_files(ckpt, "metadata.json")[0], "w") as f:
        f.write('{"iteration": 2, "consum')


def bad_pointer(ckpt: str, layout: str) -> None:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("iter2\n")


def finetune_missing(ws: Workspace, launcher: str, layout: str, name: str):
    missing = os.path.join(ws.root, "runs", "no_such_checkpoint_dir")
    return ws.argv(layout, iters=6, extra=("--finetune", "--load", missing)), None, "no_such_checkpoint_dir", "error"


def _damaged_idx(ws: Workspace, name: str, edit: Callable[[bytearray], None]) -> str:
    dst = os.path.join(ws.root, "runs", name, "data")
    os.makedirs(dst, exist_ok=True)
    prefix = os.path.join(dst, "tiny_text_document")
    shutil.copy(ws.prefix + ".bin", prefix + ".bin")
    raw = bytearray(open(ws.prefix + ".idx", "rb").read())
    edit(raw)
    with open(prefix + ".idx", "wb") as f:
        f.write(raw)
    return prefix


def idx_fault(edit: Callable[[bytearray], None]):
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        prefix = _damaged_idx(ws, name, edit)
        argv = ws.argv(layout, iters=6, extra=("--data-path", prefix,
                                               "--data-cache-path", os.path.join(ws.root, "runs", name, "cache")))
        return argv, None, r"tiny_text_document\.idx", "error"
    return make


def _flip_doc_count(raw: bytearray) -> None:
    # MMIDIDX header: magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
    raw[26] ^= 0x04


def _dtype_8_to_3(raw: bytearray) -> None:
    assert raw[17] == 8, raw[17]
    raw[17] = 3


def vocab_too_small(ws: Workspace, launcher: str, layout: str, name: str):
    return ws.argv(layout, iters=6, extra=("--vocab-size", "50")), None, r"vocab|--vocab-size", "error"


def signal_all(sig: int, at_startup: bool):
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        save, metrics = ws.fresh_save(name)
        argv = ws.argv(layout, iters=REFERENCE_ITERS, extra=("--save", save, "--exit-signal-handler",
                                                             "--metrics-file", metrics))

        def during(proc, started):
            if at_startup:
                deadline = time.time() + 60
                while time.time() < deadline and len(rank_pids(proc.pid)) < 4:
                    time.sleep(0.05)
                time.sleep(1.0)  # ranks are importing torch/DeepSpeed: before any handler existed
            elif not _wait_training(metrics, proc):
                return {"injected": False}
            for pid in rank_pids(proc.pid).values():
                os.kill(pid, sig)
            return {"injected": True, "injected_at": time.time() - started, "save": save}

        def after(run: Run) -> str:
            if "exiting at iteration" not in run.output:
                return "the signal did not stop training"
            return resume_matches_reference(ws, launcher, layout, save)
        return argv, during, "", "exit0", after
    return make


def kill_during_saves(ws: Workspace, launcher: str, layout: str, name: str):
    """SIGKILL rank 1 while the job saves every iteration; the pointer must still name a complete
    checkpoint, from which a resume reproduces the uninterrupted run."""
    save, metrics = ws.fresh_save(name)
    argv = ws.argv(layout, iters=REFERENCE_ITERS, extra=("--save", save, "--save-interval", "1",
                                                         "--metrics-file", metrics))

    def during(proc, started):
        if not _wait_training(metrics, proc, lines=3):
            return {"injected": False}
        deadline = time.time() + 30
        while time.time() < deadline:  # a moment when an iteration directory is not yet current
            pointer = os.path.join(save, "latest_checkpointed_iteration.txt")
            current = open(pointer).read().strip() if os.path.isfile(pointer) else ""
            if any(d != f"iter_{int(current or 0):07d}" for d in os.listdir(save) if d.startswith("iter_")):
                break
            time.sleep(0.005)
        pids = rank_pids(proc.pid)
        if 1 not in pids:
            return {"injected": False}
        os.kill(pids[1], signal.SIGKILL)
        return {"injected": True, "injected_at": time.time() - started}

    return argv, during, r"rank|peer|closed|died|signal", "error", \
        lambda run: resume_matches_reference(ws, launcher, layout, save)


def _tree(path: str) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), path)] = (st.st_size, st.st_mtime_ns)
    return out


def missing_pointer(with_save: bool):
    """The pointer of a complete checkpoint deleted; --load DIR (and --save DIR): refused, nothing written."""
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        ckpt = ws.copy_checkpoint(layout, name)
        os.remove(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
        before = _tree(ckpt)
        extra = ("--load", ckpt, "--save", ckpt, "--save-interval", "2") if with_save else ("--load", ckpt)

        def after(run: Run) -> str:
            return "" if _tree(ckpt) == before else "the checkpoint directory changed"
        return ws.argv(layout, iters=6, extra=extra), None, r"latest_checkpointed_iteration\.txt", "error", after
    return make


def two_jobs_one_save(ws: Workspace, launcher: str, layout: str, name: str):
    """Two jobs with different seeds started together on one --save: one trains, the other refuses naming it."""
    save = os.path.join(ws.root, "runs", name)
    shutil.rmtree(save, ignore_errors=True)

    def argv(seed: int) -> list[str]:
        a = ws.argv(layout, iters=6, extra=("--save", save, "--save-interval", "2"))
        a[a.index("--seed") + 1] = str(seed)
        return a

    def during(proc, started):
        other = launch(launcher, argv(12), limit=300)
        return {"other_rc": other.rc, "other_output": other.output[-3000:], "other_hang": other.hang}

    def after(run: Run) -> str:
        pair = sorted([(run.rc, run.output), (run.extra.get("other_rc"), run.extra.get("other_output", ""))],
                      key=lambda p: p[0] != 0)
        if run.extra.get("other_hang"):
            return "the second job hung"
        if pair[0][0] != 0 or pair[1][0] in (0, None):
            return f"exit statuses {run.rc} and {run.extra.get('other_rc')}: one job must train, the other refuse"
        if "is in use by another job" not in pair[1][1]:
            return "the refusal does not name the lock's holder"
        seed = json.load(open(os.path.join(save, "iter_0000006", "metadata.json")))["args"]["training"]["seed"]
        winner_seed = 11 if run.rc == 0 else 12
        if seed != winner_seed:
            return f"the checkpoint holds seed {seed}, the job that trained had {winner_seed}"
        left = leftovers(save)
        return f"left behind: {left}" if left else ""
    return argv(11), during, "", "either", after  # the refusal's text is checked in after()


def killed_job_stale_lock(ws: Workspace, launcher: str, layout: str, name: str):
    """The whole job SIGKILLed (launcher and ranks, as a scheduler does) while it saves every iteration: its lock
    and a partial save stay; the next job takes the lock over, removes the leftovers and resumes exactly."""
    save, metrics = ws.fresh_save(name)
    argv = ws.argv(layout, iters=REFERENCE_ITERS, extra=("--save", save, "--save-interval", "1",
                                                         "--metrics-file", metrics))

    def during(proc, started):
        if not _wait_training(metrics, proc, lines=3):
            return {"injected": False}
        kill_tree(proc)
        return {"injected": True, "injected_at": time.time() - started}

    def after(run: Run) -> str:
        if not os.path.exists(os.path.join(save, "megatron_ru.lock")):
            return "the killed job left no lock (nothing tested)"
        pointer = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
        partial = os.path.join(save, f"iter_{pointer + 1:07d}")
        os.makedirs(partial, exist_ok=True)  # what a save killed before its metadata leaves, made certain
        open(os.path.join(partial, "layer_01-model_00-model_states.pt.tmp"), "wb").write(b"half")
        return resume_matches_reference(ws, launcher, layout, save, expect_in_output="took over")
    return argv, during, "", "either", after


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launcher_killed(at_startup: bool):
    """SIGKILL to the launcher alone (mpirun's ranks live in their own process groups; torchrun's workers outlive
    their agent): every rank must end within 15 s, and no checkpoint completes after that."""
    def make(ws: Workspace, launcher: str, layout: str, name: str):
        save, metrics = ws.fresh_save(name)
        argv = ws.argv(layout, iters=100000, extra=("--save", save, "--save-interval", "1", "--metrics-file", metrics))

        def during(proc, started):
            if at_startup:
                deadline = time.time() + 60
                while time.time() < deadline and len(rank_pids(proc.pid)) < 4:
                    time.sleep(0.05)
                time.sleep(1.0)
            elif not _wait_training(metrics, proc):
                return {"injected": False}
            pids = rank_pids(proc.pid)
            if not pids:
                return {"injected": False}
            complete = {d for d in os.listdir(save) if os.path.isfile(os.path.join(save, d, "metadata.json"))}
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.time()
            while time.time() < killed + 15 and any(_running(p) for p in pids.values()):
                time.sleep(0.2)
            orphans = [p for p in pids.values() if _running(p)]
            for p in orphans:
                os.kill(p, signal.SIGKILL)
            after = {d for d in os.listdir(save) if os.path.isfile(os.path.join(save, d, "metadata.json"))}
            return {"injected": True, "injected_at": killed - started, "orphans": len(orphans),
                    "ended_s": round(time.time() - killed, 1), "late_saves": len(after - complete)}
        return argv, during, "", "error", None
    return make


FAULTS: dict[str, Callable] = {
    "kill9-rank1": fault_rank(signal.SIGKILL),
    "sigstop-rank1": fault_rank(signal.SIGSTOP),
    "kill9-rank0": fault_rank(signal.SIGKILL, rank=0),
    "sigstop-rank0": fault_rank(signal.SIGSTOP, rank=0),
    "sigstop-rank0-startup": stop_at_startup(0),
    "sigstop-rank1-startup": stop_at_startup(1),
    "truncated-file-one-rank": fault_file(truncate_one_rank_file, r"_states[-\w]*\.pt"),
    "deleted-optimizer-shard": fault_file(delete_optimizer_shard, r"optim_states[-\w]*\.pt"),
    "deleted-tp-shard": fault_file(delete_tp_shard, r"model_states\.pt"),
    "deleted-rng-file": fault_file(delete_rng, r"rng_rank_00002\.pt"),
    "poisoned-file": fault_file(poison, r"model_states\.pt"),
    "corrupt-metadata": fault_file(corrupt_metadata, r"metadata\.json"),
    "bad-pointer": fault_file(bad_pointer, r"latest_checkpointed_iteration\.txt"),
    "finetune-missing-load": finetune_missing,
    "idx-doc-count-bit": idx_fault(_flip_doc_count),
    "idx-dtype-8-to-3": idx_fault(_dtype_8_to_3),
    "ids-beyond-vocab": vocab_too_small,
    "kill9-during-save": kill_during_saves,
    "sigusr1-training": signal_all(signal.SIGUSR1, at_startup=False),
    "sigterm-startup": signal_all(signal.SIGTERM, at_startup=True),
    "missing-pointer-load-save": missing_pointer(with_save=True),
    "missing-pointer-load-only": missing_pointer(with_save=False),
    "two-jobs-one-save": two_jobs_one_save,
    "job-killed-stale-lock": killed_job_stale_lock,
    "launcher-kill9-startup": launcher_killed(at_startup=True),
    "launcher-kill9-training": launcher_killed(at_startup=False),
}

# Invalid configurations: (name, extra flags, regex the single error line must match).
INVALID = [
    ("tp-not-dividing-world", ["--tensor-model-parallel-size", "3"], r"--tensor-model-parallel-size"),
    ("heads-not-divisible", ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6",
                             "--num-query-groups", "2"], r"--num-attention-heads"),
    ("zero2-with-pp", ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"], r"--zero-stage"),
    ("batch-not-divisible", ["--micro-batch-size", "4", "--global-batch-size", "6"], r"--global-batch-size"),
    ("negative-lr", ["--lr", "-1e-3"], r"--lr"),
    ("rope-seq-beyond-mpe", ["--seq-length", "64"], r"--max-position-embeddings"),
    ("fp16-on-cpu", ["--fp16"], r"--fp16"),
    ("refused-megatron-flag", ["--rampup-batch-size", "4", "4", "100"], r"--rampup-batch-size"),
    ("finetune-without-load", ["--finetune"], r"--load"),
    ("signal-handler-without-save", ["--exit-signal-handler"], r"--save"),
    ("missing-data", ["--data-path", "/nonexistent/corpus_text_document"], r"/nonexistent/corpus_text_document"),
    ("empty-validation-split", ["--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "1"], r"--split"),
    ("tokenizer-not-sentencepiece", ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                                     "@README"], r"README\.md"),
    ("bad-deepspeed-config", ["--deepspeed_config", "/nonexistent/ds.json"], r"--deepspeed_config"),
]


def _count_errors(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.search(r"\bERROR\b|^error:|\] error", line))


def _rank_tracebacks(text: str) -> int:
    """Tracebacks printed by the ranks (torchrun's own report of a failed child is not counted), C++
    stack traces (torch's "Exception raised from ...") included."""
    blocks = text.split("Traceback (most recent call last):")[1:]
    return sum(1 for b in blocks if "/bin/torchrun" not in b[:400]) + text.count("Exception raised from ")


def judge(launcher: str, layout: str, fault: str, expect: str, culprit: str, run: Run) -> Outcome:
    tracebacks = _rank_tracebacks(run.output)
    errors = _count_errors(run.output)
    names = bool(re.search(culprit, run.output)) if culprit else True
    silent = expect == "error" and run.rc == 0
    note = ""
    if run.extra.get("injected") is False:
        note = "fault not injected (job ended before it)"
    if expect == "exit0":
        ok = run.rc == 0 and not run.hang and not note
    elif expect == "either":  # two jobs raced: the after-check decides
        ok = not run.hang and not note
    else:
        ok = not run.hang and not silent and run.rc not in (None, 0) and names
    if "weights_only=False" in run.output:
        ok, note = False, "suggests weights_only=False"
    if ok and tracebacks and not note:
        ok, note = False, f"{tracebacks} traceback(s)"
    return Outcome(launcher, layout, fault, expect, run.rc, round(run.seconds, 1), run.hang, silent, names,
                   errors, tracebacks, ok, note, run.output[-4000:])


def run_matrix(ws: Workspace, launchers: list[str], layouts: list[str], faults: list[str],
               startup_s: float) -> list[Outcome]:
    out = []
    limit = startup_s + ws.timeout_minutes * 60 + 90
    for layout in layouts:
        for launcher in launchers:
            for fault in faults:
                name = f"{fault}-{launcher}-{layout}"
                try:
                    spec = FAULTS[fault](ws, launcher, layout, name)
                    argv, during, culprit, expect = spec[:4]
                    after = spec[4] if len(spec) > 4 else None
                except (OSError, IndexError) as e:  # the fault could not be set up: a bug here
                    out.append(Outcome(launcher, layout, fault, "error", None, 0.0, False, False, False, 0, 0,
                                       False, f"fault not set up: {type(e).__name__}: {e}"))
                    print(f"FAIL {launcher:8s} {layout:6s} {fault:26s} not set up: {e}", flush=True)
                    continue
                run = launch(launcher, argv, limit, during)
                if fault == "poisoned-file" and glob.glob(os.path.join(ws.root, "runs", name, "POISON_RAN")):
                    run.extra["note"] = "POISON RAN"
                o = judge(launcher, layout, fault, expect, culprit, run)
                o.orphans = int(run.extra.get("orphans", 0))
                if o.orphans:
                    o.ok, o.note = False, f"{o.orphans} orphan rank(s) still ran 15 s after the launcher died"
                elif run.extra.get("late_saves"):
                    o.ok, o.note = False, f"{run.extra['late_saves']} checkpoint(s) completed after the launcher died"
                elif "ended_s" in run.extra:
                    o.note = f"ranks ended {run.extra['ended_s']} s after the launcher"
                if run.extra.get("note"):
                    o.ok, o.note = False, run.extra["note"]
                elif after is not None and not run.hang and run.extra.get("injected", True):
                    problem = after(run)
                    if problem:
                        o.ok, o.note = False, problem
                    elif o.ok and (fault == "two-jobs-one-save" or fault.startswith("missing-pointer")):
                        o.note = o.note or "nothing overwritten"
                    elif o.ok:
                        o.note = "resume exact"
                print(f"{'ok  ' if o.ok else 'FAIL'} {launcher:8s} {layout:6s} {fault:26s} rc={o.rc} "
                      f"{o.seconds:6.1f}s errors={o.error_lines} "
                      f"tracebacks={o.tracebacks} {o.note}", flush=True)
                out.append(o)
    return out


def run_invalid(ws: Workspace, launcher: str) -> list[Outcome]:
    """Each invalid configuration must end with exit 2 and exactly one error line naming its flag.
    The first three (layout rules that need a world of 4) run under the 4-rank launcher, which
    also proves the error is printed once, not once per rank; the rest in one process."""
    out = []
    readme = os.path.join(REPO, "README.md")
    for i, (name, flags, culprit) in enumerate(INVALID):
        flags = [readme if f == "@README" else f for f in flags]
        where = launcher if i < 3 else "python"
        argv = tiny_argv(ws.prefix, ws.cache, iters=6, extra=["--distributed-timeout-minutes",
                                                              str(ws.timeout_minutes), *flags])
        run = launch(where, argv, limit=180, nproc=4)
        o = judge(where, "-", f"invalid:{name}", "error", culprit, run)
        o.ok = o.ok and run.rc == 2 and o.error_lines == 1 and o.tracebacks == 0
        print(f"{'ok  ' if o.ok else 'FAIL'} {where:8s} invalid:{name:30s} rc={o.rc} {o.seconds:5.1f}s "
              f"errors={o.error_lines} tracebacks={o.tracebacks}", flush=True)
        out.append(o)
    return out


def table(outcomes: list[Outcome]) -> str:
    rows = ["| launcher | layout | fault | exit | s | hang | silent | names culprit | error lines | tracebacks | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| {o.launcher} | {o.layout} | {o.fault} | {o.rc} | {o.seconds} | {'yes' if o.hang else 'no'} | "
                    f"{'YES' if o.silent_wrong else 'no'} | {'yes' if o.names_culprit else 'NO'} | {o.error_lines} | "
                    f"{o.tracebacks} | {'ok' if o.ok else 'FAIL ' + o.note} |")
    return "\n".join(rows)


def pivot(outcomes: list[Outcome]) -> str:
    """The docs table: one row per fault, one column per launcher x layout, each cell "exit, seconds"
    and the verdict; invalid configurations folded into one row."""
    cols = sorted({(o.launcher, o.layout) for o in outcomes if o.layout not in ("-", "tool")},
                  key=lambda c: (c[1], c[0]), reverse=True)
    faults = list(dict.fromkeys(o.fault for o in outcomes if o.layout not in ("-", "tool")))
    cell = {(o.fault, o.launcher, o.layout): o for o in outcomes}
    rows = ["| fault | " + " | ".join(f"{lau} {lay}" for lau, lay in cols) + " |",
            "|---|" + "---|" * len(cols)]
    for fault in faults:
        out = []
        for lau, lay in cols:
            o = cell.get((fault, lau, lay))
            out.append("—" if o is None else f"{o.rc if not o.hang else 'HANG'}, {o.seconds:.0f} s"
                       f"{'' if o.ok else ' **FAIL** ' + o.note}{f' ({o.note})' if o.ok and o.note else ''}")
        rows.append(f"| {fault} | " + " | ".join(out) + " |")
    invalid = [o for o in outcomes if o.layout == "-"]
    if invalid:
        good = sum(o.ok for o in invalid)
        rows.append(f"| {len(invalid)} invalid configurations | {good}/{len(invalid)}: exit 2, one error line "
                    f"naming the flag, no traceback | | | |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launchers", nargs="+", default=["mpirun", "mpirun-master", "torchrun"],
                   choices=["mpirun", "mpirun-master", "torchrun"],
                   help="mpirun: bare (rank 0's address shared over MPI); mpirun-master: MASTER_ADDR/PORT exported")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    p.add_argument("--no-invalid", action="store_true", help="skip the invalid-configuration runs")
    p.add_argument("--tools", nargs="*", default=None,
                   help="tool and LoRA cells to run (benchmarks/_fault_tools.py; default: all, none with --tools)")
    p.add_argument("--timeout-minutes", type=float, default=0.5)
    p.add_argument("--startup-seconds", type=float, default=90, help="allowance for 4 ranks to start")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "out", "fault_matrix.json"))
    p.add_argument("--table-from", default=None, help="print the docs table of an earlier run's JSON and exit")
    a = p.parse_args()
    from benchmarks._fault_tools import TOOL_FAULTS, run_tools, tool_table
    tools = list(TOOL_FAULTS) if a.tools is None else a.tools
    unknown = sorted(set(tools) - set(TOOL_FAULTS))
    if unknown:
        p.error(f"--tools: unknown {unknown}; choose from {list(TOOL_FAULTS)}")
    if a.table_from:
        saved = json.load(open(a.table_from))
        outcomes = [Outcome(**o) for o in saved["outcomes"]]
        sys.stdout.write(pivot(outcomes) + "\n\n" + tool_table(outcomes) + "\n\n" + json.dumps(saved["summary"]) + "\n")
        return 0
    root = a.workdir or tempfile.mkdtemp(prefix="fault_matrix_")
    os.makedirs(os.path.join(root, "runs"), exist_ok=True)
    ws = Workspace(root, a.timeout_minutes)
    started = time.time()
    outcomes = [] if a.no_invalid else run_invalid(ws, a.launchers[0])
    outcomes += run_matrix(ws, a.launchers, a.layouts, a.faults, a.startup_seconds)
    outcomes += run_tools(ws, tools, a.startup_seconds)
    bad = [o for o in outcomes if not o.ok]
    summary = {"runs": len(outcomes), "hangs": sum(o.hang for o in outcomes),
               "silent_wrong": sum(o.silent_wrong for o in outcomes), "orphans": sum(o.orphans for o in outcomes),
               "unnamed": sum(not o.names_culprit for o in outcomes), "failed": len(bad),
               "minutes": round((time.time() - started) / 60, 1), "machine": f"{platform.node()} "
               f"{os.cpu_count()} cores", "timeout_minutes": a.timeout_minutes}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump({"summary": summary, "outcomes": [asdict(o) for o in outcomes]}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    sys.stdout.write(table(outcomes) + "\n\n" + pivot(outcomes) + "\n\n" + tool_table(outcomes) + "\n\n"
                     + json.dumps(summary) + "\n")
    for o in bad:
        sys.stdout.write(f"\n---- {o.launcher} {o.layout} {o.fault} ----\n{o.tail[-1500:]}\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
