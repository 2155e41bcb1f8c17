"""Start N gloo ranks on this machine for a test, with a finite timeout; the ranks are forked from a
server that imported torch once (:func:`_context`).

    def body(rank, world_size, x):
        ...  # process group already initialised (gloo)
        return something_picklable

    results = run_distributed(body, world_size=4, args=(x,), timeout=120)   # list by rank

A rank that raises makes the call fail with that rank's traceback; a hang (almost no CPU used for ``timeout`` + 30 s)
fails with every rank killed. Ranks run with OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import functools
import os
import pickle
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the ranks' fork server imports once, so that a rank starts without importing them again (torch,
#: DeepSpeed and the package cost each fresh interpreter seconds of CPU; a rank forked from the server
#: shares them). DeepSpeed fixes its accelerator when imported, so it is preloaded only where the ranks
#: would choose the CPU anyway (DS_ACCELERATOR=cpu, as `make test` sets it).
PRELOAD = ("torch", "torch.distributed", "numpy", "transformers", "tests.dist_utils")
PRELOAD_CPU = ("deepspeed", "megatron_ru.training.pretrain", "megatron_ru.inference.runner")


@functools.cache
def _context():
    """Ranks are forked from one server per test process that imported :data:`PRELOAD` (``forkserver``),
    not started as fresh interpreters (``spawn``): the same isolation (the server only imports; it never
    runs a test), without the imports' cost per rank. The parent's environment is passed to each rank
    (a fork server keeps its own from when it started). Decided once: the server, once started, keeps
    what it preloaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD) + (list(PRELOAD_CPU) if os.environ.get("DS_ACCELERATOR") == "cpu"
                                                 else []))
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any],
            queue, timeout: float, env: dict[str, str], parent_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        # plain pickle (tensors as bytes): torch's queue would share tensor storage through a file
        # descriptor that the parent fetches from this process, which may already have exited
        # (FileNotFoundError in the parent, seen under load)
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure to the parent, including SystemExit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: the last statement of a ``python -c`` worker that joined a gloo group: leave it before the interpreter exits
#: (left to the exit, gloo's threads aborted the process under load: "terminate called without an active exception")
LEAVE_GROUP = "import torch.distributed as _dist; _dist.is_initialized() and _dist.destroy_process_group()"


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout: float = 180,
                    env: dict[str, str] | None = None, daemon: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank. ``daemon=False``:
    ranks that start processes of their own (DataLoader workers); they are killed at the end all the same.
    ``timeout`` is the process group's; the ranks fail as hung when together they used almost no CPU for ``timeout`` + 30
    s, or more than ``world_size`` x (``timeout`` + 30) CPU-seconds (tests/progress_guard.py): a loaded machine
    that gives them little CPU makes them slow, not failed."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout, env or {},
                                               dict(os.environ)), daemon=daemon) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time
    from tests.progress_guard import ProgressGuard
    guard = ProgressGuard(cpu_budget_s=world_size * (timeout + 30), stall_s=timeout + 30)
    try:
        while len(results) + len(errors) < world_size:
            why = guard.check([p.pid for p in procs if p.pid is not None])
            if why is not None:
                raise TimeoutError(f"distributed test stopped: its ranks {why} (process group timeout {timeout} s); "
                                   f"finished ranks: {sorted(results)}")
            try:
                rank, ok, out = queue.get(timeout=5)
            except _q.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and len(results) + len(errors) < world_size:
                    # a rank died without reporting (segfault, os._exit): give others a moment
                    time.sleep(2)
                    if queue.empty():
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[procs[i].exitcode for i in dead]} without reporting")
                continue
            if ok:
                results[rank] = pickle.loads(out)
            else:
                errors.append(f"--- rank {rank} ---\n{out}")
                break
        if errors:
            raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
