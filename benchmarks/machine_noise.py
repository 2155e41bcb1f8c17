#!/usr/bin/env python
"""How steady this machine is: a compute-bound and a memory-bound probe, each repeated for a while.

    python benchmarks/machine_noise.py --seconds 30

compute: SHA-256 over 64 MB held in cache-sized blocks (the CPU alone).
memory:  a random gather of 5 M elements from a 400 MB array (cache and TLB misses: what hash-map
         heavy tokenizers spend their time on).
Each pass is timed; the spread (max / min, and the 10th-90th percentile range) says how far two
runs of the same work, seconds apart, can differ for reasons outside the code. Benchmarks that
compare separate processes (benchmarks/preprocess.py) inherit this spread, which is why they pair
each tool run with a limit run next to it (BENCHMARKS.md, machine noise).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import numpy as np


def probe(fn, seconds: float) -> list[float]:
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="per probe")
    args = ap.parse_args()
    block = b"x" * (1 << 20)

    def compute() -> None:
        h = hashlib.sha256()
        for _ in range(64):
            h.update(block)

    table = np.arange(50_000_000, dtype=np.int64)
    idx = np.random.default_rng(0).integers(0, table.size, 5_000_000)

    def memory() -> None:
        table[idx].sum()

    rows = {}
    for name, fn in (("compute", compute), ("memory", memory)):
        fn()  # warm up (first touch of the pages)
        ts = sorted(probe(fn, args.seconds))
        q = statistics.quantiles(ts, n=10)
        rows[name] = {"passes": len(ts), "min_s": round(ts[0], 4), "median_s": round(statistics.median(ts), 4),
                      "max_s": round(ts[-1], 4), "p10_s": round(q[0], 4), "p90_s": round(q[-1], 4),
                      "max_over_min": round(ts[-1] / ts[0], 3), "p90_over_p10": round(q[-1] / q[0], 3)}
        r = rows[name]
        print(f"{name:8s} {r['passes']:4d} passes: median {r['median_s']:.4f} s, min {r['min_s']:.4f}, max "
              f"{r['max_s']:.4f} (max/min {r['max_over_min']:.2f}, p90/p10 {r['p90_over_p10']:.2f})", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
