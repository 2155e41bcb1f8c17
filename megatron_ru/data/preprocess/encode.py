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
from typing import Optional

import numpy as np

from megatron_ru.data.preprocess.reader import UTF8_BOM, Batch
from megatron_ru.data.preprocess.cuts import cut_document
from megatron_ru.data.preprocess.text import split_paragraphs, split_sentences
from megatron_ru.data.tokenizer import Tokenizer

try:  # csrc/jsonl.cpp: string values straight from the line's bytes (see Encoder._fields)
    from megatron_ru.data.preprocess._jsonl import extract_strings_batch
except ImportError:  # not built: every line goes through json.loads (same results, slower)
    extract_strings_batch = None


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


@dataclass
class Output:
    """Documents for one dataset: tokens back to back, tokens per sequence, sequences per doc."""

    tokens: np.ndarray
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
_NON_SPACE = re.compile(r"\S")
_NON_SPACE_BYTES = re.compile(rb"\S")
# In UTF-8 text: an ASCII byte that is not whitespace for ``\s``, or the lead byte of a character
# that cannot be whitespace (every non-ASCII whitespace character starts with C2, E1, E2 or E3;
# continuation bytes are 80-BF). Finding one proves the text is not blank without decoding it.
_NOT_BLANK_UTF8 = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xbf\xc2\xe1\xe2\xe3]")


def is_blank(text: str | bytes) -> bool:
    """True when ``text`` (str, or UTF-8 bytes) is empty or whitespace only (regex ``\\s``)."""
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


def _parse(line: bytes, opts: EncodeOptions) -> tuple[Optional[str], list[str]]:
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


