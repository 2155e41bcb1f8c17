#!/usr/bin/env python
"""Saving a ~1B checkpoint and loading it at another layout: wall time and peak RSS per rank.

    .venv/bin/python benchmarks/checkpoint_load.py [--workdir DIR] [--layers 16 --hidden 2048 ...]

A LLaMA-shaped model (default: 16 layers, hidden 2048, 16 heads / 8 KV groups, FFN 5504, vocabulary
32,000, untied: 0.87 B parameters) trains in fp32 with AdamW at ZeRO 0 (``--bf16``: bf16 at ZeRO 1, DeepSpeed's
bf16 optimizer with fp32 masters) on 2 ranks launched as torchrun
launches them (one ``pretrain_gpt.py`` process per rank, RANK/WORLD_SIZE/MASTER_* in the environment),
on seq 64, one micro batch. Runs, each timed from start to exit with every rank's peak RSS
(``ru_maxrss`` from ``wait4``):

1. ``train``: one iteration at TP 1 x PP 2, and at TP 2 x PP 1, no checkpoint: what a rank holds to train
   (weights, gradients, Adam moments, activations, the libraries);
2. ``train+save``: the same with ``--save`` (DeepSpeed's files): the save's cost is the difference;
3. ``load, same layout``: ``--load`` of that checkpoint at TP 1 x PP 2 (DeepSpeed's own loading);
4. ``load, TP 2 x PP 1``: ``--load`` of it at TP 2 x PP 1 (read by canonical names, no conversion step).

The loads run no iteration (``--train-iters`` = the saved iteration). A rank's share of the model and
optimizer state is 12 bytes per parameter it holds in fp32 (weight and two Adam moments; training adds a 4-byte
gradient), 14 in bf16 (bf16 weight, fp32 master and moments; training adds a 4-byte fp32 gradient); the table
gives each peak RSS against it. The checkpoint (~14 GB) is written under ``--workdir`` (default: a
temporary directory on the same disk as /tmp) and removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.train_step import make_corpus, pretrain_argv  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], world: int, log_path: str) -> dict[str, Any]:
    """``pretrain_gpt.py argv`` on ``world`` ranks; wall seconds, each rank's peak RSS (GiB), exit codes."""
    port = _free_port()
    procs = []
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        rss, codes = {}, {}
        pending = {p.pid: i for i, p in enumerate(procs)}
        while pending:
            pid, status, usage = os.wait4(-1, 0)
            if pid in pending:
                i = pending.pop(pid)
                rss[i] = usage.ru_maxrss / 2 ** 20  # KiB -> GiB
                codes[i] = os.waitstatus_to_exitcode(status)
    return {"wall_s": time.perf_counter() - t0, "peak_rss_gib": [rss[i] for i in range(world)],
            "exit": [codes[i] for i in range(world)]}


def params_per_rank(p: dict, tp: int, pp: int) -> list[int]:
    """Parameters each rank holds (rank order: TP fastest, then PP): the layers of its stage cut by TP
    (norm weights whole), the embedding on the first stage and the output layer on the last."""
    h, f, L = p["hidden"], p["ffn"], p["layers"]
    kv = h // p["heads"] * p["groups"]
    vocab = -(-(p["vocab"] - 1) // (128 * tp)) * 128 * tp  # padded like --make-vocab-size-divisible-by 128
    split = (h * (h + 2 * kv) + h * h + 3 * h * f) // tp
    layer = split + 2 * h
    out = []
    for stage in range(pp):
        n = (L // pp) * layer
        n += vocab * h // tp if stage == 0 else 0
        n += vocab * h // tp + h if stage == pp - 1 else 0
        out += [n] * tp
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5504)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (checkpoint, logs)")
    ap.add_argument("--bf16", action="store_true", help="bf16 at ZeRO 1 instead of fp32 at ZeRO 0")
    opts = ap.parse_args()
    p = dict(layers=opts.layers, hidden=opts.hidden, heads=opts.heads, groups=opts.groups, ffn=opts.ffn,
             vocab=opts.vocab, seq=64, batch=1)
    work = tempfile.mkdtemp(prefix="ckpt_load_", dir=opts.workdir)
    try:
        prefix = make_corpus(work, p["vocab"], 200_000)
        cache, save = os.path.join(work, "cache"), os.path.join(work, "ckpt")
        precision, zero, state_bytes = ("bf16", 1, 14) if opts.bf16 else ("fp32", 0, 12)
        base = pretrain_argv(p, prefix, cache, 1, precision, zero_stage=zero)
        layouts = {"TP 1 x PP 2": ("1", "2"), "TP 2 x PP 1": ("2", "1")}

        def at(layout: str) -> list[str]:
            tp, pp = layouts[layout]
            return ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]

        runs = [("train", at("TP 1 x PP 2"), "TP 1 x PP 2"),
                ("train", at("TP 2 x PP 1"), "TP 2 x PP 1"),
                ("train+save", at("TP 1 x PP 2") + ["--save", save, "--save-interval", "1"], "TP 1 x PP 2"),
                ("load, same layout", at("TP 1 x PP 2") + ["--load", save], "TP 1 x PP 2"),
                ("load, TP 2 x PP 1", at("TP 2 x PP 1") + ["--load", save], "TP 2 x PP 1")]
        results = []
        for name, extra, layout in runs:
            subprocess.run(["sync"], check=False)
            log_path = os.path.join(work, f"{name}-{layout}".replace(" ", "_").replace(",", "") + ".log")
            r = launch(base + extra, 2, log_path)
            tp, pp = (int(x) for x in layouts[layout])
            shares = [state_bytes * n / 2 ** 30 for n in params_per_rank(p, tp, pp)]
            r.update(name=name, layout=layout, share_gib=shares,
                     rss_over_share=[rss / s for rss, s in zip(r["peak_rss_gib"], shares)])
            with open(log_path) as f:
                text = f.read()
            if any(r["exit"]):
                r["log_tail"] = text[-3000:]
            # the cross-layout load is ours (by canonical names), the same-layout one DeepSpeed's
            r["loaded_by_names"] = "by canonical names" in text
            results.append(r)
            print(json.dumps(r), flush=True)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save) for f in fs)
        total = sum(params_per_rank(p, 1, 1))
        print(f"\nmodel: {total / 1e9:.2f} B parameters, {precision}, ZeRO {zero}; checkpoint {size / 2 ** 30:.1f} GiB "
              f"on disk\n")
        print("| run | layout | wall s | peak RSS per rank (GiB) | model + optimizer state per rank (GiB) | "
              "peak RSS / that |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['name']} | {r['layout']} | {r['wall_s']:.1f} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['peak_rss_gib'])} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['share_gib'])} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['rss_over_share'])} |"
                  + (" **failed**" if any(r["exit"]) else ""))
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"params": total, "checkpoint_bytes": size, "runs": results}, f, indent=1)
    finally:
        if opts.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
