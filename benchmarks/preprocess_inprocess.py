#!/usr/bin/env python
"""The whole tool at k workers vs the tokenizer alone at k threads, alternating in one process.

    python benchmarks/preprocess_inprocess.py --workers 2 --cells hf-bytelevel:huge gpt2-bpe:longtail

Why: benchmarks/preprocess.py runs every tool run and every limit run in a fresh process, and on
the development VM two processes a minute apart differ by up to ±25 % (benchmarks/machine_noise.py);
benchmarks/preprocess_interleaved.py takes that noise away but measures one thread. This one
measures what a matrix cell at k workers measures, with both sides in one process, one right after
the other (which goes first alternates every round), so that they see the same machine:

  tool:  ``pipeline.run`` — what ``tools/preprocess_data.py --workers k --append-eod`` runs after
         its imports: building the tokenizer, reading, JSON, cutting, tokenizing on k worker
         threads, writing the .bin/.idx;
  limit: the tokenizer library's fastest batch call on k threads over the same texts already in
         memory as ``str`` (``preprocess.limit_batches``: a huge document as ~100 k-character
         pieces in one batch), as in the matrix.

Not included: the interpreter's start-up and imports (the matrix's start-up column has them).
RAYON_NUM_THREADS is set to k before anything imports ``tokenizers`` (the tool sets it the same
way). The ratio is limit / tool per round; the median and spread are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="+", required=True, help="tokenizer:shape, e.g. hf-bytelevel:huge")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size-mb", type=float, default=None, help="ordinary/longtail corpora (default: the matrix's)")
    ap.add_argument("--huge-mb", type=float, default=100.0)
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # before tokenizers is first imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import preprocess as matrix
    from megatron_ru.config.base import parse_configs
    from megatron_ru.config.tokenizer import TokenizerConfig
    from megatron_ru.data.preprocess.config import PreprocessConfig
    from megatron_ru.data.preprocess.pipeline import run

    cells = [tuple(c.split(":")) for c in args.cells]
    ns = argparse.Namespace(workdir=args.workdir, tokenizers=sorted({t for t, _ in cells}),
                            shapes=sorted({s for _, s in cells}), size_mb=args.size_mb, huge_mb=args.huge_mb)
    flags, corpora = matrix.setup(ns)
    results = {}
    for t, s in cells:
        corpus = corpora[(t, s)]
        out = os.path.join(args.workdir, f"inprocess_{t}_{s}_w{args.workers}")
        argv = ["--input", corpus, "--output-prefix", out, *flags[t], "--append-eod", "--workers",
                str(args.workers), "--log-interval", "100000000"]
        cfgs = parse_configs([PreprocessConfig, TokenizerConfig], argv)
        batches = matrix.limit_batches(matrix.load_texts(corpus), s)
        encode = matrix.fastest_encode(flags[t], args.workers)
        ratios, tool_s, limit_s = [], [], []
        for r in range(args.repeat):
            walls = {}
            for side in (("tool", "limit") if r % 2 == 0 else ("limit", "tool")):
                # new str objects each round: a str keeps the UTF-8 form the tokenizer asked it for
                # (PyUnicode_AsUTF8AndSize), so reused texts spared the limit that encoding after round 1
                fresh = [[(x + " ")[:-1] for x in b] for b in batches] if side == "limit" else None
                t0 = time.perf_counter()
                if side == "tool":
                    run(cfgs[PreprocessConfig], cfgs[TokenizerConfig])
                else:
                    sum(encode(b) for b in fresh)
                walls[side] = time.perf_counter() - t0
            tool_s.append(walls["tool"])
            limit_s.append(walls["limit"])
            ratios.append(walls["limit"] / walls["tool"])
            print(f"{t} {s} w{args.workers} round {r + 1}: limit {walls['limit']:.2f} s, tool {walls['tool']:.2f} s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        results[f"{t}:{s}"] = {"limit": limit_s, "tool": tool_s, "ratios": ratios}
        print(f"| {t} | {s} | {args.workers} | {statistics.median(limit_s):.2f} | {statistics.median(tool_s):.2f} | "
              f"**{statistics.median(ratios):.3f}** | {min(ratios):.3f}-{max(ratios):.3f} |", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
