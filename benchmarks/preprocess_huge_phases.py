#!/usr/bin/env python
"""Where the time of one huge document goes: the tool's steps, timed one by one in one process.

    python benchmarks/preprocess_huge_phases.py --tokenizers tiktoken sp-unigram --threads 1 2

For the 100 MB one-line corpus of benchmarks/preprocess.py (built there if missing), the steps
``tools/preprocess_data.py`` takes for it, in order: interpreter start to imports done, loading the
tokenizer, finding the line (``read_batches``: the line stays in the mapped file), checking the
line where it lies and finding its string (``Encoder.parse``: the C++ parser), and the stream —
decoding the string 1 MB at a time, cutting it into ~100 k pieces as it arrives and tokenizing the
pieces on k threads meanwhile (``Encoder._encode_stream``: ids checked and converted to the output
dtype). Then the limit's own call on the same text's pieces, as ``str``, one batch (as
benchmarks/preprocess.py times it): everything but the stream is work the limit does not do, and
the stream does the decoding and cutting the limit does not do.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phases(flags: list[str], corpus: str, threads: int) -> dict:
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np

    from megatron_ru.config.base import parse_configs
    from megatron_ru.config.tokenizer import TokenizerConfig
    from megatron_ru.data.indexed_dataset import best_fitting_dtype
    from megatron_ru.data.preprocess.cuts import cut_document
    from megatron_ru.data.preprocess.encode import BatchResult, EncodeOptions, Encoder, Span
    from megatron_ru.data.preprocess.reader import Segment, read_batches
    from megatron_ru.data.tokenizer import build_tokenizer

    out = {}
    t = time.perf_counter()
    out["start-up and imports"] = t - T0
    tok = build_tokenizer(parse_configs([TokenizerConfig], flags)[TokenizerConfig])
    dtype = np.dtype(best_fitting_dtype(tok.vocab_size))
    encoder = Encoder(tok, EncodeOptions(dtype=dtype.name, spread_threads=threads))
    out["load the tokenizer"], t = time.perf_counter() - t, time.perf_counter()
    batch = next(read_batches([Segment(corpus)], 1 << 20, mapped=True))
    out["find the line (mapped)"], t = time.perf_counter() - t, time.perf_counter()
    encoder.parse(batch)
    group, texts = encoder._fields(batch.lines[0], batch.values[0], batch.buffer)
    span = texts[0]
    assert isinstance(span, Span), "the huge text was not left in its line (is the C++ parser built?)"
    out["check the line, find the string (C++)"], t = time.perf_counter() - t, time.perf_counter()
    ids = encoder._encode_stream(span, BatchResult())
    out[f"stream: decode, cut, tokenize on {threads} thread(s)"], t = time.perf_counter() - t, time.perf_counter()
    out["total"] = time.perf_counter() - T0
    import preprocess as matrix

    text = span.decode().decode("utf-8")
    texts = cut_document(text, 100_000, "keep")
    del text, ids
    encode = matrix.fastest_encode(flags, threads, tokenizer=tok)
    t = time.perf_counter()
    encode(texts)
    out["limit: the same text as str pieces, one batch"] = time.perf_counter() - t
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_run":
        print(json.dumps(phases(*json.loads(sys.argv[2]))))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import preprocess as matrix

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizers", nargs="+", default=list(matrix.TOKENIZERS), choices=matrix.TOKENIZERS)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--huge-mb", type=float, default=100.0)
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    args.tokenizers = matrix.available(args.tokenizers)
    ns = argparse.Namespace(workdir=args.workdir, tokenizers=args.tokenizers, shapes=["huge"], size_mb=None,
                            huge_mb=args.huge_mb)
    flags, corpora = matrix.setup(ns)
    results = {}
    for t in args.tokenizers:
        for k in args.threads:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_run",
                                json.dumps([flags[t], corpora[(t, "huge")], k])], capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode != 0:
                raise SystemExit(p.stderr)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            results[f"{t} threads={k}"] = r
            print(f"\n{t}, {k} thread(s):")
            for name, sec in r.items():
                print(f"  {name:45s} {sec:6.3f} s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
