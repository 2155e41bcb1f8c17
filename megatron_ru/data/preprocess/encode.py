"""One batch of JSONL lines → token arrays per output dataset (runs in worker processes).

Parsing, validation, splitting and tokenization all happen here, so the main process only
moves bytes in and numpy arrays out. Every outcome is counted; the first invalid line (in file
order) is reported with its file, line number and a fix unless ``skip_invalid``.
"""
from __future__ import annotations

import json
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable, Iterator, Optional

import numpy as np

from megatron_ru.data.preprocess.reader import UTF8_BOM, Batch, MappedLines
from megatron_ru.data.preprocess.cuts import cut_document, cut_stream
from megatron_ru.data.preprocess.text import split_paragraphs, split_sentences
from megatron_ru.data.tokenizer import Tokenizer
from megatron_ru.utils.threads import kept_pool

try:  # csrc/jsonl.cpp: string values straight from the line's bytes (see Encoder._fields)
    from megatron_ru.data.preprocess._jsonl import extract_strings_lines, unescape_span
except ImportError:  # not built: every line goes through json.loads (same results, slower)
    extract_strings_lines = unescape_span = None


@dataclass(frozen=True)
class EncodeOptions:
    json_keys: tuple[str, ...] = ("text",)
    group_by_key: Optional[str] = None
    split_sentences: bool = False
    keep_newlines: bool = False
    split_paragraphs: bool = False
    append_eod: bool = False
    skip_invalid: bool = False
    chunk_chars: int = 100_000
    dtype: str = "uint16"
    # threads for the tokenizer call that encodes the pieces of a cut (huge) document: the pieces
    # of one document are spread over all of them (tools/preprocess_data.py: --workers)
    spread_threads: int = 1
    # a text whose JSON string takes at least this many bytes is decoded and cut as a stream while
    # its first pieces are tokenized (Encoder._encode_stream); None: STREAM_PIECES × chunk_chars; 0: never
    stream_bytes: Optional[int] = None


@dataclass
class Output:
    """Documents for one dataset: tokens back to back (one array, or for a huge document the
    arrays of its pieces, written one after the other), tokens per sequence, sequences per doc."""

    tokens: "np.ndarray | list[np.ndarray]"
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass
class BatchResult:
    outputs: dict[tuple[Optional[str], str], Output] = field(default_factory=dict)
    lines: int = 0
    bytes: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    uncut: int = 0  # texts over chunk_chars tokenized whole (the tokenizer has no safe cut)


# a cut document goes to the tokenizer this many pieces per thread at a time (see Encoder._encode_pieces)
GROUP_PIECES_PER_THREAD = 8
# texts of this many pieces or more are streamed (EncodeOptions.stream_bytes), decoded this many
# bytes of their JSON string at a time
STREAM_PIECES = 4
# pieces per task of the pool (Encoder._encode_pieces_pooled) for tokenizers that hand out arrays
POOLED_PIECES_PER_TASK = 4
STREAM_CHUNK_BYTES = 1 << 20
STREAM_STR_CHUNK_BYTES = 1 << 18
CHECK_ARRAYS_TOGETHER = 1024  # id arrays per vocabulary check (Encoder._checked)
WRITE_PIECES_OVER = 1 << 22  # tokens of one output of a batch: written array by array (Encoder._assemble)
_NON_SPACE = re.compile(r"\S")
_NON_SPACE_BYTES = re.compile(rb"\S")
# In UTF-8 text: an ASCII byte that is not whitespace for ``\s``, or the lead byte of a character
# that cannot be whitespace (every non-ASCII whitespace character starts with C2, E1, E2 or E3;
# continuation bytes are 80-BF). Finding one proves the text is not blank without decoding it.
_NOT_BLANK_UTF8 = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xbf\xc2\xe1\xe2\xe3]")


