"""The text each token id stands for, as UTF-8 bytes, for every tokenizer megatron_ru builds.

Vocabulary adaptation re-tokenizes each new token's text with the old tokenizer, and bits per
byte counts the bytes of the scored text; both need a token's text exactly, which ``decode([id])``
does not give: decoders drop a word-start space at the start of a text, turn a lone byte token
into U+FFFD, and skip special tokens. Here each id maps to its bytes by the tokenizer's own
rules:

* SentencePiece: ``▁`` is a space, ``<0xNN>`` is the byte NN, control and unknown pieces have no
  text (Megatron's ``SentencePieceTokenizer`` adds ``<EOD>`` etc.: special, no text);
* Hugging Face ``tokenizer.json``: a ``ByteLevel`` decoder maps each symbol back to its byte
  (GPT-2's table: ``Ġ`` is a space); otherwise the Metaspace convention (``▁`` → space, byte-fallback
  ``<0xNN>``); added tokens marked special have no text, other added tokens are their content;
* GPT-2 BPE (``vocab.json`` + ``merges.txt``): the byte-level table.

Special tokens are listed by their string (``specials``), so that tokens of two vocabularies can be
matched by string. Sums of :func:`byte_and_char_counts` over any token sequence are the exact byte
and character counts of the text those tokens stand for (characters are counted as UTF-8 lead
bytes, so a character split over byte tokens counts once).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer, Tokenizer

WORD_START = "▁"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class TokenTexts:
    """Per id: the UTF-8 bytes of its text (None for special/control tokens)."""

    pieces: list[Optional[bytes]]
    #: special/control token string -> id
    specials: dict[str, int] = field(default_factory=dict)
    #: the tokenizer puts a word-start space before every text it encodes (SentencePiece's dummy prefix)
    dummy_prefix: bool = False
    #: ids of byte-fallback tokens (``<0xNN>``): the tokenizer emits them only for text its other pieces
    #: cannot spell, so a piece with the same bytes (``e`` beside ``<0x65>``) is the one it produces
    byte_ids: frozenset = frozenset()

    def __len__(self) -> int:
        return len(self.pieces)

    def text(self, i: int) -> Optional[str]:
        b = self.pieces[i]
        return None if b is None else b.decode("utf-8", errors="replace")

    def display(self, i: int) -> str:
        """A readable form: the text, with bytes that are not UTF-8 on their own as ``<0xNN>``."""
        b = self.pieces[i]
        if b is None:
            return next((s for s, j in self.specials.items() if j == i), f"<special {i}>")
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"<0x{x:02X}>" for x in b)

    def is_special(self, i: int) -> bool:
        return self.pieces[i] is None


def _byte_piece(piece: str) -> Optional[bytes]:
    m = _BYTE_PIECE.match(piece)
    return bytes([int(m.group(1), 16)]) if m else None


def _metaspace_bytes(piece: str, marker: str = WORD_START) -> bytes:
    b = _byte_piece(piece)
    return b if b is not None else piece.replace(marker, " ").encode("utf-8")


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable symbol -> the byte it stands for."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    symbols = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            symbols.append(256 + n)
            n += 1
    return {chr(s): b for b, s in zip(printable, symbols)}


def _byte_level_bytes(token: str, table: dict[str, int]) -> bytes:
    try:
        return bytes(table[c] for c in token)
    except KeyError:  # not a byte-level symbol string (an added token): its text as is
        return token.encode("utf-8")


# ---- SentencePiece -------------------------------------------------------------------------------
def _sentencepiece(tok: GPTSentencePieceTokenizer) -> TokenTexts:
    from sentencepiece import sentencepiece_model_pb2

    sp = tok.sp
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    n = int(sp.vocab_size())
    pieces: list[Optional[bytes]] = []
    specials: dict[str, int] = {}
    byte_ids: set[int] = set()
    for i in range(n):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or sp.is_unknown(i):
            pieces.append(None)
            specials[piece] = i
        elif sp.is_byte(i):
            pieces.append(_byte_piece(piece))
            byte_ids.add(i)
        else:
            pieces.append(piece.replace(WORD_START, " ").encode("utf-8"))
    if isinstance(tok, SentencePieceTokenizer):  # Megatron's extra <CLS>, <EOD>, ... after the pieces
        pieces.extend([None] * (tok.vocab_size - n))
        for s, i in tok.special_tokens.items():
            if i >= n or pieces[i] is None:
                pieces[i] = None
                specials[s] = i
    return TokenTexts(pieces, specials, bool(proto.normalizer_spec.add_dummy_prefix), frozenset(byte_ids))


# ---- Hugging Face --------------------------------------------------------------------------------
def _walk(node: Any) -> list[dict[str, Any]]:
    """A tokenizer.json component and its nested ``Sequence`` members, flattened."""
    if not isinstance(node, dict):
        return []
    out = [node]
    for key in ("decoders", "pretokenizers", "normalizers"):
        for child in node.get(key) or ():
            out.extend(_walk(child))
    return out


def _hf_fast(tok: Any, path: str) -> TokenTexts:
    fast = tok._fast
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    decoders = _walk(spec.get("decoder"))
    pre = _walk(spec.get("pre_tokenizer"))
    norm = _walk(spec.get("normalizer"))
    byte_level = any(d.get("type") == "ByteLevel" for d in decoders + pre)
    marker = WORD_START
    for d in decoders + pre:
        if d.get("type") == "Metaspace" and d.get("replacement"):
            marker = d["replacement"]
    dummy = any(n.get("type") == "Prepend" for n in norm)
    dummy |= any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always" if p.get("add_prefix_space", True)
                                                        else "never") in ("always", "first") for p in pre)
    dummy |= any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in pre)
    added = {a["id"]: a for a in spec.get("added_tokens") or ()}
    table = byte_level_table() if byte_level else {}
    pieces: list[Optional[bytes]] = []
    specials: dict[str, int] = {}
    byte_ids: set[int] = set()
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
    for i in range(tok.vocab_size):
        token = fast.id_to_token(i)
        if i in added:
            if added[i].get("special", False):
                pieces.append(None)
                specials[added[i]["content"]] = i
            else:
                pieces.append(added[i]["content"].encode("utf-8"))
        elif token is None:
            pieces.append(None)
        elif byte_level:
            pieces.append(_byte_level_bytes(token, table))
        else:
            pieces.append(_metaspace_bytes(token, marker))
            if byte_fallback and _byte_piece(token) is not None:
                byte_ids.add(i)
    return TokenTexts(pieces, specials, dummy, frozenset(byte_ids))


def _hf_slow(tok: Any) -> TokenTexts:
    hf = tok._hf
    special_ids = set(hf.all_special_ids)
    pieces: list[Optional[bytes]] = []
    specials: dict[str, int] = {}
    for i in range(tok.vocab_size):
        token = hf.convert_ids_to_tokens(i)
        if i in special_ids or token is None:
            pieces.append(None)
            if token is not None:
                specials[token] = i
        else:
            pieces.append(_metaspace_bytes(token))
    sp = getattr(hf, "sp_model", None)
    dummy = bool(getattr(hf, "add_prefix_space", sp is not None))
    byte_ids = frozenset(i for i in range(tok.vocab_size) if pieces[i] is not None
                         and _byte_piece(hf.convert_ids_to_tokens(i) or "") is not None)
    return TokenTexts(pieces, specials, dummy, byte_ids)


# ---- GPT-2 BPE -----------------------------------------------------------------------------------
def _gpt2(tok: Any) -> TokenTexts:
    from megatron_ru.data.tokenizers.gpt2_bpe import EOD_TOKEN
    table = byte_level_table()
    pieces: list[Optional[bytes]] = [None] * tok.vocab_size
    specials: dict[str, int] = {}
    for token, i in tok.encoder.items():
        if token == EOD_TOKEN:
            specials[token] = i
        else:
            pieces[i] = _byte_level_bytes(token, table)
    return TokenTexts(pieces, specials, False)


def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """The text of every id of ``tokenizer`` (see the module docstring)."""
    from megatron_ru.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
    from megatron_ru.data.tokenizers.huggingface import HuggingFaceTokenizer
    if isinstance(tokenizer, GPTSentencePieceTokenizer):
        return _sentencepiece(tokenizer)
    if isinstance(tokenizer, HuggingFaceTokenizer):
        if tokenizer._fast is not None:
            return _hf_fast(tokenizer, tokenizer.path)
        return _hf_slow(tokenizer)
    if isinstance(tokenizer, GPT2BPETokenizer):
        return _gpt2(tokenizer)
    raise ValueError(f"{tokenizer.name} has no text for its ids (NullTokenizer reads integers): bits per byte and "
                     "vocabulary adaptation need a SentencePiece, Hugging Face or GPT-2 BPE tokenizer")


def byte_and_char_counts(tt: TokenTexts) -> tuple[np.ndarray, np.ndarray]:
    """int64 [V] tables: UTF-8 bytes per id and characters per id (UTF-8 lead bytes, i.e. bytes
    outside 0x80-0xBF); 0 for special tokens."""
    n = len(tt.pieces)
    nbytes = np.zeros(n, dtype=np.int64)
    nchars = np.zeros(n, dtype=np.int64)
    for i, b in enumerate(tt.pieces):
        if b:
            nbytes[i] = len(b)
            nchars[i] = sum(1 for x in b if not 0x80 <= x <= 0xBF)
    return nbytes, nchars
