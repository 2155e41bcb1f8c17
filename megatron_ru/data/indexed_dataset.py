"""Megatron-compatible memory-mapped indexed dataset (``.bin`` + ``.idx``, "MMIDIDX" v1).

The byte layout is documented in docs/data_format.md; in short, the ``.idx`` file is::

    magic        9 bytes   b"MMIDIDX\\x00\\x00"
    version      uint64    1
    dtype code   uint8     see DTYPE_CODES
    n_seq        uint64    number of sequences
    n_doc_idx    uint64    length of the document index (= documents + 1)
    lengths      int32[n_seq]      tokens per sequence
    pointers     int64[n_seq]      byte offset of each sequence in .bin
    doc_index    int64[n_doc_idx]  sequence index where each document starts, then n_seq

and ``.bin`` is every sequence's tokens back to back in that dtype. All integers are
little-endian. A dataset written here reads in Megatron-LM and vice versa.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_fitting_dtype(vocab_size: int | None) -> type:
    """Megatron's rule: uint16 when the vocabulary is under 65,500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


def _tmp(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class IndexedDatasetBuilder:
    """Streams sequences into a ``.bin`` and writes the ``.idx`` on :meth:`finalize`.

    Nothing at the final paths exists until ``finalize`` succeeds: both files are written
    under temporary names, the ``.bin`` is renamed first and the ``.idx`` last, so a crash at
    any point never leaves an ``.idx`` that looks valid. Call :meth:`abort` (or use the
    builder as a context manager) to remove the temporary files on failure.
    """

    def __init__(self, bin_path: str, dtype: type = np.int32) -> None:
        if np.dtype(dtype) not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {dtype!r}; use one of {sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self._tmp_bin = _tmp(bin_path)
        os.makedirs(os.path.dirname(os.path.abspath(bin_path)), exist_ok=True)
        self._file = open(self._tmp_bin, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self._finalized = False

    # -- writing ----------------------------------------------------------------------
    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (a document or, in paragraph mode, one paragraph)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form it."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int]) -> None:
        """Append a whole document given as concatenated tokens and per-sequence lengths."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if int(np.sum(lengths)) != arr.size:
            raise ValueError(f"add_document: lengths sum to {int(np.sum(lengths))} but {arr.size} tokens were given")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def add_documents(self, tokens: np.ndarray | list[np.ndarray], sequence_lengths: Sequence[int] | np.ndarray,
                      sequences_per_document: Sequence[int] | np.ndarray) -> None:
        """Append many documents at once: ``tokens`` back to back (an array, or a list of arrays
        written one after the other), the length of each sequence, and how many sequences each
        document has (no per-sequence Python work)."""
        arrays = [np.asarray(t, dtype=self.dtype) for t in (tokens if isinstance(tokens, list) else [tokens])]
        size = sum(a.size for a in arrays)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != size or int(counts.sum()) != lengths.size:
            raise ValueError(f"add_documents: {size} tokens, sequence lengths summing to {int(lengths.sum())}, "
                             f"{lengths.size} sequences but sequences_per_document sums to {int(counts.sum())}")
        for a in arrays:
            self._file.write(memoryview(np.ascontiguousarray(a)).cast("B"))  # (no copy into a bytes object)
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.tolist())
        self.document_indices.extend((base + np.cumsum(counts)).tolist())

    def add_index(self, prefix: str) -> None:
        """Append every document of the finished dataset at ``prefix`` (for merging shards)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix}: dtype {other.dtype} differs from {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        del other
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._file, 16 * 1024 * 1024)

    # -- finishing --------------------------------------------------------------------
    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files into place (``.bin`` first, ``.idx`` last)."""
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        tmp_idx = _tmp(idx_path)
        try:
            write_index(tmp_idx, self.dtype, self.sequence_lengths, self.document_indices)
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(tmp_idx, idx_path)
        except BaseException:
            for p in (tmp_idx, self._tmp_bin):
                if os.path.exists(p):
                    os.remove(p)
            raise
        self._finalized = True

    def abort(self) -> None:
        """Drop everything written so far (temporary files only; final paths untouched)."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._finalized:
            self.abort()


def write_index(path: str, dtype: np.dtype, lengths: Sequence[int], document_indices: Sequence[int]) -> None:
    """Write an ``.idx`` file for sequences stored back to back in ``dtype``."""
    lengths_arr = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths_arr.size, dtype=np.int64)
    if lengths_arr.size > 1:
        np.cumsum(lengths_arr[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[np.dtype(dtype)]))
        f.write(struct.pack("<Q", lengths_arr.size))
        f.write(struct.pack("<Q", docs.size))
        f.write(lengths_arr.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))
        f.flush()
        os.fsync(f.fileno())


_CHECK_CHUNK = 1 << 22  # entries per vectorised step: bounded temporaries on huge indices


