"""GPT-2 byte-level BPE (``vocab.json`` + ``merges.txt``).

Text is cut into pre-tokens with GPT-2's pattern, each pre-token's UTF-8 bytes are mapped to
printable characters (so every byte string is a string of vocabulary symbols), and merges are
applied in rank order. Decoding maps the symbols back to bytes, so any text round-trips.

Encoding runs in the Hugging Face ``tokenizers`` library (a BPE model built from the same vocab and
merges, GPT-2's byte-level pre-tokenizer; native code, no per-word Python), ~3x faster than Python
on text with a long tail of rare words, where a word cache rarely hits. The pure-Python
implementation (:meth:`GPT2BPETokenizer.reference_tokenize`, the ``regex`` package and the merge
loop) stays as the reference: the two give identical ids (tests/unit/test_tokenizer.py).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import regex

from megatron_ru.data.tokenizer import Tokenizer

# GPT-2's pre-tokenizer: English contractions, letter runs, digit runs, other symbols, and
# whitespace (a run of spaces keeps its last space for the following word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def byte_to_symbol() -> dict[int, str]:
    """Bijection byte → printable character: printable Latin-1 bytes map to themselves, the
    other 68 bytes to code points 256, 257, ... in byte order (GPT-2's table)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class GPT2BPETokenizer(Tokenizer):
    """Megatron's ``GPT2BPETokenizer``: ``eod`` is ``<|endoftext|>``; vocab size is len(vocab.json)."""

    name = "GPT2BPETokenizer"
    releases_gil = True  # the library encodes batches in Rust with the GIL released
    pieces_one_per_task = True  # ids come out as Python lists

    def __init__(self, vocab_file: str, merge_file: str, cache_size: int = 1 << 16) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({e})") from e
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.ranks = _read_merges(merge_file)
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"--vocab-file {vocab_file}: no {EOD_TOKEN} token, which GPT2BPETokenizer uses as "
                             "end-of-document")
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder[EOD_TOKEN]
        self.bos = None
        self.pad = None
        self._b2s = byte_to_symbol()
        self._s2b = {s: b for b, s in self._b2s.items()}
        self._pattern = regex.compile(GPT2_PATTERN)
        self._cache: dict[str, list[int]] = {}
        self._cache_size = cache_size
        self._fast = self._build_fast()

    def _build_fast(self):  # -> tokenizers.Tokenizer
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        merges = sorted(self.ranks, key=self.ranks.__getitem__)
        try:
            fast = HFTokenizer(models.BPE(vocab=dict(self.encoder), merges=list(merges), fuse_unk=False))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception for a merge outside the vocab
            raise ValueError(f"GPT-2 BPE: --merge-file and --vocab-file do not belong together ({e})") from None
        # GPT-2's pattern (the library's byte-level regex is exactly GPT2_PATTERN), no prefix space
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        fast.decoder = decoders.ByteLevel()
        return fast

    def _bpe(self, symbols: str) -> list[str]:
        word = list(symbols)
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = -1, None
            for i in range(len(word) - 1):
                r = ranks.get((word[i], word[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = word[best], word[best + 1]
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            symbols = "".join(self._b2s[b] for b in piece.encode("utf-8"))
            try:
                ids = [self.encoder[s] for s in self._bpe(symbols)]
            except KeyError as e:
                raise ValueError(f"GPT-2 BPE: symbol {e.args[0]!r} is not in --vocab-file; vocab.json and "
                                 "merges.txt do not belong together") from None
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize_batch_arrays(self, texts: Sequence[str], num_threads: Optional[int] = None) -> list[np.ndarray]:
        from megatron_ru.data.tokenizers.huggingface import fast_batch_arrays

        return fast_batch_arrays(self._fast, texts)  # threads: the library's pool (RAYON_NUM_THREADS)

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        return "keep", f"{self.name}: GPT-2's pre-tokenizer starts a token at ' word'"

    def reference_tokenize(self, text: str) -> list[int]:
        """The pure-Python encoding (``regex`` pre-tokenizer and merge loop): the reference the
        library's ids are tested against."""
        out: list[int] = []
        for piece in self._pattern.findall(text):
            out.extend(self._encode_piece(piece))
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        symbols = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self._s2b[c] for c in symbols).decode("utf-8", errors="replace")


def _read_merges(path: str) -> dict[tuple[str, str], int]:
    ranks: dict[tuple[str, str], int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"--merge-file {path} line {lineno}: expected two symbols separated by one space, "
                                 f"got {line!r}")
            ranks[(parts[0], parts[1])] = len(ranks)
    return ranks
