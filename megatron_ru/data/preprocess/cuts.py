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

from typing import Optional, Union

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
        cut = _find_cut(text, start + target // 2, start + target, guards)
        if cut < 0:  # the last boundary in the first half of the window, else the first after it
            cut = _find_cut(text, start + 1, start + target // 2, guards)
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
