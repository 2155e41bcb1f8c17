"""On-disk cache of dataset indices (``.npy`` files), built once and loaded by every rank.

A cache entry is named by a hash of a *description*: a JSON-able dict of everything the
indices depend on (seed, seq_length, sample count, document range, mode, ...) plus a
fingerprint of the dataset files themselves (sizes and a digest of the ``.idx``, which holds
every sequence length and document boundary the indices are computed from). Regenerating a
dataset at the same path therefore changes the key, and stale indices are never found.

Layout under the cache directory, for key K::

    <label>-K-<array>.npy    one file per array, written as <file>.tmp-<host>-<pid>, then renamed
    <label>-K.done           JSON (description + metadata), written last: an entry without it
                             is partial and is rebuilt, never read

Only one rank builds (``is_builder_rank``); every rank then passes the caller's ``barrier``
and loads the arrays memory-mapped. torch.distributed is not needed here: the caller passes
``barrier`` (e.g. ``torch.distributed.barrier``) or None for a single process.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
from typing import Any, Callable

import numpy as np

from megatron_ru.data.indexed_dataset import data_file_path, index_file_path
from megatron_ru.utils.logging import RANK0, get_logger

log = get_logger(__name__)

Arrays = dict[str, np.ndarray]
Builder = Callable[[], tuple[Arrays, dict[str, Any]]]


_digests: dict[tuple[str, int, int, int], str] = {}


def dataset_fingerprint(prefix: str) -> dict[str, Any]:
    """Sizes of ``.bin``/``.idx`` and a BLAKE2 digest of the ``.idx`` content.

    The digest is remembered per (path, inode, size, mtime) within a process, so the train,
    valid and test splits of one dataset read the ``.idx`` once; a rewritten file (new inode
    or mtime) is hashed again.
    """
    idx_path, bin_path = os.path.abspath(index_file_path(prefix)), data_file_path(prefix)
    st = os.stat(idx_path)
    memo_key = (idx_path, st.st_ino, st.st_size, st.st_mtime_ns)
    if memo_key not in _digests:
        digest = hashlib.blake2b(digest_size=16)
        with open(idx_path, "rb") as f:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                digest.update(chunk)
        _digests[memo_key] = digest.hexdigest()
    return {"idx_bytes": st.st_size, "bin_bytes": os.path.getsize(bin_path), "idx_blake2b": _digests[memo_key]}


def description_key(description: dict[str, Any]) -> str:
    """Stable hash of a JSON-able description (sorted keys)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def default_cache_dir(prefix: str) -> str:
    """``index-cache/`` next to the data when that directory is writable, else a per-user temp dir."""
    data_dir = os.path.dirname(os.path.abspath(prefix))
    if os.access(data_dir, os.W_OK):
        return os.path.join(data_dir, "index-cache")
    return os.path.join(tempfile.gettempdir(), f"megatron_ru-index-cache-{os.getuid()}")


class IndexCache:
    """One cache entry: a set of named arrays plus a completion marker."""

    def __init__(self, cache_dir: str, label: str, description: dict[str, Any]) -> None:
        self.cache_dir = cache_dir
        self.description = description
        self.key = description_key(description)
        self.stem = os.path.join(cache_dir, f"{label}-{self.key}")
        self.marker = self.stem + ".done"

    def path(self, name: str) -> str:
        return f"{self.stem}-{name}.npy"

    def complete(self) -> bool:
        if not os.path.exists(self.marker):
            return False
        names = self._read_marker()["arrays"]
        return all(os.path.exists(self.path(n)) for n in names)

    def _read_marker(self) -> dict[str, Any]:
        try:
            with open(self.marker, encoding="utf-8") as f:
                info = json.load(f)
            if not isinstance(info, dict) or not isinstance(info.get("arrays"), list):
                raise ValueError("no list of arrays")
            return info
        except ValueError as e:  # JSON or UTF-8: written by something else
            raise self.damaged(self.marker, f"{type(e).__name__}: {str(e)[:120]}") from None

    def damaged(self, path: str, why: str) -> ValueError:
        """The error for a damaged file of this entry: names it and how to rebuild the entry."""
        return ValueError(f"dataset index cache file {path} is damaged ({why}): delete the files {self.stem}-* "
                          f"and {self.marker} (or the whole cache directory, --data-cache-path) and run again to "
                          f"rebuild them")

    def load(self) -> tuple[Arrays, dict[str, Any]]:
        info = self._read_marker()
        names, meta = info["arrays"], info.get("meta") or {}
        arrays = {}
        for n in names:
            path = self.path(n)
            try:
                arrays[n] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:  # numpy's own words do not name the file
                raise self.damaged(path, f"{type(e).__name__}: {str(e)[:120]}") from None
        return arrays, meta

    def save(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        """Write every array under a temporary name, rename it, then write the marker last."""
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for name, arr in arrays.items():
                _write_atomic(self.path(name), lambda f, a=arr: np.save(f, np.ascontiguousarray(a), allow_pickle=False))
            body = json.dumps({"description": self.description, "meta": meta, "arrays": sorted(arrays)},
                              indent=1, sort_keys=True).encode()
            _write_atomic(self.marker, lambda f: f.write(body))
        except OSError as exc:
            raise OSError(f"cannot write the dataset index cache in {self.cache_dir} ({exc}); "
                          "point --data-cache-path at a writable directory (shared by all nodes)") from exc


def _write_atomic(path: str, write: Callable[[Any], Any]) -> None:
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def get_or_build(cache: IndexCache, build: Builder, *, is_builder_rank: bool,
                 barrier: Callable[[], None] | None,
                 check: Callable[[IndexCache, Arrays], None] | None = None) -> tuple[Arrays, dict[str, Any], bool]:
    """Arrays of ``cache``, built by the builder rank if missing; returns (arrays, meta, built_here).
    ``check(cache, arrays)`` validates arrays loaded from the cache (raising ``cache.damaged(...)``).

    Every rank calls ``barrier`` exactly once, also when the build fails (then the other ranks
    find no cache, rebuild and fail with the same error instead of hanging). A rank that finds
    no complete entry after the barrier (a cache directory not shared between nodes) builds
    the indices itself and says so.
    """
    built: tuple[Arrays, dict[str, Any]] | None = None
    if is_builder_rank and not cache.complete():
        try:
            built = build()
            cache.save(*built)
        except BaseException:
            if barrier is not None:
                barrier()
            raise
    if barrier is not None:
        barrier()
    if built is not None:
        return built[0], built[1], True
    if cache.complete():
        arrays, meta = cache.load()
        log.info("loaded dataset indices from %s", cache.stem, extra=RANK0)
        if check is not None:
            check(cache, arrays)
        return arrays, meta, False
    if not is_builder_rank:
        log.warning("dataset index cache %s not found after the builder rank wrote it: the cache directory "
                    "is probably not shared between nodes; building the indices here. Set --data-cache-path "
                    "to a shared directory to avoid this.", cache.stem)
    arrays, meta = build()
    return arrays, meta, True
