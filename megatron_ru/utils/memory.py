"""Handing freed heap memory back to the operating system.

glibc's allocator keeps the memory of freed blocks below its (dynamic, up to 32 MiB) mmap threshold in
its arenas, where it still counts in the process's resident set. A loader that builds and drops many
tensors of a few MiB (one parameter's shard at a time) would end with that much more RSS than the state it
holds; ``malloc_trim`` returns those free pages. Elsewhere (another C library, macOS) this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Optional

_libc: Optional[Any] = None
_looked = False


def release_freed_memory() -> bool:
    """``malloc_trim(0)`` where the C library has it; returns whether it ran."""
    global _libc, _looked
    if not _looked:
        _looked = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
        _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


def own_storage(t: Any) -> Any:
    """``t`` itself when its storage holds exactly its elements, else a copy that does: a view (a shard cut from
    a full tensor, a parameter inside a flat buffer) keeps its whole storage alive, and torch.save writes it all."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()
