"""Which old rows make each new token's embedding (ADAPTATION.md step 2).

Every token of the new vocabulary is turned into its text (:mod:`megatron_ru.data.token_text`:
byte tokens and word-start markers included) and re-tokenized with the **old** tokenizer; its new
row is the mean of those old pieces' rows. Then:

* ``kept`` — the text is one old token (or the same id holds the same text, as in ``extend`` mode):
  that old row, bit for bit; of several old ids with that text (a byte-fallback ``<0x65>`` beside
  the piece ``e``) the one the old tokenizer produces for the text;
* ``special`` — a special/control token matched by its string (``</s>`` ↔ ``</s>``), else by its
  role (end of document, begin of sequence, padding);
* ``pieces`` — the mean (or ``weighted`` mean) of the old pieces;
* ``fallback`` — no usable piece (an unmatched special token such as a new ``<unk>`` when the old
  vocabulary has none, a byte token for a byte the old vocabulary cannot spell, a text the old
  tokenizer maps only to unknown/special ids), or pieces whose mean is the zero vector: the mean of
  all old rows.

The old tokenizer's dummy prefix (SentencePiece puts a word-start space before every text) would
give a mid-word piece such as ``ир`` the word-start piece ``▁ир``: a new token without a leading
space is re-tokenized without that space (the first old piece loses its word-start marker when the
old vocabulary has that piece; a lone marker is dropped), and a new token with a leading space
lets the dummy prefix stand for it.

Weighted mean (``--init weighted-mean``): piece ``k`` (0-based) of a token weighs ``1 / (k + 1)``,
whitespace-only pieces a tenth of that (unless all pieces are whitespace), normalised to sum 1 —
the earlier pieces of a word carry more of its meaning, a bare space carries little.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_ru.data.token_text import TokenTexts, token_texts
from megatron_ru.data.tokenizer import Tokenizer

KINDS = ("kept", "special", "pieces", "fallback")
#: new tokens converted per block in :meth:`VocabMap.convert` (bounds the gathered rows' memory)
_BLOCK = 4096


@dataclass
class VocabMap:
    old_size: int
    new_size: int
    #: per new id: "kept" | "special" | "pieces" | "fallback"
    kind: list[str]
    #: per new id: the old ids whose rows are averaged ([old id] for kept/special, [] for fallback)
    pieces: list[list[int]]
    #: per new id: the weights of ``pieces`` for the weighted mean (sum 1)
    weights: list[list[float]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c = Counter(self.kind)
        return {k: c.get(k, 0) for k in KINDS}

    def new_ids(self) -> list[int]:
        """Ids whose rows adaptation computed (everything but kept and special rows)."""
        return [i for i, k in enumerate(self.kind) if k not in ("kept", "special")]

    def convert(self, old: torch.Tensor, weighted: bool = False) -> torch.Tensor:
        """``old`` [≥ old_size, h] → [new_size, h]: kept and special rows copied exactly, the others
        the (weighted) mean of their pieces' rows computed in float64, fallback rows the mean of all
        ``old_size`` old rows; returned in ``old``'s dtype."""
        return self.convert_with_fallbacks(old, weighted)[0]

    @torch.no_grad()
    def convert_with_fallbacks(self, old: torch.Tensor, weighted: bool = False) -> tuple[torch.Tensor, list[int]]:
        """:meth:`convert`, and the ids that got the mean of all old rows (no pieces, or pieces
        averaging to the zero vector)."""
        if old.dim() != 2 or old.shape[0] < self.old_size:
            raise ValueError(f"expected a matrix with at least {self.old_size} rows, got shape {tuple(old.shape)}")
        h = old.shape[1]
        old64 = old[:self.old_size].to(torch.float64)
        fallback = old64.mean(dim=0)
        out = torch.empty((self.new_size, h), dtype=torch.float64)
        fallbacks: list[int] = []
        for start in range(0, self.new_size, _BLOCK):
            stop = min(start + _BLOCK, self.new_size)
            rows, src, w = [], [], []
            for i in range(start, stop):
                n = len(self.pieces[i])                # 0: no piece, a fallback row (below)
                ws = self.weights[i] if weighted and self.weights else [1.0 / n] * n if n else []
                rows += [i - start] * len(self.pieces[i])
                src += self.pieces[i]
                w += ws
            block = torch.zeros((stop - start, h), dtype=torch.float64)
            if src:
                block.index_add_(0, torch.tensor(rows), old64[torch.tensor(src)] * torch.tensor(w, dtype=torch.float64)[:, None])
            empty = (block == 0).all(dim=1)
            block[empty] = fallback
            fallbacks += (empty.nonzero().flatten() + start).tolist()
            out[start:stop] = block
        result = out.to(old.dtype)
        exact = [i for i, k in enumerate(self.kind) if k in ("kept", "special")]
        if exact:
            idx = torch.tensor(exact)
            result[idx] = old[torch.tensor([self.pieces[i][0] for i in exact])]
        exact_ids = set(exact)
        return result, [i for i in fallbacks if i not in exact_ids]


