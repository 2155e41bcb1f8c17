"""Output directories of the conversion tools: built under a temporary name next to the target
and renamed into place only when complete, so a failure (or Ctrl-C) never leaves a half-written
directory under the name the user asked for."""
from __future__ import annotations

import os
import re
import shutil
import socket
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Tuple, Union

from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

TMP_MARK = ".tmp-"


def _inside(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent


#: a tool's inputs: ``(flag, path)`` pairs (a path of None is skipped), or one path given by --load
Inputs = Union[str, Sequence[Tuple[str, Optional[str]]]]


def overlap_problem(save: str, inputs: Inputs, flag: str = "--save") -> Optional[str]:
    """The one rule of every tool that writes an output directory: the output must not be, contain or
    lie inside any of its inputs (symbolic links resolved). Replacing the output (``--force``, or the
    final rename) would otherwise delete an input, or write into one. None when nothing overlaps."""
    pairs = [("--load", inputs)] if isinstance(inputs, str) else [(f, p) for f, p in inputs if p]
    out = os.path.realpath(save)
    for in_flag, path in pairs:
        src = os.path.realpath(path)
        if out == src:
            how = "are the same path"
        elif _inside(src, out):
            how = f"overlap: {in_flag} lies inside {flag}, which the output replaces"
        elif _inside(out, src):
            how = f"overlap: {flag} lies inside {in_flag}"
        else:
            continue
        return (f"{flag} {save} and {in_flag} {path} {how}; write the output to a directory outside every "
                f"input (--force never replaces an input)")
    return None


def check_output(save: str, inputs: Inputs, force: bool, flag: str = "--save") -> None:
    """Refuse an output that overlaps an input (:func:`overlap_problem`), an existing output without
    ``force``, and an output path that names a file."""
    problem = overlap_problem(save, inputs, flag)
    if problem:
        raise ValueError(problem)
    if os.path.lexists(save):
        if not os.path.isdir(save):
            raise FileExistsError(f"{flag} {save} exists and is not a directory; choose another path")
        if not force:
            raise FileExistsError(f"{flag} {save} already exists; pass --force to replace it, or choose "
                                  "another directory")


def temporary_name(save: str) -> str:
    """A sibling of ``save`` (same file system, so the final rename is atomic), named by this host and
    process so that a later run can tell whether its writer is gone (:func:`remove_stale_temporaries`)."""
    return f"{os.path.abspath(save)}{TMP_MARK}{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(save: str) -> list[str]:
    """Remove the temporaries of ``save`` left by writers that no longer run (killed with SIGKILL, or a
    node that went down): ``<save>.tmp-<host>-<pid>`` of this host whose process is gone, and the older
    ``<save>.tmp-<pid>`` whose process is gone. Another host's are left alone (its pids mean nothing
    here). Returns the paths removed."""
    out = os.path.abspath(save)
    parent, base = os.path.dirname(out), os.path.basename(out) + TMP_MARK
    pattern = re.compile(r"^(?:(?P<host>.+)-)?(?P<pid>\d+)$")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name[len(base):]) if name.startswith(base) else None
        if m is None or m.group("host") not in (None, socket.gethostname()) or _pid_alive(int(m.group("pid"))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        removed.append(path)
        log.info("removed %s, left by a writer of %s that no longer runs", path, save)
    return removed


@contextmanager
def staged_directory(save: str, force: bool, create: bool = True) -> Iterator[str]:
    """Yield a temporary directory path that becomes ``save`` when the block completes; removed
    if it raises. ``create=False`` yields the path without creating it (for writers that create
    their own directory there). An existing ``save`` is replaced only with ``force``."""
    if os.path.lexists(save) and not force:
        raise FileExistsError(f"{save} already exists; pass --force to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
    remove_stale_temporaries(save)
    tmp = temporary_name(save)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier process with this pid
    try:
        if create:  # inside the try: a signal (SIGTERM raises) right after the mkdir still removes it
            os.mkdir(tmp)
        yield tmp
        if not os.path.isdir(tmp):
            raise RuntimeError(f"nothing was written to {tmp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(save):
        old = f"{os.path.abspath(save)}.old-{os.getpid()}"
        os.rename(save, old)
        os.rename(tmp, save)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, save)
