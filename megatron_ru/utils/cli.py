"""Output channel of the package's command-line entry points (``python -m megatron_ru...``).

A CLI's result (a JSON line per rank, a layout table) is its product and goes to stdout
unadorned so scripts can parse it; a user mistake goes to stderr as one ``error:`` line.
Diagnostics and progress go through ``megatron_ru.utils.logging`` instead.
"""
from __future__ import annotations

import io
import os
import sys


def emit(text: str) -> None:
    """Write a result line to stdout in one system call.

    Several ranks share one stdout under mpirun/srun; ``print`` writes the text and the newline
    separately, so two ranks' lines can fuse into one. A single ``write`` of a line shorter than
    the pipe buffer (4 KiB) reaches the reader whole.
    """
    data = (text + "\n").encode("utf-8")
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # captured stdout (tests)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    sys.stdout.flush()
    while data:
        data = data[os.write(fd, data):]


def error(message: str) -> None:
    """Write a one-line user error to stderr (the caller returns exit code 2)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
