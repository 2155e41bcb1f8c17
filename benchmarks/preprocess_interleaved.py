#!/usr/bin/env python
"""The tool's work on each batch vs the tokenizer alone on the same texts, interleaved batch by batch.

    python benchmarks/preprocess_interleaved.py                 # every tokenizer, ordinary + longtail
    python benchmarks/preprocess_interleaved.py --tokenizers hf-bytelevel --size-mb 10

Why: on the development VM the speed of memory-heavy code drifts by tens of per cent over seconds
(a fixed random-gather probe took 0.09-0.16 s per pass within one process, while a SHA-256 loop
held to 1 %), so two separate processes run a minute apart (benchmarks/preprocess.py's paired
rounds) differ by ±25 % for reasons outside the code. Here both sides run in one process, one
after the other on each batch (which goes first alternates), so they see the same machine within a
fraction of a second, and the ratio is precise.

For each tokenizer × corpus shape (the corpora and tokenizers of benchmarks/preprocess.py, built
there if missing), the corpus is read in the tool's own batches (``read_batches``, --batch-bytes)
and, for every batch:

  limit: the tokenizer library's fastest batch call on the batch's texts, already decoded to
         ``str`` (untimed), as in benchmarks/preprocess.py (the same library object as the tool's,
         so that both see the same BPE word cache);
  tool:  ``Encoder.encode(batch)`` from the raw JSONL bytes: JSON parsing and validation, UTF-8,
         cutting of long texts, tokenization, id checks, the conversion to the output dtype and
         the assembly of the batch's arrays (what a worker does; ``--workers 1`` runs exactly this
         in the main process).

The figure is sum(limit) / sum(tool) at one thread (the per-batch work). Not included, and
measured by benchmarks/preprocess.py: start-up, reading the file, writing the outputs, and how
the work spreads over workers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers is imported: one thread
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import preprocess as matrix  # noqa: E402  (benchmarks/preprocess.py: corpora, tokenizers, the limit)
from megatron_ru.config.base import parse_configs  # noqa: E402
from megatron_ru.config.tokenizer import TokenizerConfig  # noqa: E402
from megatron_ru.data.indexed_dataset import best_fitting_dtype  # noqa: E402
from megatron_ru.data.preprocess.encode import EncodeOptions, Encoder  # noqa: E402
from megatron_ru.data.preprocess.reader import Batch, Segment, read_batches  # noqa: E402
from megatron_ru.data.tokenizer import build_tokenizer  # noqa: E402


def measure(flags: list[str], corpus: str, batch_bytes: int) -> dict:
    tok = build_tokenizer(parse_configs([TokenizerConfig], flags)[TokenizerConfig])
    encoder = Encoder(tok, EncodeOptions(append_eod=True, dtype=np.dtype(best_fitting_dtype(tok.vocab_size)).name))
    limit = matrix.fastest_encode(flags, 1, tokenizer=tok)
    times = {"limit": 0.0, "tool": 0.0}
    tokens = {"limit": 0, "tool": 0}
    batches = 0
    for i, batch in enumerate(read_batches([Segment(corpus)], batch_bytes)):
        texts = [json.loads(line)["text"] for line in batch.data.splitlines()]
        data = batch.data
        for side in (("limit", "tool") if i % 2 == 0 else ("tool", "limit")):
            t0 = time.perf_counter()
            if side == "limit":
                n = limit(texts)
            else:
                res = encoder.encode(Batch(batch.path, batch.first_line, data))
                if res.error is not None:
                    raise SystemExit(res.error)
                n = res.tokens - res.documents  # without the end-of-document tokens
            times[side] += time.perf_counter() - t0
            tokens[side] += n
        batches += 1
    if tokens["limit"] != tokens["tool"]:
        raise SystemExit(f"token counts differ: {tokens}")
    return {"batches": batches, "tokens": tokens["tool"], "limit_s": round(times["limit"], 3),
            "tool_s": round(times["tool"], 3), "ratio": round(times["limit"] / times["tool"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizers", nargs="+", default=list(matrix.TOKENIZERS), choices=matrix.TOKENIZERS)
    ap.add_argument("--shapes", nargs="+", default=["ordinary", "longtail"], choices=["ordinary", "longtail"])
    ap.add_argument("--size-mb", type=float, default=None, help="corpus size (default: benchmarks/preprocess.py's)")
    ap.add_argument("--batch-bytes", type=int, default=1 << 20, help="the tool's default")
    ap.add_argument("--repeat", type=int, default=2, help="passes over each corpus; the table gives each")
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    args.tokenizers = matrix.available(args.tokenizers)
    ns = argparse.Namespace(workdir=args.workdir, tokenizers=args.tokenizers, shapes=args.shapes,
                            size_mb=args.size_mb, huge_mb=100.0)
    flags, corpora = matrix.setup(ns)
    print("| tokenizer | corpus (MB) | batches | tokens | limit (s) | tool (s) | **limit / tool** |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for t in args.tokenizers:
        for s in args.shapes:
            for _ in range(args.repeat):
                r = measure(flags[t], corpora[(t, s)], args.batch_bytes)
                mb = os.path.getsize(corpora[(t, s)]) / 1e6
                rows.append({"tokenizer": t, "shape": s, "corpus_mb": round(mb, 1), **r})
                print(f"| {t} | {s} ({mb:.0f}) | {r['batches']} | {r['tokens']} | {r['limit_s']:.2f} | "
                      f"{r['tool_s']:.2f} | **{r['ratio']:.3f}** |", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
