#!/usr/bin/env python
"""Two checkouts of the tool against each other and the limit, one matrix cell, rotated rounds.

    git clone -q . /tmp/old && git -C /tmp/old checkout <commit> && make -C /tmp/old install
    python benchmarks/preprocess_ab.py --old /tmp/old --cell sp-unigram:longtail --workers 2 --repeat 4

Each round runs, in rotated order: the limit (benchmarks/preprocess.py's: the tokenizer alone in a
fresh process, texts already in memory as ``str``), ``tools/preprocess_data.py --workers k
--append-eod`` of the checkout at --old with its own .venv, and the same of this checkout; each
tool run is a fresh process timed from launch to exit, with its peak RSS. Both packages are
byte-compiled first (as benchmarks/preprocess.py does). Prints per round the walls, then each
checkout's median ratio limit / tool and spread, and whether the two outputs are byte-identical.
For a change whose effect is a few per cent on this VM (whose two-thread speed moves by ±25 %
between minutes) this is the fair comparison: both sides see the same minutes.
"""
from __future__ import annotations

import argparse
import compileall
import filecmp
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def run_checkout(root: str, flags: list[str], corpus: str, out: str, workers: int) -> tuple[float, float]:
    cmd = [os.path.join(root, ".venv", "bin", "python"), os.path.join(root, "tools", "preprocess_data.py"),
           "--input", corpus, "--output-prefix", out, *flags, "--append-eod", "--workers", str(workers),
           "--log-interval", "100000000"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAYON_NUM_THREADS", None)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the other checkout (with its .venv, as `make install` makes it)")
    ap.add_argument("--cell", required=True, help="tokenizer:shape, e.g. sp-unigram:longtail")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    args = ap.parse_args()
    import preprocess as matrix

    t, s = args.cell.split(":")
    ns = argparse.Namespace(workdir=args.workdir, tokenizers=[t], shapes=[s], size_mb=None, huge_mb=100.0)
    flags, corpora = matrix.setup(ns)
    corpus = corpora[(t, s)]
    checkouts = {"old": os.path.abspath(args.old), "new": ROOT}
    for root in checkouts.values():
        for d in ("megatron_ru", "tools"):
            compileall.compile_dir(os.path.join(root, d), quiet=1)
    outs = {k: os.path.join(args.workdir, f"ab_{k}_{t}_{s}") for k in checkouts}
    sides = ["limit", "old", "new"]
    walls: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.repeat):
        line = []
        for side in sides[r % 3:] + sides[:r % 3]:
            if side == "limit":
                walls[side].append(matrix.run_limit(flags[t], corpus, s, args.workers)["wall"])
                line.append(f"limit {walls[side][-1]:.2f} s")
            else:
                wall, rss = run_checkout(checkouts[side], flags[t], corpus, outs[side], args.workers)
                walls[side].append(wall)
                line.append(f"{side} {wall:.2f} s ({rss:.0f} MB)")
        print(f"{t} {s} w{args.workers} round {r + 1}: " + ", ".join(line), flush=True)
    for side in ("old", "new"):
        ratios = [lim / x for lim, x in zip(walls["limit"], walls[side])]
        print(f"| {t} | {s} | {args.workers} | {side} ({checkouts[side]}) | {statistics.median(walls[side]):.2f} | "
              f"{statistics.median(walls['limit']):.2f} | **{statistics.median(ratios):.3f}** | "
              f"{min(ratios):.3f}-{max(ratios):.3f} |")
    same = all(filecmp.cmp(outs["old"] + "_text_document" + e, outs["new"] + "_text_document" + e, shallow=False)
               for e in (".bin", ".idx"))
    print(f"outputs byte-identical: {same}")


if __name__ == "__main__":
    main()
