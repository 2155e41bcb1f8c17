"""Input files → batches of raw JSONL bytes, streamed with bounded memory.

A batch is whole lines only (``data`` ends at a newline or at the end of the file; a line longer
than a batch is one piece without its newline, counted in ``trailing``) plus the file name and
number of its first line, so that workers can report ``file:line``; ``data`` is bytes, or, for a
plain file whose batches are parsed in this process, a range of the mapped file. The reader
decodes and parses nothing (with worker threads the main thread then parses each batch ahead of
them: ``Encoder.parse``). ``.gz`` files are decompressed on the fly.
"""
from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional, Sequence

try:  # csrc/jsonl.cpp: a huge line read into huge pages with the GIL released; newlines counted
    from megatron_ru.data.preprocess._jsonl import count_newlines, read_range
except ImportError:  # not built: the file object's read (same bytes)
    count_newlines = read_range = None

_BLOCK = 1 << 20
MIN_TAIL_BATCH = 64 << 10
# Windows tools start UTF-8 files with a byte-order mark; JSON parsers reject it. It is dropped
# at the start of a file only (anywhere else it stays an invalid-JSON error).
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Segment:
    """Bytes ``start:end`` of ``path`` (``end`` None = to the end), whose first line is number
    ``first_line``. ``.gz`` files are always whole segments."""

    path: str
    start: int = 0
    end: Optional[int] = None
    first_line: int = 1


@dataclass(frozen=True)
class MappedLines:
    """Whole lines left in the memory-mapped file, ``mm[start:end]`` (``read_batches(mapped=True)``,
    for batches parsed in this process): parsed where they lie (``Encoder.parse``), never copied
    into a batch. Reading, joining the line cut by a read, splitting into lines and counting them
    took 0.6 of the tool's 1.6 s outside the tokenizer on 300 MB (cProfile); a 100 MB line read
    into memory took 0.015-0.21 s of page faults here."""

    mm: object  # mmap.mmap
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def __bytes__(self) -> bytes:
        return self.mm[self.start:self.end]

    def release(self) -> None:
        """Drop the range's pages from this process (parsed: the values are copies; a span into
        it faults its pages in again from the page cache), so that the resident size stays that
        of the batches in flight rather than growing to the file's."""
        import mmap

        page = mmap.PAGESIZE
        first = self.start // page * page
        if self.end > first:
            self.mm.madvise(mmap.MADV_DONTNEED, first, self.end - first)