def check_index_arrays(idx_path: str, lengths: np.ndarray, pointers: np.ndarray, document_indices: np.ndarray,
                       itemsize: int) -> None:
    """The index's own consistency, from the index alone (the token data is never read): the
    document index starts at 0, never decreases and ends at the sequence count; lengths are not
    negative; each pointer is the previous one plus the previous length in bytes of the dtype.
    A flipped bit in a count, a length or the dtype code fails here instead of training on part
    of the data or on misread tokens."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{idx_path}: corrupt index: {what}; rebuild the dataset with tools/preprocess_data.py")

    n_seq, n_doc = lengths.size, document_indices.size
    if n_doc < 1:
        raise bad("the document index is empty (it holds at least the final sequence count)")
    if int(document_indices[0]) != 0 or int(document_indices[-1]) != n_seq:
        raise bad(f"the document index runs from {int(document_indices[0])} to {int(document_indices[-1])}, "
                  f"expected 0 to the sequence count {n_seq}")
    if n_seq and int(pointers[0]) != 0:
        raise bad(f"the first sequence starts at byte {int(pointers[0])}, expected 0")
    for lo in range(0, max(n_seq, n_doc), _CHECK_CHUNK):
        hi = lo + _CHECK_CHUNK
        docs = np.asarray(document_indices[lo:hi + 1])
        if docs.size > 1 and np.any(docs[1:] < docs[:-1]):
            k = lo + int(np.argmax(docs[1:] < docs[:-1]))
            raise bad(f"the document index decreases at document {k} ({int(docs[k - lo])} -> {int(docs[k - lo + 1])})")
        lens = np.asarray(lengths[lo:hi])
        if lens.size and int(lens.min()) < 0:
            k = lo + int(np.argmin(lens))
            raise bad(f"sequence {k} has negative length {int(lengths[k])}")
        ptrs = np.asarray(pointers[lo:hi + 1])
        if ptrs.size > 1:
            step = lens[:ptrs.size - 1].astype(np.int64) * itemsize
            wrong = ptrs[1:] != ptrs[:-1] + step
            if np.any(wrong):
                k = lo + int(np.argmax(wrong))
                raise bad(f"sequence {k + 1} starts at byte {int(pointers[k + 1])}, but sequence {k} starts at "
                          f"byte {int(pointers[k])} and holds {int(lengths[k])} tokens of {itemsize} bytes "
                          f"(a length, a pointer or the dtype code in the header is wrong)")


class IndexedDataset:
    """Read-only, zero-copy view of a ``<prefix>.bin/.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy view into the memory map; ``ds.get(i, offset,
    length)`` slices it without copying. ``document_indices`` has ``num_documents + 1``
    entries: document ``d`` is sequences ``document_indices[d]:document_indices[d+1]``.
    """

    #: :meth:`open`'s datasets by (prefix, the files' identity)
    _opened: dict[tuple, "IndexedDataset"] = {}

    @classmethod
    def open(cls, prefix: str) -> "IndexedDataset":
        """The dataset at ``prefix``, opened (its index parsed, both files mapped) once per process and file
        version: the flag checks, the validation-pass count and the dataset builder share it."""
        try:
            stats = tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in
                          (os.stat(index_file_path(prefix)), os.stat(data_file_path(prefix))))
        except OSError:
            return cls(prefix)  # the constructor says which file is missing
        key = (os.path.abspath(prefix), stats)
        if key not in cls._opened:
            if len(cls._opened) >= 64:  # each holds two mapped files (and their descriptors)
                cls._opened.pop(next(iter(cls._opened)))
            cls._opened[key] = cls(prefix)
        return cls._opened[key]

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for p in (idx_path, bin_path):
            if not os.path.exists(p):
                raise FileNotFoundError(
                    f"dataset file {p} not found; --data-path takes the prefix without .bin/.idx "
                    f"(e.g. 'corpus_text_document'), as written by tools/preprocess_data.py")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise ValueError(f"{idx_path}: truncated index ({idx_size} bytes, the header alone is {HEADER_SIZE}); rebuild it with tools/preprocess_data.py")
        if header[:9] != MAGIC:
            raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (magic {header[:9]!r}, expected {MAGIC!r}); "
                             "was it written by the legacy 'lazy'/'cached' format? Rebuild it with tools/preprocess_data.py")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version} is not supported (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} in the header (valid: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size != expected:
            what = "truncated index" if idx_size < expected else "inconsistent index"
            raise ValueError(f"{idx_path}: {what}: header announces {n_seq} sequences and {n_doc} "
                             f"document-index entries ({expected} bytes) but the file has {idx_size} bytes; "
                             "rebuild it with tools/preprocess_data.py")
        self._idx_mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_mmap, dtype="<i4", count=n_seq, offset=off)
        off += n_seq * 4
        self.sequence_pointers = np.frombuffer(self._idx_mmap, dtype="<i8", count=n_seq, offset=off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(self._idx_mmap, dtype="<i8", count=n_doc, offset=off)
        check_index_arrays(idx_path, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                           self.dtype.itemsize)
        bin_size = os.path.getsize(bin_path)
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if bin_size != needed:
            raise ValueError(f"{bin_path}: size {bin_size} bytes disagrees with its index {idx_path}, which needs "
                             f"{needed} bytes of {self.dtype} tokens; the pair is from different runs or the .bin "
                             "is truncated: rebuild both with tools/preprocess_data.py")
        self._bin_mmap = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``idx`` (a view, no copy)."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        ptr = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_mmap, dtype=self.dtype, count=length, offset=ptr)

    def __getitem__(self, idx: int) -> np.ndarray:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def document(self, doc: int) -> list[np.ndarray]:
        """The sequences of document ``doc``."""
        start, end = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(start, end)]

