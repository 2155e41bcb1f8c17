#!/usr/bin/env python
"""The built-in example, end to end on this machine (`make demo`), no download.

Steps (each a function, so that later steps, e.g. training a model, can be added):
  1. make_corpus          a synthetic JSONL corpus of multi-paragraph documents with
                          `text` and `domain` keys
  2. train_tokenizer      a SentencePiece BPE model with tools/train_tokenizer.py
  3. preprocess           tools/preprocess_data.py: whole documents; per-domain datasets with
                          --group-by-key domain; paragraph datasets with --split-paragraphs
  4. show                 tools/dataset_info.py on what was built
Everything goes under demo_out/ (or --out).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ru.data.preprocess.synthetic import write_corpus  # noqa: E402

PY = sys.executable


def step(title: str, cmd: list[str]) -> None:
    print(f"\n== {title}\n$ {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}",
          flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


def make_corpus(out: str, megabytes: float = 4.0) -> str:
    path = os.path.join(out, "corpus.jsonl")
    if not os.path.exists(path):
        n = write_corpus(path, int(megabytes * 1e6), seed=0)
        print(f"== corpus: {path} ({n} documents, {os.path.getsize(path) / 1e6:.1f} MB)", flush=True)
    return path


def train_tokenizer(out: str, corpus: str, vocab_size: int = 4000) -> str:
    prefix = os.path.join(out, "tokenizer", f"bpe{vocab_size}")
    step("train a SentencePiece BPE tokenizer",
         [PY, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus, "--output-prefix", prefix,
          "--model-type", "bpe", "--vocab-size", str(vocab_size), "--heldout-every", "50"])
    return prefix + ".model"


def tokenizer_args(model: str) -> list[str]:
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]


def preprocess(out: str, corpus: str, model: str, workers: int = 2) -> dict[str, list[str]]:
    """Returns the dataset prefixes built, by kind ('documents', 'domains', 'paragraphs')."""
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    common = ["--input", corpus, *tokenizer_args(model), "--append-eod", "--workers", str(workers),
              "--log-interval", "500"]
    built: dict[str, list[str]] = {}
    prefix = os.path.join(out, "data", "corpus")
    step("preprocess: one dataset of whole documents", [PY, tool, *common, "--output-prefix", prefix])
    built["documents"] = [f"{prefix}_text_document"]
    prefix = os.path.join(out, "data", "by_domain")
    step("preprocess: one dataset per domain (--group-by-key domain), paragraphs as sequences",
         [PY, tool, *common, "--output-prefix", prefix, "--group-by-key", "domain", "--split-paragraphs"])
    built["domains"] = [f"{prefix}_{d}_text_document" for d in ("news", "wiki", "science")]
    prefix = os.path.join(out, "data", "paragraphs")
    step("preprocess: paragraphs as sequences (--split-paragraphs)",
         [PY, tool, *common, "--output-prefix", prefix, "--split-paragraphs"])
    built["paragraphs"] = [f"{prefix}_text_document"]
    return built


def show(built: dict[str, list[str]], model: str) -> None:
    prefixes = [p for ps in built.values() for p in ps]
    step("what was built", [PY, os.path.join(ROOT, "tools", "dataset_info.py"), "--data-path", *prefixes,
                            "--show-documents", "1", "--num-tokens", "24", *tokenizer_args(model)])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "demo_out"))
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    corpus = make_corpus(args.out, args.corpus_mb)
    model = train_tokenizer(args.out, corpus)
    built = preprocess(args.out, corpus, model)
    show(built, model)
    return {"corpus": corpus, "tokenizer": model, "datasets": built}


if __name__ == "__main__":
    main()
