"""A deadline for start-up steps that have no timeout of their own.

Under ``mpirun`` without MASTER_ADDR/MASTER_PORT, rank 0 shares its address over MPI (mpi4py):
``MPI_Init``, a broadcast and ``MPI_Finalize`` wait for every rank without a timeout, and MPI_Init
holds the interpreter lock while it waits, so no Python thread can watch it. A rank stopped or hung
before it gets there kept the others waiting for ever.

:class:`StartupWatchdog` is a small child process: it waits on a pipe for the parent to finish the
step. If the parent finishes (or exits), the pipe closes and the child ends silently. If the deadline
passes first, the child prints one error line for the parent and ends it with SIGKILL (a signal a
process blocked in C cannot defer); ``mpirun`` then ends the whole job. Ranks fire a few seconds
apart, rank 0 first, so that one line usually says it before the launcher ends the others.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

from megatron_ru.utils.logging import current_rank

#: seconds between the ranks' deadlines (at most 4 steps), so that usually one of them prints
STAGGER_S = 2.0

_CHILD = r"""
import os, select, signal, sys, time
seconds, parent, line = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([0], [], [], seconds)
if ready or os.getppid() != parent:
    sys.exit(0)
sys.stderr.write(line.replace("{time}", time.strftime("%H:%M:%S")) + "\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
"""


class StartupWatchdog:
    """``with StartupWatchdog(seconds, what):`` ends this process with one error line when the block
    outlives ``seconds`` (plus this rank's stagger). ``what`` completes the sentence "start-up did not
    finish: ..."."""

    def __init__(self, seconds: float, what: str, logger_name: str = "megatron_ru.parallel.env") -> None:
        self.rank = current_rank()
        self.seconds = seconds + STAGGER_S * min(self.rank, 4)
        self.line = f"[{{time}} rank {self.rank}] ERROR {logger_name}: start-up did not finish: {what}"
        self._proc: Optional[subprocess.Popen] = None
        self._write: Optional[int] = None

    def __enter__(self) -> "StartupWatchdog":
        read, self._write = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, str(self.seconds),
                                           str(os.getpid()), self.line], stdin=read, stdout=subprocess.DEVNULL)
        finally:
            os.close(read)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._write is not None:
            os.close(self._write)  # the child sees the end of the pipe and exits silently
            self._write = None
        if self._proc is not None:
            deadline = time.time() + 5
            while self._proc.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
