"""A rank ends when its launcher is gone.

``mpirun`` puts its ranks in process groups of their own, and ``torchrun``'s workers survive their agent:
a launcher killed with SIGKILL (by hand, by a scheduler that signals only the launcher's group, by an
out-of-memory killer) left every rank training to the end, writing checkpoints into ``--save`` while the
next job resumed from it. :func:`watch_launcher` starts a small child process (no torch, no GIL of the
rank's: a rank blocked in ``MPI_Init`` or a collective is watched as well) that checks once per
``PERIOD_S`` that the launcher still runs; when it does not, it prints one line and ends the rank with
SIGKILL (nothing more is written: a save in progress stays incomplete and the next start-up removes it,
see megatron_ru/checkpointing/save_dir.py). The child ends by itself when the rank ends.

The launcher is ``mpirun``/``orted`` (the PMIx server named in ``PMIX_SERVER_TMPDIR``) under Open MPI,
the nearest ``slurmstepd`` under ``srun``, and the parent process under ``torchrun`` (and DeepSpeed's
launcher). A process started by hand (``python pretrain_gpt.py``) is not watched: ``nohup`` training
must survive its terminal. This module imports only the standard library and megatron_ru.utils (``pretrain_gpt.py`` calls
it before importing torch).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Mapping, Optional

from megatron_ru.utils.logging import current_rank
from megatron_ru.utils.processes import proc_stat, running, start_time

#: seconds between two checks of the launcher
PERIOD_S = 0.5
#: the launcher this process watches: (pid, name, start time), set by :func:`watch_launcher`
_WATCHED: list[tuple[int, str, str]] = []

_CHILD = r"""
import os, signal, sys, time
rank, launcher, start, line, period = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
def alive():
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is gone; so is another process with its PID
        with open("/proc/%d/stat" % launcher) as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return start == "-"
    return fields[0] not in ("Z", "X") and (start == "-" or fields[19] == start)
while True:
    time.sleep(period)
    if os.getppid() != rank:
        sys.exit(0)
    if not alive():
        try:  # the rank's own stderr, opened only now: holding it would keep the launcher's pipe open
            with open("/proc/%d/fd/2" % rank, "w") as err:
                err.write(line.replace("{time}", time.strftime("%H:%M:%S")) + "\n")
        except Exception:
            pass
        os.kill(rank, signal.SIGKILL)
        sys.exit(0)
"""


def ancestors(pid: int, limit: int = 8) -> list[tuple[int, str]]:
    """(pid, command name) of ``pid``'s parent, its parent, ... (at most ``limit``)."""
    out = []
    while len(out) < limit:
        stat = proc_stat(pid)
        if stat is None:
            break
        pid = int(stat[2])  # fields after the name: state, ppid
        if pid <= 1:
            break
        parent = proc_stat(pid)
        out.append((pid, parent[0] if parent else "?"))
    return out


def launcher_pid(env: Mapping[str, str] = os.environ, pid: Optional[int] = None) -> Optional[tuple[int, str]]:
    """(pid, name) of the launcher this process should not outlive; None when no launcher started it."""
    pid = os.getpid() if pid is None else pid
    chain = ancestors(pid)
    if not chain:
        return None
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        found = re.search(r"(?:pid|dvm)\.(\d+)", env.get("PMIX_SERVER_TMPDIR", ""))
        server = int(found.group(1)) if found else None
        for p, name in chain:
            if p == server:
                return p, name
        return chain[0]
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID") is not None:
        for p, name in chain:
            if name == "slurmstepd":
                return p, name
        return chain[0]
    if env.get("TORCHELASTIC_RUN_ID") is not None or (env.get("RANK") is not None and
                                                      env.get("LOCAL_RANK") is not None):
        return chain[0]
    return None


def launcher_alive() -> bool:
    """Whether the launcher :func:`watch_launcher` watches still runs (True when none is watched)."""
    if not _WATCHED:
        return True
    pid, _, start = _WATCHED[0]
    return running(pid, None if start == "-" else start)


def exit_if_launcher_gone(what: str) -> None:
    """End this process at once, with one line, when its launcher is gone: called before a checkpoint is
    committed, so that no checkpoint completes after the launcher died (the watcher polls only every
    ``PERIOD_S``)."""
    if launcher_alive():
        return
    pid, name, _ = _WATCHED[0]
    try:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')} rank {current_rank()}] ERROR megatron_ru.parallel.launcher_watch: the launcher "
                         f"({name}, PID {pid}) is gone: {what} abandoned, ending this rank (PID {os.getpid()})\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - its pipe may have died with it
        pass
    os._exit(1)


def launcher_gone_before_start(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The launcher that started this process when it is gone already (killed while this rank was still
    starting, before it could look for it), named for the error line; None otherwise. Only where that is
    certain: the rank is init's child and, under Open MPI, the server named in ``PMIX_SERVER_TMPDIR`` no longer
    runs, or, under torchrun, its agent (always a worker's parent) is gone. Not under srun (a container's
    shell may be PID 1 of its own namespace and a rank's parent) nor for RANK/LOCAL_RANK set by hand (a rank
    started through a shell that has exited is init's child from the start, and must survive its terminal)."""
    if os.getppid() != 1:
        return None
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        found = re.search(r"(?:pid|dvm)\.(\d+)", env.get("PMIX_SERVER_TMPDIR", ""))
        if found and not running(int(found.group(1))):
            return f"mpirun, PID {found.group(1)}"
        return None
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return "torchrun, its agent: this worker is now a child of init"
    return None


def watch_launcher(env: Mapping[str, str] = os.environ) -> Optional[subprocess.Popen]:
    """Start the watcher for this process (None when there is no launcher to watch). A launcher gone before
    this rank got here ends the rank at once, with one line."""
    gone = launcher_gone_before_start(env)
    if gone is not None:
        try:
            sys.stderr.write(f"[{time.strftime('%H:%M:%S')} rank {current_rank()}] ERROR "
                             f"megatron_ru.parallel.launcher_watch: the launcher ({gone}) is gone before this rank "
                             f"(PID {os.getpid()}) started: ending it\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - its pipe may have died with it
            pass
        os._exit(1)
    found = launcher_pid(env)
    if found is None:
        return None
    pid, name = found
    name = {"pt_elastic": "torchrun"}.get(name, name)  # torchrun's agent names its process pt_elastic
    start = start_time(pid) or "-"
    _WATCHED[:] = [(pid, name, start)]
    line = (f"[{{time}} rank {current_rank()}] ERROR megatron_ru.parallel.launcher_watch: the launcher ({name}, PID {pid}) "
            f"is gone: ending this rank (PID {os.getpid()}) without saving; a save in progress stays incomplete and "
            f"the next start-up removes it")
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, str(os.getpid()), str(pid), start, line,
                                 str(PERIOD_S)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
