"""Output channel of the package's command-line entry points (``python -m megatron_ru...``).

A CLI's result (a JSON line per rank, a layout table) is its product and goes to stdout
unadorned so scripts can parse it; a user mistake goes to stderr as one ``error:`` line.
Diagnostics and progress go through ``megatron_ru.utils.logging`` instead.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from typing import Any, Iterator, Optional


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


class Terminated(BaseException):
    """SIGTERM as an exception: the cleanup of a half-written output (``finally``/``except BaseException``
    blocks) runs as it does for Ctrl-C, instead of the process ending where it stands."""


#: the exit status of a process ended by SIGTERM (128 + 15), as a shell reports it
TERMINATED_STATUS = 143


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread."""
    def handler(signum: int, frame: Any) -> None:
        raise Terminated()
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def report_tool(prog: str, module: Any, argv: Optional[list[str]] = None) -> int:
    """``main`` of a tool built from ``module`` (``HELP``, ``add_arguments(parser)``, ``run(args) -> dict``):
    the report as one JSON line on stdout, exit 0; a user mistake as one ``error:`` line, exit 2."""
    import argparse
    import json
    parser = argparse.ArgumentParser(prog=prog, description=module.HELP,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        with sigterm_raises():
            report = module.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        error(str(e))
        return 2
    except Terminated:
        error("terminated (SIGTERM); nothing was written under the output name")
        return TERMINATED_STATUS
    emit(json.dumps(report, default=str, ensure_ascii=False))
    return 0
