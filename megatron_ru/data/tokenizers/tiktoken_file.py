"""``TikTokenizer``: a LLaMA-3 style ``tokenizer.model`` in tiktoken's format, with ``tiktoken``.

The file holds one ``<base64 token bytes> <rank>`` line per mergeable token; the id of a token is
its rank. The pre-tokenizer pattern and the special tokens are Meta's LLaMA-3 ones (what
``transformers``' converted LLaMA-3 tokenizers hold too): 256 special tokens after the last
rank — ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eod), ``<|start_header_id|>``,
``<|end_header_id|>``, ``<|eot_id|>`` and reserved ones — so ids equal the Hugging Face
LLaMA-3 tokenizer's for the same file.

Text is encoded as ordinary text: special-token strings inside a document are tokenized like any
other characters (Megatron's and Meta's preprocessing do the same; documents are separated by
``--append-eod``). Nothing is downloaded: tiktoken is given the ranks, not an encoding name.

Ids go to numpy without a Python list (``encode_to_numpy``: tiktoken's uint32 buffer); a batch is
spread over threads (tiktoken's Rust core encodes with the GIL released).
"""
from __future__ import annotations

import base64
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from megatron_ru.data.tokenizer import Tokenizer
from megatron_ru.utils.threads import kept_pool
# LLaMA-3's pre-tokenizer pattern, one of those where cutting at a word boundary is proven safe
from megatron_ru.data.tokenizers.huggingface import LLAMA3_PATTERN

NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>")


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens of LLaMA-3, in id order after the mergeable ranks."""
    rest = [f"<|reserved_special_token_{i}|>" for i in range(5, 5 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIALS))]
    return list(_NAMED_SPECIALS) + rest


def read_ranks(path: str) -> dict[bytes, int]:
    """Token bytes → rank of a tiktoken ranks file; a malformed line is an error naming it."""
    import binascii

    with open(path, "rb") as f:
        lines = f.read().splitlines()
    ranks: dict[bytes, int] = {}
    decode = binascii.a2b_base64
    for n, line in enumerate(lines, 1):
        try:
            token, rank = line.split()
            ranks[decode(token, strict_mode=True)] = int(rank)
        except ValueError as e:
            if not line.strip():
                continue
            raise ValueError(f"--tokenizer-model {path}, line {n}: not '<base64 token> <rank>' ({e}); "
                             "TikTokenizer reads a tiktoken ranks file such as LLaMA-3's "
                             "original/tokenizer.model") from None
    if len(set(ranks.values())) != len(ranks) or (ranks and max(ranks.values()) != len(ranks) - 1) or \
            (ranks and min(ranks.values()) != 0):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


def ranks_from_tokenizer_json(spec: dict) -> dict[bytes, int]:
    """The mergeable ranks of a byte-level BPE ``tokenizer.json`` (LLaMA-3 style: ids in merge order,
    added tokens left out): each entry's byte-level symbols mapped back to bytes, ranked by id."""
    from megatron_ru.data.tokenizers.gpt2_bpe import byte_to_symbol

    symbol_byte = {s: b for b, s in byte_to_symbol().items()}
    added = {t["content"] for t in spec.get("added_tokens") or []}
    entries = sorted((i, s) for s, i in spec["model"]["vocab"].items() if s not in added)
    return {bytes(symbol_byte[c] for c in s): rank for rank, (_, s) in enumerate(entries)}


def write_ranks(ranks: dict[bytes, int], path: str) -> None:
    """Write ``ranks`` in tiktoken's format (a temporary name renamed when complete)."""
    with open(path + ".tmp", "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    os.replace(path + ".tmp", path)


class TikTokenizer(Tokenizer):
    """LLaMA-3 ``tokenizer.model`` through ``tiktoken``; ``eod`` is ``<|end_of_text|>``."""

    name = "TikTokenizer"
    releases_gil = True  # tiktoken's Rust core encodes with the GIL released
    # UTF-8 bytes are decoded in the thread that encodes them: a huge document's pieces are
    # decoded by every thread instead of the whole text by one (0.3 s for 100 MB here)
    accepts_utf8_bytes = True
    decodes_utf8 = True  # (tiktoken itself takes str)

    def __init__(self, path: str, num_threads: int = 1) -> None:
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: no such file (TikTokenizer reads a tiktoken ranks "
                                    "file, e.g. LLaMA-3's original/tokenizer.model)")
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken") from e
        ranks = read_ranks(path)
        specials = {t: len(ranks) + i for i, t in enumerate(llama3_special_tokens())}
        self.encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                          mergeable_ranks=ranks, special_tokens=specials)
        self.path = path
        self.num_threads = num_threads
        self.vocab_size = len(ranks) + len(specials)
        self.eod = specials["<|end_of_text|>"]
        self.bos = specials["<|begin_of_text|>"]
        self.special_tokens = specials
        self._special_of_id = {v: k for k, v in specials.items()}
        self._local = threading.local()  # this thread's Encoding (_encoding_here)
        # the first thread that encodes takes this one instead of building another (~20 ms and a few
        # MB for 32 k ranks, ~0.1 s and ~34 MB for LLaMA-3's 128 k): in the tool the threads that
        # encode are worker or pool threads, never the one that loaded the tokenizer
        self._spare = [self.encoding]
        self._pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads) -> pool of tokenize_batch_arrays

    def _encoding_here(self):
        """The calling thread's own ``tiktoken.Encoding`` (same ranks, pattern and specials): on its first
        call the one built at load time if no thread has taken it yet, else a new one. tiktoken's regexes keep their match caches in pools whose fast path belongs to the
        first thread that used them; every other thread takes a locked path at every match. Two threads
        sharing one Encoding took 1.51-1.61 s for the 100 MB benchmark document, one Encoding each
        1.36-1.39 s (6 alternating rounds); building one takes ~20 ms for 32 k ranks."""
        enc = getattr(self._local, "encoding", None)
        if enc is None:
            try:
                enc = self._spare.pop()  # (atomic: one thread gets it)
            except IndexError:
                enc = self.new_encoding()
            self._local.encoding = enc
        return enc

    def new_encoding(self):
        """Another ``tiktoken.Encoding`` equal to :attr:`encoding` (for a thread of its own)."""
        import tiktoken

        e = self.encoding
        return tiktoken.Encoding(name=e.name, pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                                 special_tokens=e._special_tokens)

    def _encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._encoding_here().encode_to_numpy(text, disallowed_special=())

    def tokenize(self, text: str) -> list[int]:
        return self._encoding_here().encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=self.num_threads)

    def tokenize_batch_arrays(self, texts: Sequence[str | bytes], num_threads: Optional[int] = None) -> list[np.ndarray]:
        threads = num_threads or self.num_threads
        if threads <= 1 or len(texts) <= 1:
            return [self._encode(t) for t in texts]
        # one pool per process for the whole run: its threads keep their Encodings (_encoding_here)
        return list(kept_pool(self._pools, threads, "tiktoken").map(self._encode, texts))

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        # LLaMA-3's pattern starts a pre-token at a word-boundary space and looks neither back nor
        # across it (proven in tests/unit/test_preprocess_cuts.py); there are no added tokens.
        return "keep", f"{self.name}: LLaMA-3 pre-tokenizer pattern"

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])
