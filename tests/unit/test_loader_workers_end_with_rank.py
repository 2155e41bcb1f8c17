"""A data-loader worker ends with its rank however the rank ends (megatron_ru/utils/processes.end_with_parent,
the loaders' worker_init_fn): killed while the worker runs, killed before the worker first looked at it (torch's
own watchdog then takes init for the parent and never ends: a worker of a rank Grid Engine killed at h_rt held
the job's master port for over an hour), and killed while the worker is another process's child (multiprocessing's
forkserver: the server is the parent). The training loader yields its batches under every start method (a
check that the worker's parent is the rank ended every forkserver-started worker at once)."""
import os
import subprocess
import sys
import time

import pytest

from megatron_ru.utils.processes import start_time

pytestmark = pytest.mark.slow  # it starts ranks and their loader workers (~35 CPU-s): not the edit-test loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = r"""
import os, sys, time
from megatron_ru.utils.processes import end_with_parent, start_time
mode, out = sys.argv[1], sys.argv[2]
parent = os.getpid()
child = os.fork()
if child == 0 and mode == "server":  # a server process starts the worker and lives on
    worker = os.fork()
    if worker != 0:
        open(out + ".server", "w").write(str(os.getpid()))
        open(out + ".pid", "w").write(str(worker))
        time.sleep(30)
        os._exit(0)
if child == 0:
    if mode == "before":
        time.sleep(1.0)  # the parent is gone before the child first looks at it
    end_with_parent(parent, start_time(parent))
    open(out + ".ready", "w").close()
    time.sleep(20)
    open(out, "w").write("survived")
    os._exit(0)
if mode != "server":
    open(out + ".pid", "w").write(str(child))
if mode == "before":
    os._exit(0)
while not os.path.exists(out + ".ready"):
    time.sleep(0.01)
os.kill(os.getpid(), 9)
"""


def _wait_pid(name: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = open(name).read()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{name} was not written")


@pytest.mark.parametrize("mode", ["running", "before", "server"])
def test_a_worker_ends_when_its_rank_is_killed(mode, tmp_path):
    out = str(tmp_path / "child")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, out], cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == (0 if mode == "before" else -9)
    server = _wait_pid(out + ".server") if mode == "server" else None
    try:
        _assert_ends(_wait_pid(out + ".pid"), out, mode)
    finally:
        if server is not None:
            os.kill(server, 9)


def _assert_ends(child: int, out: str, mode: str) -> None:
    _assert_gone(child, f"the worker ({mode})")
    assert not os.path.exists(out) and os.path.exists(out + ".ready") == (mode != "before")


def _assert_gone(child: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
        try:  # the orphan is init's to reap here; a zombie counts as gone
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
    alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    assert not alive, f"{what} {child} outlived its killed rank"


def test_the_training_loader_installs_it():
    import torch

    from megatron_ru.training.data import micro_batches

    class Tiny(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"tokens": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}

    import megatron_ru.training.data as data
    seen = []
    original = torch.utils.data.DataLoader

    def spy(*a, **kw):
        seen.append(kw.get("worker_init_fn"))
        return original(*a, **kw)

    try:
        torch.utils.data.DataLoader = spy
        micro_batches(Tiny(), 0, 2, 0, 1, torch.device("cpu"), num_workers=1)
    finally:
        torch.utils.data.DataLoader = original
    init = seen[0]
    assert init.func is data._worker_started and init.args == (os.getpid(), start_time(os.getpid()))


LOADER = r"""
import multiprocessing, os, sys, time
import numpy as np
import torch
from megatron_ru.training.data import micro_batches


class Tiny(torch.utils.data.Dataset):
    def __init__(self, out):
        self.out = out

    def __len__(self):
        return 8

    def __getitem__(self, i):
        with open(f"{self.out}.worker{os.getpid()}", "w") as f:
            f.write(str(os.getpid()))
        return {"tokens": np.full(5, i, dtype=np.int64)}


if __name__ == "__main__":
    method, out = sys.argv[1], sys.argv[2]
    multiprocessing.set_start_method(method)
    batches = micro_batches(Tiny(out), 0, 2, 0, 1, torch.device("cpu"), num_workers=2)
    first = [b.tokens[:, 0].tolist() for b in batches]
    assert first == [[0, 1], [2, 3], [4, 5], [6, 7]], first
    open(out + ".batches", "w").write("ok")
    again = micro_batches(Tiny(out), 4, 2, 0, 1, torch.device("cpu"), num_workers=2)
    assert next(again).tokens[:, 0].tolist() == [4, 5]  # the workers of this loader stay up
    time.sleep(0.5)
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_the_training_loader_runs_and_ends_under_every_start_method(method, tmp_path):
    script = tmp_path / "loader_probe.py"
    script.write_text(LOADER)
    out = str(tmp_path / "probe")
    proc = subprocess.run([sys.executable, str(script), method, out], cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert open(out + ".batches").read() == "ok"
    workers = [int(open(str(tmp_path / name)).read()) for name in os.listdir(tmp_path) if ".worker" in name]
    assert len(workers) >= 2  # both loaders' workers fetched
    for pid in workers:
        _assert_gone(pid, f"a {method} worker")
