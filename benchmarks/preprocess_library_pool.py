#!/usr/bin/env python
"""Worker threads that each drive the `tokenizers` library's Rust pool vs calls kept on the worker.

    python benchmarks/preprocess_library_pool.py --cells gpt2-bpe:ordinary hf-bytelevel:ordinary --workers 2

The tool (``pipeline.run``) sets ``TOKENIZERS_PARALLELISM=false`` while it runs, so that a batch
call of GPT-2 BPE or a Hugging Face tokenizer stays on the worker thread that makes it: the
``--workers`` threads are the parallelism. This measures why, in one process, rotating every round:

  serial:  the tool as it is;
  pool:    the same run with that setting taken away (``pipeline._serial_library_calls`` replaced
           by a no-op), so that each of the k worker threads spreads its batch call over the
           library's pool of k Rust threads (RAYON_NUM_THREADS=k, what the tool set before);
  limit:   the library's fastest batch call on k threads over the same texts as ``str`` (as in
           benchmarks/preprocess.py: ``encode_batch_fast`` on the Rust pool of k threads).

Prints per round the wall and CPU seconds of each, then the median ratios limit / serial and
limit / pool. The interpreter's start-up is not included (both sides run in this process).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="+", default=["gpt2-bpe:ordinary"], help="tokenizer:shape")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # before tokenizers is first imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import logging

    import preprocess as matrix
    from megatron_ru.config.base import parse_configs
    from megatron_ru.config.tokenizer import TokenizerConfig
    from megatron_ru.data.preprocess import pipeline
    from megatron_ru.data.preprocess.config import PreprocessConfig

    logging.disable(logging.INFO)
    cells = [tuple(c.split(":")) for c in args.cells]
    ns = argparse.Namespace(workdir=args.workdir, tokenizers=sorted({t for t, _ in cells}),
                            shapes=sorted({s for _, s in cells}), size_mb=None, huge_mb=100.0)
    flags, corpora = matrix.setup(ns)
    serial = pipeline._serial_library_calls
    for t, s in cells:
        if flags[t][1] not in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
            raise SystemExit(f"{t}: not a tokenizers-library tokenizer")
        corpus = corpora[(t, s)]
        argv = ["--input", corpus, "--output-prefix", os.path.join(args.workdir, f"pool_{t}_{s}"), *flags[t],
                "--append-eod", "--workers", str(args.workers), "--log-interval", "100000000"]
        cfgs = parse_configs([PreprocessConfig, TokenizerConfig], argv)
        batches = matrix.limit_batches(matrix.load_texts(corpus), s)
        encode = matrix.fastest_encode(flags[t], args.workers)
        sides = ["serial", "pool", "limit"]
        walls: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.repeat):
            line = []
            for side in sides[r % 3:] + sides[:r % 3]:
                fresh = [[(x + " ")[:-1] for x in b] for b in batches] if side == "limit" else None
                pipeline._serial_library_calls = serial if side == "serial" else contextlib.nullcontext
                c0, t0 = time.process_time(), time.perf_counter()
                if side == "limit":
                    sum(encode(b) for b in fresh)
                else:
                    pipeline.run(cfgs[PreprocessConfig], cfgs[TokenizerConfig])
                walls[side].append(time.perf_counter() - t0)
                line.append(f"{side} {walls[side][-1]:.2f} s ({time.process_time() - c0:.2f} CPU s)")
            pipeline._serial_library_calls = serial
            print(f"{t} {s} w{args.workers} round {r + 1}: " + ", ".join(line), flush=True)
        for side in ("serial", "pool"):
            ratios = [lim / x for lim, x in zip(walls["limit"], walls[side])]
            print(f"| {t} | {s} | {args.workers} | {side} | {statistics.median(walls[side]):.2f} | "
                  f"{statistics.median(walls['limit']):.2f} | **{statistics.median(ratios):.3f}** | "
                  f"{min(ratios):.3f}-{max(ratios):.3f} |", flush=True)


if __name__ == "__main__":
    main()
