"""Static token vectors of a vocabulary, learned on target-language text: FOCUS's auxiliary space.

The corpus (``--focus-corpus``) is tokenized with the **new** tokenizer and every token is written as
one fastText "word" (its text, whitespace spelled out, so that character n-grams of similar tokens
are shared); fastText CBOW (as FOCUS trains it: negative sampling with 10 negatives, character
n-grams of 3-6) learns a vector per word. A token has a vector when it occurs at least
``min_count`` times; the others (never or too rarely seen) have none and are counted by the caller.
Training runs on one thread with fastText's fixed seed (0; the Python API of fastText 0.9.2 does not
take another for unsupervised training), so two runs give the same vectors bit for bit.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from megatron_ru.data.token_text import TokenTexts
from megatron_ru.utils.jsonl import json_objects
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

#: fastText splits words at these characters; a token's text spells them out instead
_SEPARATORS = {" ": "▁", "\n": "<0x0A>", "\r": "<0x0D>", "\t": "<0x09>", "\v": "<0x0B>", "\f": "<0x0C>",
               "\0": "<0x00>"}
#: fastText's end-of-line word: no token may be written as it
_EOS = "</s>"
#: fastText takes words with this prefix for labels and leaves them out of unsupervised training
_LABEL = "__label__"


@dataclass(frozen=True)
class VectorOptions:
    """How the token vectors are trained (the ``--focus-*`` flags)."""

    corpus: str
    json_keys: tuple[str, ...] = ("text",)
    dim: int = 300
    epochs: int = 3
    min_count: int = 1


@dataclass
class TokenVectors:
    """Vectors of the new ids that have one, and what they were learned from."""

    ids: list[int]
    vectors: np.ndarray          # [len(ids), dim] float32
    documents: int
    tokens: int
    seconds: float


def token_words(tt: TokenTexts) -> list[str]:
    """One distinct whitespace-free word per id: the token's text with separators spelled out
    (``▁`` for a space), special tokens as ``<special:NAME>``; a word already taken gets ``#id``."""
    used = {_EOS}
    words: list[str] = []
    for i in range(len(tt)):
        if tt.pieces[i] is None:
            w = f"<special:{tt.display(i)}>"
        else:
            w = "".join(_SEPARATORS.get(c, c) for c in tt.display(i))
        if w.startswith(_LABEL):
            w = f"#{w}"
        if not w or w in used:
            w = f"{w}#{i}"
        used.add(w)
        words.append(w)
    return words


def corpus_texts(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Documents of ``--focus-corpus``: JSONL (``.jsonl``/``.json``: the texts under ``json_keys``) or
    plain UTF-8 text (every non-blank line a document)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--focus-corpus {path}: no such file (JSONL with a 'text' key per line, or "
                                "plain text with one document per line)")
    if path.endswith((".jsonl", ".json")):
        for n, rec in json_objects(path, "--focus-corpus"):
            for key in json_keys:
                if key not in rec:
                    raise ValueError(f"--focus-json-keys {key}: line {n} of {path} has no such key (it has "
                                     f"{', '.join(rec)})")
                if isinstance(rec[key], str) and rec[key].strip():
                    yield rec[key]
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\n")


def _fasttext() -> Any:
    try:
        import fasttext
    except ImportError as e:
        raise ImportError("--init focus trains fastText vectors: the fasttext module is missing; `make install` "
                          "installs it (requirements.txt: fasttext-wheel)") from e
    return fasttext


def train_token_vectors(tokenizer: Any, tt: TokenTexts, opts: VectorOptions) -> TokenVectors:
    """fastText vectors of ``tokenizer``'s tokens learned on ``opts.corpus`` (see the module docstring)."""
    fasttext = _fasttext()
    t0 = time.perf_counter()
    words = token_words(tt)
    documents = tokens = 0
    with tempfile.TemporaryDirectory(prefix="focus-fasttext-") as tmp:
        path = os.path.join(tmp, "tokens.txt")
        with open(path, "w", encoding="utf-8") as f:
            for text in corpus_texts(opts.corpus, opts.json_keys):
                ids = tokenizer.tokenize(text)
                if ids:
                    f.write(" ".join(words[i] for i in ids) + "\n")
                    documents += 1
                    tokens += len(ids)
        if not tokens:
            raise ValueError(f"--focus-corpus {opts.corpus}: no text to train fastText on")
        model = fasttext.train_unsupervised(path, model="cbow", dim=opts.dim, epoch=opts.epochs,
                                            minCount=opts.min_count, neg=10, thread=1, verbose=0)
    index = {w: i for i, w in enumerate(words)}
    ids = sorted(index[w] for w in model.get_words() if w in index)
    vectors = np.stack([model.get_word_vector(words[i]) for i in ids]).astype(np.float32) if ids else \
        np.zeros((0, opts.dim), dtype=np.float32)
    seconds = time.perf_counter() - t0
    log.info(f"fastText token vectors (dim {opts.dim}, {opts.epochs} epochs, min count {opts.min_count}): "
             f"{len(ids)} of {len(words)} tokens seen in {documents} documents ({tokens} tokens) of "
             f"{opts.corpus}; {seconds:.1f} s")
    return TokenVectors(ids=ids, vectors=vectors, documents=documents, tokens=tokens, seconds=seconds)