def is_blank(text) -> bool:
    """True when ``text`` (str, UTF-8 bytes or a :class:`Span`) is empty or whitespace only (regex ``\\s``)."""
    if isinstance(text, Span):
        return text.is_blank()
    if isinstance(text, bytes):
        if _NOT_BLANK_UTF8.search(text) is not None:
            return False
        text = text.decode("utf-8")
    return _NON_SPACE.search(text) is None  # (no copy of a possibly huge text, unlike strip)


class Invalid(Exception):
    """A line the tool cannot use: ``reason`` is the summary bucket, ``fix`` the advice."""

    def __init__(self, reason: str, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


@dataclass(frozen=True)
class Span:
    """A long string value left in its line: ``line[start:end]`` are the contents of a JSON string
    that the C++ parser has checked (csrc/jsonl.cpp, ``span_min``), decoded part by part
    (:meth:`chunks`) so that a huge text is never held decoded as a whole. ``line`` is the batch's
    bytes, or the mapped file of a :class:`MappedLines` batch (offsets in it)."""

    line: object
    start: int
    end: int

    def decode(self) -> bytes:
        return unescape_span(self.line, self.start, self.end)

    def chunks(self, size: int = STREAM_CHUNK_BYTES) -> Iterator[bytes]:
        """The text in UTF-8 parts of about ``size`` bytes of JSON, each ending before a literal
        space or a UTF-8 lead byte of the line (never inside an escape sequence or a character)."""
        a, end = self.start, self.end
        while a < end:
            b = end if end - a <= size else _split_point(self.line, a, a + size, end)
            yield unescape_span(self.line, a, b)
            a = b

    def is_blank(self) -> bool:
        first = next(self.chunks(4096), b"")
        return is_blank(first) and is_blank(self.decode())


def _split_point(line: bytes, lo: int, want: int, end: int) -> int:
    """A position in ``(lo, end]`` near ``want`` where the JSON string contents ``line[lo:end]``
    can be split for :func:`unescape_span`: after the last literal space before ``want``, else at
    a UTF-8 lead byte just before it (neither can be inside an escape), else after the first space
    past it, else ``end``."""
    p = line.rfind(b" ", lo, want)
    if p >= 0:
        return p + 1
    for q in range(want - 1, max(lo, want - 64), -1):
        if line[q] >= 0xC0:
            return q
    p = line.find(b" ", want, end)
    return end if p < 0 else p + 1


def _parse(line, opts: EncodeOptions) -> tuple[Optional[str], list[str]]:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid("invalid UTF-8", f"invalid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start} of the line)",
                      "re-encode the file as UTF-8 (e.g. iconv -f <encoding> -t UTF-8)") from None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise Invalid("invalid JSON", f"invalid JSON ({e.msg} at column {e.colno})",
                      "each line must be one JSON object") from None
    del s  # the parsed copy is what we keep (matters for a 100 MB line)
    if not isinstance(obj, dict):
        raise Invalid("not a JSON object", f"expected a JSON object, got a JSON {_json_type(obj)}",
                      "each line must be one JSON object like {\"text\": \"...\"}")
    texts = []
    for key in opts.json_keys:
        if key not in obj:
            raise Invalid(f"missing key '{key}'", f"no key '{key}' (the object has keys {sorted(obj)[:8]})",
                          "choose the key with --json-keys")
        value = obj[key]
        if not isinstance(value, str):
            raise Invalid(f"non-string '{key}'", f"key '{key}' is a JSON {_json_type(value)}, not a string",
                          "store the text as a JSON string")
        texts.append(value)
    group = None
    if opts.group_by_key is not None:
        g = opts.group_by_key
        if g not in obj:
            raise Invalid(f"missing key '{g}'", f"no key '{g}' for --group-by-key (keys: {sorted(obj)[:8]})",
                          "give every line that key or choose another --group-by-key")
        value = obj[g]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise Invalid(f"bad '{g}' value", f"key '{g}' is a JSON {_json_type(value)}; --group-by-key needs a "
                          "string or integer", "fix the value")
        group = str(value)
    # A lone surrogate escape ("\\ud800") makes the tokenizer fail; that failure is reported
    # as invalid UTF-8 by _tokenize_one_by_one (checking every text here costs ~2% throughput).
    return group, texts


def _text(value) -> str:
    if isinstance(value, Span):
        value = value.decode()
    return value if isinstance(value, str) else value.decode("utf-8")


def _has_lone_surrogate(texts: list[str]) -> bool:
    try:
        for t in texts:
            t.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


class Encoder:
    def __init__(self, tokenizer: Tokenizer, opts: EncodeOptions) -> None:
        self.tok = tokenizer
        self.opts = opts
        self.dtype = np.dtype(opts.dtype)
        self._pools: dict = {}  # (pid, threads) -> pool of _encode_pieces_pooled
        self._keys = list(opts.json_keys) + ([opts.group_by_key] if opts.group_by_key is not None else [])
        # Texts stay UTF-8 bytes from the line to the tokenizer when nothing needs them as str.
        self._bytes_ok = tokenizer.accepts_utf8_bytes and not (opts.split_paragraphs or opts.split_sentences)
        # JSON strings of this many bytes or more stay in their line as a Span and are streamed (0: never)
        self._stream_bytes = 0
        if (extract_strings_lines is not None and tokenizer.cut_mode is not None
                and not (opts.split_paragraphs or opts.split_sentences)):
            self._stream_bytes = STREAM_PIECES * opts.chunk_chars if opts.stream_bytes is None else opts.stream_bytes

    def _fields(self, raw: Optional[bytes], values: Optional[list], buffer) -> tuple[Optional[str], list]:
        """(group, texts) of one line. ``values`` is the C++ fast path's result for it (csrc/jsonl.cpp:
        no Python objects for the whole line, the GIL released): used when the line is a
        well-formed object whose values are all strings; anything else — including every
        invalid line — goes through :func:`_parse`, which gives the same values or the error.
        Texts are UTF-8 bytes when the tokenizer takes them (no str round trip), else str; a value
        left where it lies (a span) is a :class:`Span` of ``buffer``, the batch's bytes or mapping.
        ``raw`` (the line) is None for a line the fast path parsed from the batch itself."""
        if values is not None and None not in values:
            n = len(self.opts.json_keys)
            values = [Span(buffer, *v) if isinstance(v, tuple) else v for v in values]
            group = _text(values[n]) if len(values) > n else None
            texts = values[:n] if self._bytes_ok else [v if isinstance(v, Span) else _text(v) for v in values[:n]]
            return group, texts
        return _parse(raw, self.opts)

    def _segments(self, text: str | bytes) -> list:
        o = self.opts
        if isinstance(text, bytes) and not self._bytes_ok:
            text = text.decode("utf-8")
        if o.split_paragraphs:
            return split_paragraphs(text)
        if o.split_sentences:
            return split_sentences(text, o.keep_newlines)
        return [text]

    def _chunks(self, seg: str | bytes) -> list:
        """``seg`` in pieces of about ``chunk_chars`` (bytes for ``bytes``), cut only where the
        tokenizer's ids of the pieces are those of the whole text (cuts.py); ``[seg]`` when it is
        short or the tokenizer has no safe cut."""
        n = self.opts.chunk_chars
        if len(seg) <= n:
            return [seg]
        tok = self.tok
        return cut_document(seg, n, tok.cut_mode, tok.cut_guards, tok.cut_start(seg))

    def parse(self, batch: Batch) -> Batch:
        """Split ``batch`` into lines and run the C++ JSON fast path over them (the GIL released),
        and, for a tokenizer that takes ``str`` only, decode the values' UTF-8: the first steps of
        :meth:`encode`, which the main thread runs ahead for worker threads so that they overlap
        tokenizing. With the C++ extension the lines are parsed where they lie (in the batch's
        bytes or the mapped file) and only those it leaves to ``json.loads`` are copied out.
        ``batch.data`` is released."""
        data = batch.data
        buffer, start, end = (data.mm, data.start, data.end) if isinstance(data, MappedLines) else (data, 0, len(data))
        batch.size = end - start + batch.trailing
        if extract_strings_lines is not None:
            entries = extract_strings_lines(buffer, start, end, self._keys, self._stream_bytes)
            lines = [buffer[e[0]:e[1]] if isinstance(e, tuple) else None for e in entries]
            values = [None if isinstance(e, tuple) else e for e in entries]
            if isinstance(data, MappedLines) and not any(isinstance(v, tuple) for e in values if e for v in e):
                data.release()  # (the values are copies: its pages can go)
        else:
            lines = bytes(data).split(b"\n") if isinstance(data, MappedLines) else data.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            values = None
        batch.data = b""
        batch.lines = lines
        batch.buffer = buffer if values is not None else None
        if values is not None and not self._bytes_ok:  # a tokenizer that takes str only: decode here too
            for i, v in enumerate(values):
                if v is not None and None not in v:
                    values[i] = [t if isinstance(t, tuple) else t.decode("utf-8") for t in v]
        batch.values = values
        return batch

    def encode(self, batch: Batch) -> BatchResult:
        """Tokenize ``batch``; its ``data`` is released (set to ``b""``) once split into lines, so
        that a 100 MB line is not held twice (a one-line batch without its newline splits into
        itself: no copy)."""
        if batch.lines is None:
            self.parse(batch)
        res = BatchResult(bytes=batch.size)
        o = self.opts
        lines, fast, buffer = batch.lines, batch.values, batch.buffer
        batch.lines = batch.values = batch.buffer = None
        res.lines = len(lines)
        # (line number, group, key, segments) per non-empty text, in input order
        docs: list[tuple[int, Optional[str], str, list[str]]] = []
        for i, raw in enumerate(lines):
            line_no = batch.first_line + i
            if raw is not None and _NON_SPACE_BYTES.search(raw) is None:  # (a parsed line is an object)
                res.skipped["blank line"] += 1
                continue
            lines[i] = None  # the parsed text is what we keep (matters for a 100 MB line)
            try:
                group, texts = self._fields(raw, fast[i] if fast is not None else None, buffer)
                del raw
                if fast is not None:
                    fast[i] = None
            except Invalid as e:
                if not self._skip(res, e, batch.path, line_no):
                    return res
                continue
            for key, text in zip(o.json_keys, texts):
                if is_blank(text):
                    self._count(res, f"empty '{key}'", batch.path, line_no)
                    continue
                docs.append((line_no, group, key, self._segments(text)))
            texts = text = None  # (docs holds the texts: _tokenize replaces them by their pieces)
        arrays = self._tokenize(docs, res, batch.path)
        if res.error is None:
            self._assemble(docs, arrays, res)
        return res

    def _tokenize(self, docs, res: BatchResult, path: str) -> list[Optional[list[list[np.ndarray]]]]:
        """Per document, per segment the id arrays (of the output dtype) of its pieces, which
        :meth:`_assemble` concatenates once with the rest of the batch; None for a document the
        tokenizer refused. The documents' texts are replaced by their pieces (``docs[i][3]``
        becomes a list of piece lists), so a huge text is not held twice."""
        chunks: list = []
        counts: list[int] = []
        streamed: list = []  # ids of the Span segments, in order
        chunk_chars = self.opts.chunk_chars
        try:
            for _, _, _, segs in docs:
                for j, seg in enumerate(segs):
                    if isinstance(seg, Span):
                        streamed.append(self._encode_stream(seg, res))
                        segs[j] = [seg]
                        counts.append(0)
                        continue
                    if len(seg) <= chunk_chars:  # (the usual case, inline: once per sentence with --split-sentences)
                        counts.append(1)
                        chunks.append(seg)
                        segs[j] = [seg]
                        continue
                    pieces = self._chunks(seg)
                    res.uncut += len(pieces) == 1
                    counts.append(len(pieces))
                    chunks.extend(pieces)
                    segs[j] = pieces
        except Exception:  # find the line that failed, to name it
            return self._tokenize_one_by_one(docs, res, path)
        # the pieces of a cut document go to every thread; other batches use the tokenizer's own
        # setting (the workers already run in parallel)
        cut = sum(1 for n in counts if n) < len(chunks)
        threads = self.opts.spread_threads if cut else None
        try:
            flat = self._encode_pieces(chunks, threads or 1, cut=cut)
        except Exception:  # find the line that failed, to name it
            return self._tokenize_one_by_one(docs, res, path)
        del chunks
        out: list[Optional[list[np.ndarray]]] = []
        k = 0
        n_iter = iter(counts)
        s_iter = iter(streamed)
        for _, _, _, segs in docs:
            per_seg = []
            for _ in segs:
                n = next(n_iter)
                per_seg.append(next(s_iter) if n == 0 else flat[k:k + n])
                flat[k:k + n] = [None] * n
                k += n
            out.append(per_seg)
        return out

    def _encode_pieces(self, chunks: Iterable, threads: int, cut: bool, stream: bool = False) -> list[np.ndarray]:
        """Ids of every chunk as arrays of the output dtype. When a document was ``cut``, at most
        ``GROUP_PIECES_PER_THREAD × threads`` pieces are with the tokenizer at a time (bounds what it
        holds for a huge document — its result objects for all of it took 2.0 GB for 100 MB with
        the tokenizers library). For tokenizers whose ids come out as Python lists
        (``pieces_one_per_task``: the tokenizers library) and several threads, each piece is a task
        of a thread pool that also converts its ids to an array, and a thread takes the next piece
        as soon as it is done: calls of a group of pieces left the library's threads idle while one
        thread converted the group's ids (100 MB, 2 threads: 25.7 s vs 22.9 s for one call with all
        the pieces; pooled 22.8 s; the former benchmarks/preprocess_huge_phases.py). SentencePiece and tiktoken
        hand out arrays; they keep groups of that many pieces, one call each (the call spreads them
        over the threads), except for a ``stream`` of pieces (:meth:`_encode_stream`), which goes to
        the pool for any tokenizer that releases the GIL, so that the pieces are tokenized on other
        threads while this one decodes and cuts the next ones; there, ``POOLED_PIECES_PER_TASK``
        pieces per task: one per task made SentencePiece Unigram 4-5 % slower on a 100 MB text
        (1 and 2 threads, 6 rounds against the limit in one process; 8 per task left too few tasks
        in flight at 1 thread)."""
        if cut and self.tok.releases_gil and (stream or (threads > 1 and self.tok.pieces_one_per_task)):
            return self._encode_pieces_pooled(chunks, threads, GROUP_PIECES_PER_THREAD * threads)
        num_threads = threads if threads > 1 else None
        if not cut:
            return self._checked(self.tok.tokenize_batch_arrays(list(chunks), num_threads=num_threads))
        out: list[np.ndarray] = []
        it = iter(chunks)
        while group := list(islice(it, GROUP_PIECES_PER_THREAD * threads)):
            out += self._checked(self.tok.tokenize_batch_arrays(group, num_threads=num_threads))
        return out

    def _encode_stream(self, span: Span, res: BatchResult) -> list[np.ndarray]:
        """Ids of a long text left in its line (a :class:`Span`): its JSON string is decoded
        ``STREAM_CHUNK_BYTES`` at a time and cut as it arrives (``cut_stream``: the pieces
        ``cut_document`` gives for the whole text), and the pieces go to the tokenizer's threads
        while this thread decodes and cuts the next ones. So the tokenizing starts after the first
        piece instead of after the whole text was parsed, copied, decoded and cut, and the decoded
        text is never held whole. A tokenizer that takes ``str`` — or decodes bytes itself — gets
        ``str`` decoded here (``STREAM_STR_CHUNK_BYTES`` at a time: decoding holds the GIL, which
        the tokenizing threads need between pieces), off the tokenizing threads, and pieces of
        ``chunk_chars`` characters as the limit's. Same ids as the whole text's."""
        tok, opts = self.tok, self.opts
        as_str = not self._bytes_ok or tok.decodes_utf8
        if tok.has_tie_runs and (as_str or span.line.find(b"\\u", span.start, span.end) >= 0):
            # no cut before the last run of spaces (cut_start), which is found in the line only when
            # the text is cut as bytes and no escape can make a space: else the text is decoded whole
            text = span.decode().decode("utf-8") if as_str else span.decode()
            pieces: Iterable = self._chunks(text)
            del text
        elif as_str:
            chunks = (c.decode("utf-8") for c in span.chunks(STREAM_STR_CHUNK_BYTES))
            pieces = cut_stream(chunks, opts.chunk_chars, tok.cut_mode, tok.cut_guards)
        else:
            first_cut = 0
            if tok.has_tie_runs:  # the last run of spaces, found in the line (no escape makes one)
                run_end = tok.cut_start(span.line, span.start, span.end) - 1
                if run_end >= 0:  # (just after a space: its place in the text is the length of what precedes)
                    first_cut = len(unescape_span(span.line, span.start, run_end)) + 1
            pieces = cut_stream(span.chunks(), opts.chunk_chars, tok.cut_mode, tok.cut_guards, first_cut)
        sizes: list[int] = []

        def counted() -> Iterator:
            for piece in pieces:
                sizes.append(len(piece))
                yield piece

        ids = self._encode_pieces(counted(), opts.spread_threads, cut=True, stream=True)
        res.uncut += len(sizes) == 1 and sizes[0] > opts.chunk_chars
        return ids

    def _checked(self, arrays) -> list[np.ndarray]:
        vocab = self.tok.vocab_size
        arrays = arrays if isinstance(arrays, list) else list(arrays)
        if len(arrays) > 1:
            # many short arrays (--split-sentences: one per sentence): their ids checked together,
            # CHECK_ARRAYS_TOGETHER at a time — two reductions per array cost as much as splitting
            # (38k sentences of the demo corpus: 0.06 s of 0.45 s)
            ok = True
            for i in range(0, len(arrays), CHECK_ARRAYS_TOGETHER):
                flat = np.concatenate(arrays[i:i + CHECK_ARRAYS_TOGETHER])
                if flat.size and ((flat.dtype.kind != "u" and flat.min() < 0) or flat.max() >= vocab):
                    ok = False  # (the loop below names the first array at fault, as before)
                    break
            del flat
            if ok:
                dtype = self.dtype
                return [a.astype(dtype, copy=False) for a in arrays]
        out = []
        for a in arrays:
            if a.size and ((a.dtype.kind != "u" and a.min() < 0) or a.max() >= vocab):
                raise ValueError(f"token id {int(a.max())} outside the vocabulary of {vocab}")
            out.append(a.astype(self.dtype, copy=False))
        return out

    def _encode_pieces_pooled(self, chunks: Iterable, threads: int, window: int) -> list[np.ndarray]:
        # (the ids are checked and converted by this thread, which only hands out pieces otherwise:
        # with one tokenizing thread that takes the work off it)
        per_task = 1 if self.tok.pieces_one_per_task else POOLED_PIECES_PER_TASK
        task = self.tok.tokenize_arrays_here
        out: list[np.ndarray] = []
        pending: deque = deque()
        it = iter(chunks)
        # one pool per process and thread count for the whole run: its threads keep what a tokenizer
        # keeps per thread (TikTokenizer: its own Encoding) from one document to the next
        pool = kept_pool(self._pools, threads, "pieces")
        try:
            while group := list(islice(it, per_task)):
                pending.append(pool.submit(task, group))
                if len(pending) >= max(1, window // per_task):
                    out += self._checked(pending.popleft().result())
            while pending:
                out += self._checked(pending.popleft().result())
        finally:
            for f in pending:  # (a failed document: the rest of its pieces are not tokenized)
                f.cancel()
            for f in pending:
                if not f.cancelled():
                    f.exception()  # (waits: no piece of it is still running when this returns)
        return out

    def _tokenize_one_by_one(self, docs, res: BatchResult, path: str) -> list[Optional[list[np.ndarray]]]:
        out: list[Optional[list[np.ndarray]]] = []
        for line_no, _, key, segs in docs:
            # (each segment is a list of pieces, or still its text where _tokenize stopped early)
            pieces = [[_text(p) for p in ([seg] if isinstance(seg, (str, bytes, Span)) else seg)] for seg in segs]
            try:
                out.append([[np.concatenate([np.asarray(self.tok.tokenize(c), dtype=np.int64) for c in seg]
                                            ).astype(self.dtype)] for seg in pieces])
            except Exception as e:
                if _has_lone_surrogate([p for seg in pieces for p in seg]):
                    err = Invalid("invalid UTF-8", f"key '{key}' contains a lone surrogate escape (\\ud800-\\udfff)",
                                  "fix the escape sequences in that line")
                else:
                    err = Invalid("tokenizer error", f"the tokenizer failed on key '{key}': {e}",
                                  "check the text and the tokenizer flags")
                if not self._skip(res, err, path, line_no):
                    return out
                out.append(None)
        return out

    def _assemble(self, docs, arrays, res: BatchResult) -> None:
        parts: dict[tuple[Optional[str], str], tuple[list, list, list]] = {}
        eod = np.asarray([self.tok.eod], dtype=self.dtype) if self.opts.append_eod else None
        for (line_no, group, key, _), segs in zip(docs, arrays):
            if segs is None:
                continue
            sizes = [sum(a.size for a in s) for s in segs]
            if not any(sizes):
                res.skipped[f"no tokens '{key}'"] += 1
                continue
            toks, lens, counts = parts.setdefault((group, key), ([], [], []))
            for s, n in zip(segs, sizes):
                if n:
                    toks.extend(s)
                    lens.append(n)
            if eod is not None:  # the end-of-document token belongs to the document's last sequence
                toks.append(eod)
                lens[-1] += 1
            counts.append(sum(1 for n in sizes if n))
            res.documents += 1
        for k, (toks, lens, counts) in parts.items():
            size = sum(lens)
            # (ids checked in _encode_pieces) one array, except for millions of tokens (a huge document's
            # pieces): written as they are, not copied once more (55 MB: 0.06 s of the main thread)
            tokens = toks if size > WRITE_PIECES_OVER else np.concatenate(toks) if len(toks) > 1 else toks[0]
            res.tokens += size
            res.outputs[k] = Output(tokens, np.asarray(lens, dtype=np.int32), np.asarray(counts, dtype=np.int64))

    def _count(self, res: BatchResult, reason: str, path: str, line_no: int) -> None:
        res.skipped[reason] += 1
        res.first_skipped.setdefault(reason, f"{path}:{line_no}")

    def _skip(self, res: BatchResult, e: Invalid, path: str, line_no: int) -> bool:
        """Count ``e`` and return True to go on, or record the error and return False."""
        if self.opts.skip_invalid:
            self._count(res, e.reason, path, line_no)
            return True
        res.error = (f"{path}:{line_no}: {e.detail}; {e.fix}, or pass --skip-invalid to skip such lines "
                     "(they are counted in the summary)")
        return False


def iter_texts(paths: list[str], json_keys: tuple[str, ...] = ("text",), skip_invalid: bool = False):
    """Texts of every ``json_keys`` entry of every line of ``paths`` (JSONL, ``.gz`` ok), for
    tools that need plain text (tokenizer training); bad lines fail with file:line."""
    import gzip

    opts = EncodeOptions(json_keys=json_keys, skip_invalid=skip_invalid)
    for path in paths:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            for line_no, raw in enumerate(f, 1):
                if line_no == 1 and raw.startswith(UTF8_BOM):
                    raw = raw[len(UTF8_BOM):]
                if not raw.strip():
                    continue
                try:
                    _, texts = _parse(raw.rstrip(b"\r\n"), opts)
                except Invalid as e:
                    if skip_invalid:
                        continue
                    raise ValueError(f"{path}:{line_no}: {e.detail}; {e.fix}, or pass --skip-invalid") from None
                yield from (t for t in texts if t.strip())