def _text(value: str | bytes) -> str:
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
        self._keys = list(opts.json_keys) + ([opts.group_by_key] if opts.group_by_key is not None else [])
        # Texts stay UTF-8 bytes from the line to the tokenizer when nothing needs them as str.
        self._bytes_ok = tokenizer.accepts_utf8_bytes and not (opts.split_paragraphs or opts.split_sentences)

    def _fields(self, raw: bytes, values: Optional[list]) -> tuple[Optional[str], list]:
        """(group, texts) of one line. ``values`` is the C++ fast path's result for it (csrc/jsonl.cpp:
        no Python objects for the whole line, the GIL released): used when the line is a
        well-formed object whose values are all strings; anything else — including every
        invalid line — goes through :func:`_parse`, which gives the same values or the error.
        Texts are UTF-8 bytes when the tokenizer takes them (no str round trip), else str."""
        if values is not None and None not in values:
            n = len(self.opts.json_keys)
            group = _text(values[n]) if len(values) > n else None
            texts = values[:n] if self._bytes_ok else [_text(v) for v in values[:n]]
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
        tokenizing. ``batch.data`` is released."""
        batch.size = len(batch.data) + batch.trailing
        lines = batch.data.split(b"\n")
        batch.data = b""
        if lines and lines[-1] == b"":
            lines.pop()
        batch.lines = lines
        values = extract_strings_batch(lines, self._keys) if extract_strings_batch is not None else None
        if values is not None and not self._bytes_ok:  # a tokenizer that takes str only: decode here too
            for i, v in enumerate(values):
                if v is not None and None not in v:
                    values[i] = [t.decode("utf-8") for t in v]
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
        lines, fast = batch.lines, batch.values
        batch.lines = batch.values = None
        res.lines = len(lines)
        # (line number, group, key, segments) per non-empty text, in input order
        docs: list[tuple[int, Optional[str], str, list[str]]] = []
        for i, raw in enumerate(lines):
            line_no = batch.first_line + i
            if _NON_SPACE_BYTES.search(raw) is None:
                res.skipped["blank line"] += 1
                continue
            lines[i] = b""  # the parsed text is what we keep (matters for a 100 MB line)
            try:
                group, texts = self._fields(raw, fast[i] if fast is not None else None)
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

    def _tokenize(self, docs, res: BatchResult, path: str) -> list[Optional[list[np.ndarray]]]:
        """Per document, one id array (of the output dtype) per segment; None for a document the
        tokenizer refused. The documents' texts are replaced by their pieces (``docs[i][3]``
        becomes a list of piece lists), so a huge text is not held twice."""
        chunks: list = []
        counts: list[int] = []
        for _, _, _, segs in docs:
            for j, seg in enumerate(segs):
                pieces = self._chunks(seg)
                res.uncut += len(pieces) == 1 and len(seg) > self.opts.chunk_chars
                counts.append(len(pieces))
                chunks.extend(pieces)
                segs[j] = pieces
        # the pieces of a cut document go to every thread; other batches use the tokenizer's own
        # setting (the workers already run in parallel)
        threads = self.opts.spread_threads if len(counts) < len(chunks) else None
        try:
            flat = self._encode_pieces(chunks, threads or 1, cut=len(counts) < len(chunks))
        except Exception:  # find the line that failed, to name it
            return self._tokenize_one_by_one(docs, res, path)
        del chunks
        out: list[Optional[list[np.ndarray]]] = []
        k = 0
        n_iter = iter(counts)
        for _, _, _, segs in docs:
            per_seg = []
            for _ in segs:
                n = next(n_iter)
                per_seg.append(flat[k] if n == 1 else np.concatenate(flat[k:k + n]))
                flat[k:k + n] = [None] * n
                k += n
            out.append(per_seg)
        return out

    def _encode_pieces(self, chunks: list, threads: int, cut: bool) -> list[np.ndarray]:
        """Ids of every chunk as arrays of the output dtype. When a document was ``cut``, at most
        ``GROUP_PIECES_PER_THREAD × threads`` pieces are with the tokenizer at a time (bounds what it
        holds for a huge document — its result objects for all of it took 2.0 GB for 100 MB with
        the tokenizers library). For tokenizers whose ids come out as Python lists
        (``pieces_one_per_task``: the tokenizers library) and several threads, each piece is a task
        of a thread pool that also checks and converts its ids, and a thread takes the next piece
        as soon as it is done: calls of a group of pieces left the library's threads idle while one
        thread converted the group's ids (100 MB, 2 threads: 25.7 s vs 22.9 s for one call with all
        the pieces; pooled 22.8 s, benchmarks/preprocess_huge_phases.py). SentencePiece and tiktoken
        hand out arrays; one task per piece was slower for them (tiktoken 3.7 vs 2.8 s), so they
        keep groups of that many pieces, one call each (the call spreads them over the threads)."""
        step = GROUP_PIECES_PER_THREAD * threads if cut else len(chunks)
        if cut and threads > 1 and self.tok.releases_gil and self.tok.pieces_one_per_task:
            return self._encode_pieces_pooled(chunks, threads, step)
        out: list[np.ndarray] = []
        for i in range(0, len(chunks), max(step, 1)):
            out += self._checked(self.tok.tokenize_batch_arrays(chunks[i:i + step],
                                                                num_threads=threads if threads > 1 else None))
        return out

    def _checked(self, arrays) -> list[np.ndarray]:
        vocab = self.tok.vocab_size
        out = []
        for a in arrays:
            if a.size and (a.min() < 0 or a.max() >= vocab):
                raise ValueError(f"token id {int(a.max())} outside the vocabulary of {vocab}")
            out.append(a.astype(self.dtype, copy=False))
        return out

    def _encode_pieces_pooled(self, chunks: list, threads: int, window: int) -> list[np.ndarray]:
        from concurrent.futures import ThreadPoolExecutor

        task = lambda piece: self._checked(self.tok.tokenize_batch_arrays([piece]))[0]  # noqa: E731
        out: list[np.ndarray] = []
        pending: deque = deque()
        with ThreadPoolExecutor(threads, thread_name_prefix="pieces") as pool:
            try:
                for i in range(len(chunks)):
                    pending.append(pool.submit(task, chunks[i]))
                    if len(pending) >= window:
                        out.append(pending.popleft().result())
                while pending:
                    out.append(pending.popleft().result())
            finally:
                for f in pending:
                    f.cancel()
        return out

    def _tokenize_one_by_one(self, docs, res: BatchResult, path: str) -> list[Optional[list[np.ndarray]]]:
        out: list[Optional[list[np.ndarray]]] = []
        for line_no, _, key, segs in docs:
            pieces = [[p.decode("utf-8") if isinstance(p, bytes) else p for p in seg] for seg in segs]
            try:
                out.append([np.concatenate([np.asarray(self.tok.tokenize(c), dtype=np.int64) for c in seg]
                                           ).astype(self.dtype) for seg in pieces])
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
            segs = [s for s in segs if s.size]
            if not segs:
                res.skipped[f"no tokens '{key}'"] += 1
                continue
            toks, lens, counts = parts.setdefault((group, key), ([], [], []))
            toks.extend(segs)
            lens.extend(s.size for s in segs)
            if eod is not None:  # the end-of-document token belongs to the document's last sequence
                toks.append(eod)
                lens[-1] += 1
            counts.append(len(segs))
            res.documents += 1
        for k, (toks, lens, counts) in parts.items():
            tokens = np.concatenate(toks) if len(toks) > 1 else toks[0]  # (ids checked in _encode_pieces)
            res.tokens += tokens.size
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