def piece_weights(texts: Sequence[Optional[bytes]]) -> list[float]:
    """The weighted-mean rule of the module docstring for pieces with these texts."""
    if not texts:
        return []
    blank = [t is not None and t.strip() == b"" for t in texts]
    raw = [1.0 / (k + 1) * (0.1 if blank[k] and not all(blank) else 1.0) for k in range(len(texts))]
    total = sum(raw)
    return [r / total for r in raw]


class _OldSide:
    """The old tokenizer, answering "which old ids spell these bytes"."""

    def __init__(self, tok: Tokenizer, tt: TokenTexts) -> None:
        self.tok, self.tt = tok, tt
        candidates: dict[bytes, list[int]] = {}
        for i, b in enumerate(tt.pieces):
            if b:
                candidates.setdefault(b, []).append(i)
        self.index: dict[bytes, int] = {b: ids[0] if len(ids) == 1 else self._produced(b, ids)
                                        for b, ids in candidates.items()}

    def _produced(self, b: bytes, ids: list[int]) -> int:
        """Of several old ids with the same text (a byte-fallback ``<0x65>`` beside the piece ``e``), the
        one the old tokenizer produces for that text; else one that is not a byte-fallback token."""
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None:
            produced = [i for i in self.tok.tokenize(text) if i in ids]
            if len(set(produced)) == 1:
                return produced[0]
        return next((i for i in ids if i not in self.tt.byte_ids), ids[0])

    def _encode_text(self, text: str) -> list[int]:
        return [i for i in self.tok.tokenize(text) if i < len(self.tt.pieces) and self.tt.pieces[i] is not None]

    def _encode_valid(self, b: bytes) -> list[int]:
        text = b.decode("utf-8")
        if not self.tt.dummy_prefix:
            return self._encode_text(text)
        if text.startswith(" "):        # the dummy prefix stands for the leading space
            return self._encode_text(text[1:]) if text[1:] else [self.index[b" "]] if b" " in self.index else []
        ids = self._encode_text(text)
        if ids and self.tt.pieces[ids[0]] == b" ":
            return ids[1:]
        if ids and self.tt.pieces[ids[0]].startswith(b" "):
            bare = self.tt.pieces[ids[0]][1:]
            if bare in self.index:
                return [self.index[bare]] + ids[1:]
        return ids

    def ids_for(self, b: bytes) -> list[int]:
        """Old ids spelling ``b``: valid UTF-8 runs re-tokenized, stray bytes (a piece of a character,
        as byte-level tokens hold) mapped to the old single-byte token when there is one."""
        if b in self.index:
            return [self.index[b]]
        out: list[int] = []
        pos = 0
        while pos < len(b):
            try:
                out += self._encode_valid(b[pos:])
                break
            except UnicodeDecodeError as e:
                if e.start > 0:
                    out += self._encode_valid(b[pos:pos + e.start])
                bad = b[pos + e.start:pos + e.end]
                out += [self.index[bytes([x])] for x in bad if bytes([x]) in self.index]
                pos += e.end
        return out


def _role_match(new: Tokenizer, old: Tokenizer, i: int) -> Optional[int]:
    for role in ("eod", "bos", "pad"):
        if getattr(new, role, None) == i and getattr(old, role, None) is not None:
            return int(getattr(old, role))
    return None


def build_vocab_map(old: Tokenizer, new: Tokenizer, old_texts: Optional[TokenTexts] = None,
                    new_texts: Optional[TokenTexts] = None) -> VocabMap:
    """The map from ``old``'s rows to ``new``'s (see the module docstring). In ``extend`` mode the new
    tokenizer holds the old ids unchanged: each keeps its own row."""
    old_tt = old_texts or token_texts(old)
    new_tt = new_texts or token_texts(new)
    side = _OldSide(old, old_tt)
    old_special = old_tt.specials
    new_special_name = {i: s for s, i in new_tt.specials.items()}
    kind: list[str] = []
    pieces: list[list[int]] = []
    weights: list[list[float]] = []
    for i, b in enumerate(new_tt.pieces):
        if i < len(old_tt.pieces) and b is not None and old_tt.pieces[i] == b:
            k, p = "kept", [i]                                   # same id, same text (extend mode)
        elif b is None:
            name = new_special_name.get(i)
            match = old_special.get(name) if name is not None else None
            match = match if match is not None else _role_match(new, old, i)
            k, p = ("special", [match]) if match is not None else ("fallback", [])
        elif b in side.index:
            k, p = "kept", [side.index[b]]
        else:
            p = side.ids_for(b)
            k = "pieces" if p else "fallback"
        kind.append(k)
        pieces.append(p)
        weights.append(piece_weights([old_tt.pieces[j] for j in p]) if k == "pieces" else [1.0] * len(p))
    return VocabMap(old_size=len(old_tt.pieces), new_size=len(new_tt.pieces), kind=kind, pieces=pieces,
                    weights=weights)
