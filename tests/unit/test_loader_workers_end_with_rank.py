"""A data-loader worker ends with its rank however the rank ends (megatron_ru/utils/processes.end_with_parent,
the loaders' worker_init_fn): killed while the worker runs (the kernel's parent-death signal), and killed before
the worker first looked at its parent, where torch's own watchdog takes init for the parent and never ends (a
worker of a rank Grid Engine killed at h_rt held the job's master port for over an hour)."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = r"""
import os, sys, time
from megatron_ru.utils.processes import end_with_parent
mode, out = sys.argv[1], sys.argv[2]
parent = os.getpid()
child = os.fork()
if child == 0:
    if mode == "before":
        time.sleep(1.0)  # the parent is gone before the child first looks at it
    end_with_parent(parent)
    open(out + ".ready", "w").close()
    time.sleep(20)
    open(out, "w").write("survived")
    os._exit(0)
open(out + ".pid", "w").write(str(child))
if mode == "before":
    os._exit(0)
while not os.path.exists(out + ".ready"):
    time.sleep(0.01)
os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("mode", ["running", "before"])
def test_a_worker_ends_when_its_rank_is_killed(mode, tmp_path):
    out = str(tmp_path / "child")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, out], cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == (-9 if mode == "running" else 0)
    child = int(open(out + ".pid").read())
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
    assert not alive, f"the worker {child} outlived its killed parent ({mode})"
    assert not os.path.exists(out) and os.path.exists(out + ".ready") == (mode == "running")


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
    assert init.func is data._worker_started and init.args == (os.getpid(),)
