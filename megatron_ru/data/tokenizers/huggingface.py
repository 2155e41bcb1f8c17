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


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_names(path: str) -> dict[str, str]:
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
        names = _special_names(path)
        self.path = path
        self._fast = None
        self._hf = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            # The Rust thread pool reads this once, at first use.
            os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))
            from tokenizers import Tokenizer as RustTokenizer

            self._fast = RustTokenizer.from_file(os.path.join(path, "tokenizer.json"))
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

    def tokenize_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False)
