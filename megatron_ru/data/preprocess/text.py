"""How a document is cut into sequences, and how group values become file names.

All splitters are exact partitions unless stated: ``"".join(parts) == text``, so detokenizing
the sequences of a document and concatenating them gives the input text back.
"""
from __future__ import annotations

import hashlib
import re

# A paragraph break is a blank line: a newline, optional spaces/tabs, another newline, plus any
# whitespace that follows. The break stays at the end of the paragraph before it.
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")

# Sentence end: terminal punctuation, optional closing quotes/brackets, then whitespace, and the
# next sentence starting with an upper-case letter, a digit or an opening quote/bracket.
_SENTENCE_END = re.compile(r"""[.!?…]+[»"'”’)\]]*(\s+)(?=[A-ZА-ЯЁ\d«"'“(\[])""")
# A single letter before the period is an initial ("А. С. Пушкин"), not a sentence end. Searched
# only over the last three characters before a candidate end (see _sentence_cuts).
_INITIAL = re.compile(r"(?:^|\s)\w\.$")


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text``; each keeps the blank-line break that follows it."""
    parts: list[str] = []
    start = 0
    for m in _PARAGRAPH_BREAK.finditer(text):
        if m.end() >= len(text):
            break
        parts.append(text[start:m.end()])
        start = m.end()
    parts.append(text[start:])
    return parts


def _sentence_cuts(text: str) -> list[tuple[int, int]]:
    """(end of sentence, start of next) positions: the gap between them is whitespace."""
    cuts = []
    for m in _SENTENCE_END.finditer(text):
        end = m.start(1)
        # (a match of _INITIAL ending at ``end`` starts at end - 3 or later, or at 0; ``^`` matches
        # only at the text's real start, so searching from there is the same as from 0 — and
        # searching from 0 at every candidate made splitting quadratic in the document's length)
        if end - m.start() == 1 and _INITIAL.search(text, max(0, end - 3), end):
            continue
        cuts.append((end, m.end(1)))
    for m in _PARAGRAPH_BREAK.finditer(text):
        if 0 < m.start() and m.end() < len(text):
            cuts.append((m.start(), m.end()))
    cuts.sort()
    merged: list[tuple[int, int]] = []
    for a, b in cuts:
        if merged and a <= merged[-1][1]:
            merged[-1] = (min(merged[-1][0], a), max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Sentences of ``text`` (a simple deterministic splitter, see docs/data_format.md).

    With ``keep_newlines`` the whitespace between sentences (newlines included) stays at the end
    of the sentence before it: an exact partition. Without it, that whitespace is dropped, as
    Megatron-LM's punkt-based splitter does (the text inside a sentence is never changed).
    """
    out: list[str] = []
    start = 0
    for end, nxt in _sentence_cuts(text):
        out.append(text[start:nxt] if keep_newlines else text[start:end])
        start = nxt
    last = text[start:]
    if keep_newlines:
        out.append(last)
    else:
        out = [s.strip() for s in out] + [last.strip()]
    return [s for s in out if s]


_UNSAFE = re.compile(r"[^\w.\-]+")


def sanitize_name(value: str) -> str:
    """File-name-safe form of a ``--group-by-key`` value: letters (any script), digits, ``_``,
    ``-`` and ``.`` are kept, every other run becomes ``_``; a leading dot becomes ``_``; empty
    becomes ``_``; names over 80 characters are cut and get an 8-hex digest of the value."""
    name = _UNSAFE.sub("_", value)
    if name.startswith("."):
        name = "_" + name[1:]
    if not name:
        name = "_"
    if len(name) > 80:
        name = name[:80] + "-" + hashlib.sha1(value.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return name
