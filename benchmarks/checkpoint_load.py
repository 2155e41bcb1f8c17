#!/usr/bin/env python
"""Saving a ~1B checkpoint and loading it, at its own layout and another: wall time and peak RSS per rank, for
each checkpoint format (DeepSpeed's files, what training wrote before, against the layer format by canonical name).

    .venv/bin/python benchmarks/checkpoint_load.py [--workdir DIR] [--layers 16 --hidden 2048 ...]
        [--save-layout 2,2 --load-layout 4,1 --world 4] [--bf16]

A LLaMA-shaped model (default: 16 layers, hidden 2048, 16 heads / 8 KV groups, FFN 5504, vocabulary
32,000, untied: 0.87 B parameters) trains in fp32 with AdamW at ZeRO 0 (``--bf16``: bf16 at ZeRO 1, DeepSpeed's
bf16 optimizer with fp32 masters) on ``--world`` ranks launched as torchrun launches them (one
``pretrain_gpt.py`` process per rank, RANK/WORLD_SIZE/MASTER_* in the environment), on seq 64, one micro
batch. Runs, each timed from start to exit with every rank's peak RSS (``ru_maxrss`` from ``wait4``):

1. ``train``: one iteration at the save layout, no checkpoint: what a rank holds to train;
2. ``train + save`` with ``--ckpt-format deepspeed`` and ``megatron_ru``: the save's own time is the one
   training logs ("saved checkpoint ... in X s": from the first write to the pointer, every rank done);
3. ``load, same layout``: ``--load`` of each at the save layout;
4. ``load, other layout``: ``--load`` of each at ``--load-layout`` (read by canonical names, no conversion step).

The loads run no iteration (``--train-iters`` = the saved iteration). A rank's share of the model and
optimizer state is 12 bytes per parameter it holds in fp32 (weight and two Adam moments; training adds a 4-byte
gradient), 14 in bf16 (bf16 weight, fp32 master and moments; training adds a 4-byte fp32 gradient); the table
gives each peak RSS against it. The checkpoints (~2 x 10 GB) are written under ``--workdir`` (default: a
temporary directory on the same disk as /tmp) and removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.context_memory import free_port  # noqa: E402
from benchmarks.train_step import make_corpus, pretrain_argv  # noqa: E402


def launch(argv: list[str], world: int, log_path: str) -> dict[str, Any]:
    """``pretrain_gpt.py argv`` on ``world`` ranks; wall seconds, each rank's peak RSS (GiB), exit codes."""
    port = free_port()
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


def _layout(text: str) -> tuple[int, int]:
    tp, pp = (int(x) for x in text.split(","))
    return tp, pp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5504)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=4, help="ranks of every run")
    ap.add_argument("--save-layout", type=_layout, default=(2, 2), help="TP,PP of the saving run")
    ap.add_argument("--load-layout", type=_layout, default=(4, 1), help="TP,PP of the loading run at another layout")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (checkpoints, logs)")
    ap.add_argument("--bf16", action="store_true", help="bf16 at ZeRO 1 instead of fp32 at ZeRO 0")
    opts = ap.parse_args()
    p = dict(layers=opts.layers, hidden=opts.hidden, heads=opts.heads, groups=opts.groups, ffn=opts.ffn,
             vocab=opts.vocab, seq=64, batch=1)
    work = tempfile.mkdtemp(prefix="ckpt_load_", dir=opts.workdir)
    try:
        prefix = make_corpus(work, p["vocab"], 200_000)
        cache = os.path.join(work, "cache")
        precision, zero, state_bytes = ("bf16", 1, 14) if opts.bf16 else ("fp32", 0, 12)
        base = pretrain_argv(p, prefix, cache, 1, precision, zero_stage=zero)
        src, dst = opts.save_layout, opts.load_layout
        name_of = {src: f"TP {src[0]} x PP {src[1]}", dst: f"TP {dst[0]} x PP {dst[1]}"}

        def at(layout: tuple[int, int]) -> list[str]:
            return ["--tensor-model-parallel-size", str(layout[0]), "--pipeline-model-parallel-size", str(layout[1])]

        runs = [("train", None, at(src), src)]
        for fmt in ("deepspeed", "megatron_ru"):
            save = os.path.join(work, fmt)
            runs += [("train + save", fmt, at(src) + ["--save", save, "--save-interval", "1", "--ckpt-format", fmt], src),
                     ("load, same layout", fmt, at(src) + ["--load", save], src),
                     ("load, other layout", fmt, at(dst) + ["--load", save], dst)]
        results, sizes = [], {}
        for name, fmt, extra, layout in runs:
            subprocess.run(["sync"], check=False)
            log_path = os.path.join(work, f"{name}-{fmt}".replace(" ", "_").replace(",", "") + ".log")
            r = launch(base + extra, opts.world, log_path)
            dp = opts.world // (layout[0] * layout[1])
            shares = [state_bytes * n / 2 ** 30 for n in params_per_rank(p, *layout) for _ in range(dp)]
            r.update(name=name, format=fmt, layout=name_of[layout], share_gib=shares,
                     rss_over_share=[rss / s for rss, s in zip(r["peak_rss_gib"], shares)])
            with open(log_path) as f:
                text = f.read()
            if any(r["exit"]):
                r["log_tail"] = text[-3000:]
            r["loaded_by_names"] = "by canonical names" in text
            saved = re.search(r"saved checkpoint at iteration \d+ to \S+ in ([\d.]+) s", text)
            r["save_s"] = float(saved.group(1)) if saved else None
            results.append(r)
            print(json.dumps(r), flush=True)
            if name == "train + save":
                save = os.path.join(work, fmt)
                sizes[fmt] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save) for f in fs)
        total = sum(params_per_rank(p, 1, 1))
        print(f"\nmodel: {total / 1e9:.2f} B parameters, {precision}, ZeRO {zero}, {opts.world} ranks; checkpoint on "
              f"disk: " + ", ".join(f"{k} {v / 2 ** 30:.1f} GiB" for k, v in sizes.items()) + "\n")
        print("| run | format | layout | wall s | save s | peak RSS per rank (GiB) | model + optimizer state per rank "
              "(GiB) | peak RSS / that |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            save_s = f"{r['save_s']:.1f}" if r.get("save_s") is not None else ""
            print(f"| {r['name']} | {r['format'] or '-'} | {r['layout']} | {r['wall_s']:.1f} | {save_s} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['peak_rss_gib'])} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['share_gib'])} | "
                  f"{' / '.join(f'{x:.2f}' for x in r['rss_over_share'])} |"
                  + (" **failed**" if any(r["exit"]) else ""))
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"params": total, "checkpoint_bytes": sizes, "runs": results}, f, indent=1)
    finally:
        if opts.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