@dataclass
class Batch:
    path: str
    first_line: int
    data: "bytes | MappedLines"
    # input bytes after ``data`` that belong to this batch: the newline of a line longer than a
    # batch, which is read without it (so that splitting the batch into lines copies nothing)
    trailing: int = 0
    # set by Encoder.parse (the lines, and the C++ fast path's values per line) when the main thread
    # parses for worker threads; ``data`` is then released
    lines: Optional[list] = None
    values: Optional[list] = None
    buffer: object = None  # what the values' spans point into: ``data``, or the mapped file
    size: int = 0  # input bytes of the batch (set when parsed)


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by ``--input``: each entry is a file or a glob (matches sorted); every entry
    must match something, and a file named twice is read once."""
    files: list[str] = []
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            matches = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"--input {pat}: the pattern matches no file")
            files.extend(matches)
        elif os.path.isfile(pat):
            files.append(pat)
        else:
            raise FileNotFoundError(f"--input {pat}: no such file")
    seen: set[str] = set()
    return [f for f in files if not (os.path.abspath(f) in seen or seen.add(os.path.abspath(f)))]


def _open(path: str) -> BinaryIO:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _segment_size(seg: Segment) -> Optional[int]:
    if seg.path.endswith(".gz"):
        return None
    return (os.path.getsize(seg.path) if seg.end is None else seg.end) - seg.start


def read_batches(segments: Sequence[Segment], batch_bytes: int, mapped: bool = False) -> Iterator[Batch]:
    """Batches of about ``batch_bytes`` whole lines; a line longer than that is one batch. With
    ``mapped`` (batches parsed in this process, the C++ extension built), a plain file's batches
    are :class:`MappedLines` ranges of the mapped file (:func:`_mapped_batches`).

    When the input size is known (no ``.gz``), batches shrink over the last ``8 × batch_bytes``
    of input (to an eighth of what is left, at least ``MIN_TAIL_BATCH``), so that parallel
    workers finish together instead of one of them tokenizing a whole last batch alone. Batch
    boundaries never change the output (documents are tokenized independently, results are
    written in input order)."""
    sizes = [_segment_size(seg) for seg in segments]
    left = None if any(n is None for n in sizes) else sum(sizes)
    for seg, size in zip(segments, sizes):
        if mapped and size is not None and count_newlines is not None:
            yield from _mapped_batches(seg, size, batch_bytes, left)
            if left is not None:
                left -= size
            continue
        line_no = seg.first_line
        with _open(seg.path) as f:
            if seg.start:
                f.seek(seg.start)
            remaining = None if seg.end is None else seg.end - seg.start
            at_file_start = seg.start == 0
            pos = seg.start  # file offset of the next read (plain files)
            pending: list[bytes] = []  # the start of a line (and, in .gz files, blocks of a long line)
            while True:
                want = batch_bytes if left is None else min(batch_bytes, max(MIN_TAIL_BATCH, left // 8))
                if remaining is not None:
                    want = min(want, remaining)
                block_start = pos
                block = f.read(want) if want > 0 else b""
                pos += len(block)
                if remaining is not None:
                    remaining -= len(block)
                if left is not None:
                    left -= len(block)
                if at_file_start:
                    at_file_start = False
                    if block.startswith(UTF8_BOM):
                        block = block[len(UTF8_BOM):]
                        block_start += len(UTF8_BOM)
                        if not block:
                            continue
                if not block:
                    if pending:
                        yield Batch(seg.path, line_no, b"".join(pending))
                    break
                cut = block.rfind(b"\n") + 1
                if cut == 0 and size is not None:  # a line longer than a batch: read it whole, in one piece
                    start = block_start - sum(len(p) for p in pending)
                    end = seg.start + size
                    newline = _find_newline(f, pos, end)
                    stop = end if newline < 0 else newline
                    del block, pending[:]
                    data = _read_at(f, start, stop - start)
                    trailing = 0 if newline < 0 else 1
                    f.seek(stop + trailing)
                    consumed = stop + trailing - pos
                    pos = stop + trailing
                    if remaining is not None:
                        remaining -= consumed
                    if left is not None:
                        left -= consumed
                    out = [Batch(seg.path, line_no, data, trailing)]
                    line_no += trailing
                    del data
                    yield out.pop()
                    continue
                if cut == 0:
                    pending.append(block)
                    continue
                data = b"".join(pending + [block[:cut]]) if pending else block[:cut]
                out = [Batch(seg.path, line_no, data)]
                line_no += block.count(b"\n", 0, cut)  # (the pending blocks hold no newline)
                pending = [block[cut:]] if cut < len(block) else []
                del data, block  # while suspended, the generator holds no copy of the batch (a 100 MB line)
                yield out.pop()


def _mapped_batches(seg: Segment, size: int, batch_bytes: int, left: Optional[int]) -> Iterator[Batch]:
    """``read_batches`` for a plain file mapped into memory: batches of whole lines as ranges of
    the mapping; ``left``: the input bytes left from this segment's start (shrinks the batches
    near the end). A last line without a newline that is longer than a batch is copied out (the parser needs a
    newline, or a bytes object, after a line)."""
    import mmap

    if size == 0:
        return
    with open(seg.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    end = seg.start + size
    if len(mm) < end:
        raise OSError(f"{seg.path}: the file shrank while it was read (expected {end} bytes)")
    pos = done = seg.start
    line_no = seg.first_line
    if pos == 0 and mm[:len(UTF8_BOM)] == UTF8_BOM:
        pos = len(UTF8_BOM)
    while pos < end:
        want = batch_bytes if left is None else min(batch_bytes, max(MIN_TAIL_BATCH, left // 8))
        stop = min(pos + max(want, 1), end)
        cut = end if stop == end else mm.rfind(b"\n", pos, stop) + 1
        trailing = 0
        if cut == 0:  # a line longer than a batch: the whole line, without its newline
            newline = mm.find(b"\n", stop, end)
            if newline < 0:
                data: "bytes | MappedLines" = mm[pos:end]
                cut = end
            else:
                data, cut, trailing = MappedLines(mm, pos, newline), newline + 1, 1
            lines = trailing
        else:
            data = MappedLines(mm, pos, cut)
            lines = count_newlines(mm, pos, cut)
        batch = Batch(seg.path, line_no, data, trailing)
        if left is not None:
            left -= cut - done
        done = pos = cut
        line_no += lines
        del data
        yield batch
        del batch


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    """``size`` bytes of the plain file ``f`` from ``offset``: the C++ reader fills a bytes object
    backed by huge pages (a 100 MB line: 0.09-0.13 s of 4 KB page faults with ``f.read``)."""
    if read_range is not None:
        data = read_range(f.fileno(), offset, size)
    else:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{f.name}: the file shrank while it was read (expected {size} bytes at offset {offset})")
    return data


def _find_newline(f: BinaryIO, start: int, end: int) -> int:
    """Offset of the first newline in ``[start, end)`` of the open plain file ``f``, or -1 (a
    search of the mapped file: no copy of a 100 MB line just to find where it ends)."""
    import mmap

    if end <= start:
        return -1
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return mm.find(b"\n", start, end)


def _line_start_at_or_after(path: str, offset: int) -> tuple[int, int]:
    """First line start at or after ``offset`` and the number of that line."""
    with open(path, "rb") as f:
        lines = 0
        pos = 0
        # Count newlines before the offset (fast: bytes.count on blocks).
        while pos < offset:
            block = f.read(min(_BLOCK, offset - pos))
            if not block:
                break
            lines += block.count(b"\n")
            pos += len(block)
        if offset > 0:
            f.seek(offset - 1)
            prev = f.read(1)
            if prev != b"\n":
                while True:
                    block = f.read(_BLOCK)
                    if not block:
                        return os.path.getsize(path), lines + 1
                    i = block.find(b"\n")
                    if i >= 0:
                        return f.tell() - len(block) + i + 1, lines + 2
        return offset, lines + 1


def plan_partitions(files: Sequence[str], partitions: int) -> list[list[Segment]]:
    """Cut the concatenated input into ``partitions`` contiguous parts of similar size, at line
    boundaries (``.gz`` files are not cut). Empty parts are dropped."""
    if partitions <= 1:
        return [[Segment(p) for p in files]]
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    # Cut positions as (file index, byte offset, line number).
    cuts: list[tuple[int, int, int]] = [(0, 0, 1)]
    for k in range(1, partitions):
        target = total * k // partitions
        acc = 0
        for i, size in enumerate(sizes):
            if acc + size > target:
                off = target - acc
                if files[i].endswith(".gz"):
                    cut = (i, 0, 1) if off < size / 2 else (i + 1, 0, 1)
                else:
                    pos, line = _line_start_at_or_after(files[i], off)
                    cut = (i, pos, line) if pos < size else (i + 1, 0, 1)
                break
            acc += size
        else:
            cut = (len(files), 0, 1)
        if cut > cuts[-1]:
            cuts.append(cut)
    cuts.append((len(files), 0, 1))
    parts: list[list[Segment]] = []
    for (fi, off, line), (fj, off_end, _) in zip(cuts[:-1], cuts[1:]):
        segs = []
        for i in range(fi, min(fj + 1, len(files))):
            start, first = (off, line) if i == fi else (0, 1)
            end = off_end if i == fj else None
            if end is not None and end <= start:
                continue
            segs.append(Segment(files[i], start, end, first))
        if segs:
            parts.append(segs)
    return parts
