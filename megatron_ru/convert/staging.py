"""Output directories of the conversion tools: built under a temporary name next to the target
and renamed into place only when complete, so a failure (or Ctrl-C) never leaves a half-written
directory under the name the user asked for."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Iterator

TMP_MARK = ".tmp-"


def _inside(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent


def check_output(save: str, load: str, force: bool, flag: str = "--save") -> None:
    """Refuse an existing output without ``force``, and any output that is, contains or lies
    inside the input (``--force`` would delete the input)."""
    out, src = os.path.realpath(save), os.path.realpath(load)
    if _inside(out, src) or _inside(src, out):
        raise ValueError(f"{flag} {save} and --load {load} overlap; write the output to a separate directory")
    if os.path.lexists(save):
        if not os.path.isdir(save):
            raise FileExistsError(f"{flag} {save} exists and is not a directory; choose another path")
        if not force:
            raise FileExistsError(f"{flag} {save} already exists; pass --force to replace it, or choose "
                                  "another directory")


def temporary_name(save: str) -> str:
    """A sibling of ``save`` (same file system, so the final rename is atomic)."""
    return f"{os.path.abspath(save)}{TMP_MARK}{os.getpid()}"


@contextmanager
def staged_directory(save: str, force: bool, create: bool = True) -> Iterator[str]:
    """Yield a temporary directory path that becomes ``save`` when the block completes; removed
    if it raises. ``create=False`` yields the path without creating it (for writers that create
    their own directory there). An existing ``save`` is replaced only with ``force``."""
    if os.path.lexists(save) and not force:
        raise FileExistsError(f"{save} already exists; pass --force to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
    tmp = temporary_name(save)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier process with this pid
    if create:
        os.mkdir(tmp)
    try:
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
