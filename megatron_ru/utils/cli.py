"""Output channel of the package's command-line entry points (``python -m megatron_ru...``).

A CLI's result (a JSON line per rank, a layout table) is its product and goes to stdout
unadorned so scripts can parse it; a user mistake goes to stderr as one ``error:`` line.
Diagnostics and progress go through ``megatron_ru.utils.logging`` instead.
"""
from __future__ import annotations

import sys


def emit(text: str) -> None:
    """Write a result line to stdout and flush (ranks interleave otherwise)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """Write a one-line user error to stderr (the caller returns exit code 2)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
