"""Where a huge document may be cut so that tokenizing its pieces gives the ids of the whole text.

A cut is placed only at one kind of point: a single ASCII space whose neighbours are both
non-whitespace characters (``"word word"``). Every tokenizer we ship starts a new token there —
a pre-token " word" (GPT-2, LLaMA-3 and Qwen2 regexes), a piece "▁word" (SentencePiece with
whitespace splitting, Metaspace) — and nothing on either side of it looks across it; which
tokenizers that holds for, and how the space must be handed over, is the tokenizer's
``cut_mode`` (see :class:`megatron_ru.data.tokenizer.Tokenizer`):

* ``"keep"``: the right piece starts with the space (an exact partition of the text);
* ``"drop"``: the space is left out and the right piece starts at the word: for tokenizers that
  prepend a word-start marker to every input (SentencePiece with a dummy prefix that keeps extra
  whitespace, Llama-2-style ``tokenizer.json``), whose marker then stands for the dropped space;
* ``None``: never cut (no such proof for this tokenizer): the document is tokenized whole.

A tokenizer that splits its input at special-token text first (Hugging Face added tokens, the
specials of Megatron's SentencePieceTokenizer) and prepends a word-start marker to every section
gets one more marker after such a token, so no cut is placed next to one (``guards``).

A SentencePiece Unigram model with whitespace-only pieces ("▁▁") segments a run of three or more
spaces among paths of exactly equal score, and which one its Viterbi search keeps depends on the
rounding of the score accumulated since the start of its input: such a run must stay in the
first piece, so cuts come only after the last one (``first_cut``, the tokenizer's
``cut_start``).

Paragraph breaks themselves are not cut points: LLaMA-3's pattern makes a whole run of blank
lines one token, and SentencePiece models with identity normalization keep newlines inside
pieces. Cuts prefer the first word after the last paragraph break in the window, then the last
word boundary in it. Which tokenizers are safe is proven by tests that compare the pieces' ids
with the whole text's on varied text (tests/unit/test_preprocess_cuts.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Union

Text = Union[str, bytes]


def _char_before(text: Text, i: int) -> str:
    """The character ending just before position ``i`` (UTF-8 aware for bytes)."""
    if isinstance(text, str):
        return text[i - 1]
    j = i - 1
    while j > 0 and i - j < 4 and 0x80 <= text[j] < 0xC0:  # continuation bytes
        j -= 1
    return text[j:i].decode("utf-8", "replace")


def _char_at(text: Text, i: int) -> str:
    if isinstance(text, str):
        return text[i]
    b = text[i]
    n = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
    return text[i:i + n].decode("utf-8", "replace")


def _is_word_boundary(text: Text, i: int, guards: tuple = ()) -> bool:
    """``text[i]`` is a single space between two non-whitespace characters, and no guard string
    ends just before it or starts just after it."""
    if not (0 < i < len(text) - 1 and not _char_before(text, i).isspace() and not _char_at(text, i + 1).isspace()):
        return False
    return not guards or not (text.endswith(guards, 0, i) or text.startswith(guards, i + 1))


def _find_cut(text: Text, lo: int, hi: int, guards: tuple = ()) -> int:
    """Position of a word-boundary space in ``[lo, hi)`` (see module doc), or -1."""
    space = " " if isinstance(text, str) else b" "
    para = "\n\n" if isinstance(text, str) else b"\n\n"
    p = text.rfind(para, lo, hi)
    if p >= 0:  # the first word boundary after the last paragraph break
        i = text.find(space, p + 2, hi)
        while i >= 0:
            if _is_word_boundary(text, i, guards):
                return i
            i = text.find(space, i + 1, hi)
    i = text.rfind(space, lo, hi)
    while i >= 0:
        if _is_word_boundary(text, i, guards):
            return i
        i = text.rfind(space, lo, i)
    return -1


def cut_document(text: Text, target: int, mode: Optional[str], guards: tuple[str, ...] = (),
                 first_cut: int = 0) -> list[Text]:
    """``text`` in pieces of about ``target`` characters (bytes for ``bytes``), cut only at word
    boundaries as ``mode`` says, never next to a ``guards`` string and not before ``first_cut``;
    a piece grows past ``target`` when its window holds no boundary. With ``mode=None`` or a short
    text: ``[text]``."""
    if mode is None or len(text) <= target or first_cut >= len(text):
        return [text]
    if mode not in ("keep", "drop"):
        raise ValueError(f"unknown cut mode {mode!r}")
    if isinstance(text, bytes):
        guards = tuple(g.encode("utf-8") for g in guards)
    pieces: list[Text] = []
    start = 0
    if first_cut > target // 2:
        cut = _next_cut(text, first_cut, guards)
        if cut < 0:
            return [text]
        pieces.append(text[:cut])
        start = cut + 1 if mode == "drop" else cut
    while len(text) - start > target:
        cut = _window_cut(text, start, target, guards)
        if cut < 0:
            cut = _next_cut(text, start + target, guards)
        if cut < 0:
            break
        pieces.append(text[start:cut])
        start = cut + 1 if mode == "drop" else cut
    pieces.append(text[start:])
    return pieces


def _next_cut(text: Text, pos: int, guards: tuple) -> int:
    space = " " if isinstance(text, str) else b" "
    i = text.find(space, pos)
    while i >= 0:
        if _is_word_boundary(text, i, guards):
            return i
        i = text.find(space, i + 1)
    return -1


def _window_cut(text: Text, start: int, target: int, guards: tuple) -> int:
    """The cut ending the piece that starts at ``start``: the window's (second half first, then the
    last boundary in its first half), or -1. Never ``start`` itself (an empty piece)."""
    half = start + max(1, target // 2)
    cut = _find_cut(text, half, start + target, guards)
    if cut < 0:
        cut = _find_cut(text, start + 1, half, guards)
    return cut


def cut_stream(chunks: Iterable[Text], target: int, mode: Optional[str], guards: tuple[str, ...] = (),
               first_cut: int = 0) -> Iterator[Text]:
    """The pieces of ``cut_document(text, target, mode, guards, first_cut)`` where ``text`` is the
    concatenation of ``chunks`` (all str or all bytes, at least one), each piece given out as soon
    as the text received decides it — so that a huge text can be tokenized while the rest of it is
    still being read and decoded. Holds about one piece plus one chunk of text."""
    if mode not in (None, "keep", "drop"):
        raise ValueError(f"unknown cut mode {mode!r}")
    it = iter(chunks)
    buf = next(it)
    if mode is None:
        yield buf[:0].join([buf, *it])
        return
    if isinstance(buf, bytes):
        guards = tuple(g.encode("utf-8") for g in guards)
    space = b" " if isinstance(buf, bytes) else " "
    # A boundary at i is decided by the text up to i + margin (the next character, a guard after it).
    margin = 5 + max((len(g) for g in guards), default=0)
    drop = mode == "drop"
    base = 0  # offset of buf in the whole text (buf keeps ``margin`` characters before ``start``)
    start = 0  # where the current piece starts, in buf
    first = first_cut > target // 2  # the first piece ends at the first boundary from first_cut
    scan = -1  # where a forward search for a boundary resumes, in buf (-1: none under way)
    final = False
    while True:
        while True:  # give out every piece the text so far decides
            n = len(buf)
            if final and (n - start <= target or (first and first_cut >= base + n)):
                yield buf[start:]
                return
            if not final and n - start <= target + margin:
                break
            if first:
                lo = first_cut - base
            else:
                cut = _window_cut(buf, start, target, guards)
                if cut >= 0:
                    piece, start = buf[start:cut], cut + drop
                    yield piece
                    continue
                lo = start + target
            cut, scan = _forward_cut(buf, max(lo, scan), guards, space, None if final else n - margin)
            if cut < 0 and not final:
                break
            if cut < 0:
                yield buf[start:]
                return
            piece, start = buf[start:cut], cut + drop
            first, scan = False, -1
            yield piece
        chunk = next(it, None)  # (with the whole text, the loop above always ends in a return)
        if chunk is None:
            final = True
            continue
        keep = 0 if first else max(0, start - margin)
        buf = buf[keep:] + chunk
        base += keep
        start -= keep
        scan = scan - keep if scan >= 0 else -1


def _forward_cut(text: Text, pos: int, guards: tuple, space: Text, decided: Optional[int]) -> tuple[int, int]:
    """(the first boundary at or after ``pos``, -1) as :func:`_next_cut`; with ``decided``, only
    spaces before it can be judged, and when none of them is a boundary: (-1, where to resume)."""
    i = text.find(space, pos)
    while i >= 0 and (decided is None or i < decided):
        if _is_word_boundary(text, i, guards):
            return i, -1
        i = text.find(space, i + 1)
    if decided is None:
        return -1, -1
    return -1, (i if i >= 0 else max(pos, decided))
