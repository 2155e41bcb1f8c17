"""Train a SentencePiece BPE or Unigram model, and measure it (symbols per token).

Defaults are chosen so that the model is lossless on any text, which round-trip tests and
paragraph-exact datasets rely on: identity normalization (no NFKC), whitespace kept as is,
byte fallback (every character, newline included, encodes), and no dummy prefix (so that
tokenizing paragraphs separately and concatenating equals tokenizing the whole text's bytes
back: see docs/data_format.md). ``add_dummy_prefix=True`` gives Llama-style models instead.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, Optional

# SentencePiece skips training sentences longer than this (bytes); we feed lines no longer.
MAX_SENTENCE_BYTES = 4096


def training_pieces(texts: Iterable[str], max_bytes: int = MAX_SENTENCE_BYTES) -> Iterator[str]:
    """Lines of ``texts`` (documents are cut at newlines, over-long lines at spaces)."""
    for text in texts:
        for line in text.split("\n"):
            while len(line.encode("utf-8")) > max_bytes:
                cut = line.rfind(" ", 0, max_bytes // 4)
                cut = cut if cut > 0 else max_bytes // 4
                yield line[:cut]
                line = line[cut:]
            if line.strip():
                yield line


def train_sentencepiece(texts: Iterable[str], model_prefix: str, model_type: str = "bpe",
                        vocab_size: int = 32000, character_coverage: float = 0.9995,
                        byte_fallback: bool = True, add_dummy_prefix: bool = False,
                        input_sentence_size: int = 2_000_000, num_threads: int = 1,
                        pad_id: int = -1, hard_vocab_limit: bool = True, seed_sentencepiece_size: Optional[int] = None,
                        user_defined_symbols: Optional[list[str]] = None) -> str:
    """Train and write ``<model_prefix>.model`` and ``.vocab`` (via temporary names); returns
    the ``.model`` path. ``texts`` are documents; they are fed line by line."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type {model_type!r}: choose bpe or unigram")
    tmp_prefix = f"{model_prefix}.tmp-{os.getpid()}"
    failure: list[BaseException] = []

    def pieces() -> Iterator[str]:
        # SentencePiece turns an exception inside the iterator into a RuntimeError; keep the
        # original (e.g. a ValueError naming the bad input line) to re-raise it.
        try:
            yield from training_pieces(texts)
        except BaseException as e:
            failure.append(e)
            raise

    kwargs = dict(
        sentence_iterator=pieces(), model_prefix=tmp_prefix, model_type=model_type,
        vocab_size=vocab_size, character_coverage=character_coverage, byte_fallback=byte_fallback,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, allow_whitespace_only_pieces=True, split_digits=True,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
        max_sentence_length=MAX_SENTENCE_BYTES * 4, num_threads=num_threads,
        unk_id=0, bos_id=1, eos_id=2, pad_id=pad_id, hard_vocab_limit=hard_vocab_limit, minloglevel=2,
    )
    if seed_sentencepiece_size is not None:
        kwargs["seed_sentencepiece_size"] = seed_sentencepiece_size
    if user_defined_symbols:
        kwargs["user_defined_symbols"] = user_defined_symbols
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)) or ".", exist_ok=True)
    try:
        try:
            spm.SentencePieceTrainer.train(**kwargs)
        except RuntimeError:
            if failure:
                raise failure[0] from None
            raise
        os.replace(tmp_prefix + ".vocab", model_prefix + ".vocab")
        os.replace(tmp_prefix + ".model", model_prefix + ".model")
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
    return model_prefix + ".model"


def symbols_per_token(tokenizer, texts: Iterable[str], batch: int = 256) -> dict[str, float]:
    """Characters and UTF-8 bytes per token over ``texts`` (higher = more compression)."""
    chars = nbytes = tokens = docs = 0
    buf: list[str] = []

    def flush() -> None:
        nonlocal tokens
        tokens += sum(len(ids) for ids in tokenizer.tokenize_batch(buf))
        buf.clear()

    for t in texts:
        chars += len(t)
        nbytes += len(t.encode("utf-8"))
        docs += 1
        buf.append(t)
        if len(buf) >= batch:
            flush()
    if buf:
        flush()
    return {"documents": docs, "characters": chars, "bytes": nbytes, "tokens": tokens,
            "symbols_per_token": chars / tokens if tokens else float("nan"),
            "bytes_per_token": nbytes / tokens if tokens else float("nan")}
