"""HuggingFace tokenizer from a local directory (nothing is downloaded).

A directory with ``tokenizer.json`` is loaded with the ``tokenizers`` library directly (fast
start-up, native multi-threaded batch encoding); other directories (e.g. a slow SentencePiece
tokenizer) go through ``transformers.AutoTokenizer(local_files_only=True)``, imported only then.
Special token names come from ``tokenizer_config.json`` / ``special_tokens_map.json``. No
special tokens are added when tokenizing: documents are separated by ``--append-eod``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from megatron_ru.data.tokenizer import Tokenizer

# Pre-tokenizer regexes known to start a token at a word-boundary space (" word") and to look
# neither back nor across it: GPT-2's, and LLaMA-3's / GPT-4's (cl100k) and Qwen2's (which
# differs in taking digits one at a time). Proven for each in tests/unit/test_preprocess_cuts.py.
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SAFE_SPLIT_PATTERNS = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    LLAMA3_PATTERN,
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
# Pre-tokenizers that only split (never join) and always split before a word-boundary space.
_SPLITS_AT_SPACE = ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")
# Pre-tokenizers that only split further (or map characters one by one) and never join.
_ONLY_SPLIT = ("Digits", "Punctuation", "UnicodeScripts", "ByteLevel", "Split", "Metaspace") + _SPLITS_AT_SPACE
_LOCAL_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD", "Lowercase")


def _word_start_inside(vocab: dict, marker: str) -> Optional[str]:
    """A vocabulary entry holding ``marker`` after another character (it could span a cut), if any."""
    for piece in vocab:
        if marker in piece.lstrip(marker):
            return piece
    return None


def _pre_tokenizer_splits(pre: Optional[dict]) -> tuple[bool, str]:
    """(True, "") when ``pre`` always starts a pre-token at a word-boundary space, only splits
    and keeps that space at the start of the right pre-token or drops it; else (False, why)."""
    if pre is None:
        return False, "no pre-tokenizer"
    kind = pre.get("type")
    if kind == "Sequence":
        parts = pre.get("pretokenizers", [])
        for p in parts:
            if p.get("type") not in _ONLY_SPLIT:
                return False, f"pre-tokenizer {p.get('type')} may join pieces"
            if p.get("type") == "Split" and not _pre_tokenizer_splits(p)[0]:
                return _pre_tokenizer_splits(p)
        if any(_pre_tokenizer_splits(p)[0] for p in parts):
            return True, ""
        return False, "no pre-tokenizer of the sequence splits at spaces"
    if kind == "ByteLevel":
        return (True, "") if pre.get("use_regex", True) else (False, "ByteLevel without its regex")
    if kind == "Split":
        pattern = pre.get("pattern", {})
        regex = pattern.get("Regex", pattern.get("String"))
        if regex in SAFE_SPLIT_PATTERNS and pre.get("behavior") == "Isolated" and not pre.get("invert"):
            return True, ""
        return False, f"Split pattern {regex!r} is not one proven safe"
    if kind == "Metaspace":
        return (True, "") if pre.get("split", True) else (False, "Metaspace without splitting")
    if kind in _SPLITS_AT_SPACE:
        return True, ""
    return False, f"pre-tokenizer {kind}"


def tokenizer_json_cut_mode(spec: dict) -> tuple[Optional[str], str]:
    """Cut mode (megatron_ru/data/preprocess/cuts.py) of a ``tokenizer.json``, from its added
    tokens, normalizer, pre-tokenizer and vocabulary."""
    for t in spec.get("added_tokens") or []:
        content = t.get("content", "")
        if t.get("lstrip") or t.get("rstrip") or any(c.isspace() for c in content):
            return None, f"added token {content!r} takes whitespace"
    norm = spec.get("normalizer")
    norms = (norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]) if norm else []
    kinds = [n.get("type") for n in norms]
    vocab = (spec.get("model") or {}).get("vocab") or {}
    vocab = vocab if isinstance(vocab, dict) else {v[0]: i for i, v in enumerate(vocab)}  # Unigram: a list
    if kinds == ["Prepend", "Replace"] and norms[0].get("prepend") == "\u2581" \
            and norms[1].get("content") == "\u2581" and (norms[1].get("pattern") or {}).get("String") == " ":
        # Llama-2 / Mistral style: every input starts with the word-start marker, spaces become it
        # and nothing splits: a boundary is certain only when no entry spans a word start.
        if spec.get("pre_tokenizer") is not None:
            return None, "normalizer Prepend with a pre-tokenizer"
        inside = _word_start_inside(vocab, "\u2581")
        if inside is not None:
            return None, f"vocabulary entry {inside!r} spans a word start"
        return "drop", "marker prepended to every input"
    if any(k not in _LOCAL_NORMALIZERS for k in kinds):
        return None, f"normalizer {kinds}"
    splits, why = _pre_tokenizer_splits(spec.get("pre_tokenizer"))
    if splits:
        return "keep", "pre-tokenizer splits at spaces"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace" and _word_start_inside(vocab, pre.get("replacement", "\u2581")) is None:
        return "keep", "Metaspace and no vocabulary entry spans a word start"
    return None, why


def fast_batch_arrays(fast, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of ``texts`` as int32 arrays with a ``tokenizers.Tokenizer``: ``encode_batch_fast``
    (no character offsets; tokenizers >= 0.20) where the installed version has it."""
    encode = getattr(fast, "encode_batch_fast", fast.encode_batch)
    return [np.array(e.ids, dtype=np.int32) for e in encode(list(texts), add_special_tokens=False)]


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def special_token_names(path: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        p = os.path.join(path, fname)
        if not os.path.isfile(p):
            continue
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
        for key in ("eos_token", "bos_token", "pad_token"):
            text = _token_text(cfg.get(key))
            if text is not None:
                names[key] = text
    return names


class HuggingFaceTokenizer(Tokenizer):
    """``eod`` is the tokenizer's eos token (from its config files)."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str, num_threads: int = 1) -> None:
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: no such directory (HuggingFaceTokenizer loads "
                                    "a local directory written by save_pretrained)")
        names = special_token_names(path)
        self.path = path
        self._fast = None
        self._hf = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            # The Rust thread pool reads this once, at first use.
            os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))
            from tokenizers import Tokenizer as RustTokenizer

            self._fast = RustTokenizer.from_file(os.path.join(path, "tokenizer.json"))
            self.releases_gil = True  # encode_batch runs in Rust with the GIL released
            self.pieces_one_per_task = True  # ids come out as Python lists
            lookup = self._fast.token_to_id
            self.vocab_size = int(self._fast.get_vocab_size(with_added_tokens=True))
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            lookup = self._hf.convert_tokens_to_ids
            self.vocab_size = len(self._hf)
        ids = {k: (lookup(v) if v is not None else None) for k, v in names.items()}
        if ids.get("eos_token") is None:
            raise ValueError(f"--tokenizer-model {path}: no eos_token in tokenizer_config.json or "
                             "special_tokens_map.json; HuggingFaceTokenizer uses it as end-of-document")
        self.eod = int(ids["eos_token"])
        self.bos = ids.get("bos_token")
        self.pad = ids.get("pad_token")

    def tokenize(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf(text, add_special_tokens=False)["input_ids"]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return self._hf(list(texts), add_special_tokens=False)["input_ids"]

    def tokenize_batch_arrays(self, texts: Sequence[str], num_threads: Optional[int] = None) -> list[np.ndarray]:
        if self._fast is not None:  # the library's pool (RAYON_NUM_THREADS) sets the threads
            return fast_batch_arrays(self._fast, texts)
        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenize_batch(texts)]

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        if self._fast is None:
            return None, f"{self.name}: {self.path} has no tokenizer.json (a slow tokenizer)"
        spec = json.loads(self._fast.to_str())
        # the library splits the input at added tokens first and normalizes each section alone
        self.cut_guards = tuple(t["content"] for t in spec.get("added_tokens") or [] if t.get("content"))
        mode, why = tokenizer_json_cut_mode(spec)
        return mode, f"{self.name}: {why}"

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False)
