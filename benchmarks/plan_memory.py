"""The planner's predicted peak memory per rank against the peak a real run reaches, for the layouts
``--auto-layout`` can choose (TP, PP, DP, ZeRO 0-3, sequence parallelism, selective and full recomputation, fp32 and
bf16), in one run:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_memory.py          # CPU, 4 gloo ranks, ~20 min on 2 cores

Each layout runs ``pretrain_gpt.py``'s own ``run()`` for ``--iters`` iterations on 4 fresh gloo ranks (spawned
processes) over a generated corpus. Measured: the kernel's high-water mark
of each rank's resident set (VmHWM, reset through /proc/self/clear_refs just before ``run()``) minus its resident set
then (the interpreter and every library ``run()`` imports, imported first, torch's compiler included, which the
first optimizer imports): everything the run allocated, the planner's terms (parameters, gradients, optimizer state,
activations, output head, pipeline buffers, ZeRO buckets) and what no term scales with (the first kernels' and
gloo's buffers, the data pipeline, DeepSpeed's objects: ``--shape tiny`` measures them with a model whose terms are
all under 1 MiB; the planner's CPU allowance holds them). Each layout runs twice: with glibc mapping every
allocation of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_=65536``), so that a freed tensor leaves the
resident set at once, as a freed block leaves a GPU allocator's allocated bytes (the figure compared with the
prediction), and with glibc's defaults, whose arenas keep freed memory resident (the figure a CPU run shows). Predicted: ``megatron_ru.plan.predict_for_arguments`` for the
same parsed arguments on CPU, each pipeline stage's total; a row compares the busiest measured rank of each stage
with that stage's prediction and shows the worst stage. ``--auto-layout`` keeps
:data:`megatron_ru.plan.search.MEMORY_MARGIN` of a device free; the last line says whether the largest
under-prediction stays inside it.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.context_memory import free_port, reset_resident_peak, resident_peak_above  # noqa: E402
from benchmarks.train_step import make_corpus  # noqa: E402

#: a model whose states and activations are hundreds of MiB per rank, so that the fixed costs the planner does
#: not model (a few tens of MiB) stay small beside them
SHAPE = dict(layers=4, hidden=512, heads=8, groups=4, ffn=1408, vocab=16000, seq=512)
#: a model whose every planner term is under 1 MiB: what a rank holds beyond them (``--shape tiny``)
TINY = dict(layers=4, hidden=32, heads=4, groups=2, ffn=64, vocab=256, seq=32)
GLOBAL_BATCH = 16
WORLD = 4

#: (name, TP, PP, micro batch, ZeRO stage, extra flags): the kinds of layout the choice produces on 4 ranks
LAYOUTS = [
    ("TP 1 x PP 1 x DP 4, ZeRO 0", 1, 1, 2, 0, ()),
    ("TP 1 x PP 1 x DP 4, ZeRO 1", 1, 1, 2, 1, ()),
    ("TP 1 x PP 1 x DP 4, ZeRO 2", 1, 1, 2, 2, ()),
    ("TP 1 x PP 1 x DP 4, ZeRO 3", 1, 1, 2, 3, ()),
    ("TP 2 x PP 1 x DP 2, ZeRO 1", 2, 1, 2, 1, ()),
    ("TP 2 x PP 1 x DP 2, SP, selective recomputation, ZeRO 1", 2, 1, 4, 1,
     ("--sequence-parallel", "--recompute-granularity", "selective")),
    ("TP 4 x PP 1, full recomputation, micro batch 4", 4, 1, 4, 0,
     ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")),
    ("TP 1 x PP 2 x DP 2, ZeRO 1", 1, 2, 2, 1, ()),
    ("TP 2 x PP 2 x DP 1", 2, 2, 2, 0, ()),
    ("TP 1 x PP 4, micro batch 1", 1, 4, 1, 0, ()),
    ("TP 2 x PP 1 x DP 2, bf16, ZeRO 1", 2, 1, 2, 1, ("--bf16",)),
    ("TP 1 x PP 2 x DP 2, bf16, ZeRO 1", 1, 2, 2, 1, ("--bf16",)),
]


def argv_for(prefix: str, cache: str, tp: int, pp: int, micro: int, zero: int, extra: tuple[str, ...],
             iters: int, s: dict = SHAPE) -> list[str]:
    argv = ["--num-layers", s["layers"], "--hidden-size", s["hidden"], "--num-attention-heads", s["heads"],
            "--group-query-attention", "--num-query-groups", s["groups"], "--ffn-hidden-size", s["ffn"],
            "--seq-length", s["seq"], "--max-position-embeddings", s["seq"], "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
            "--micro-batch-size", micro, "--global-batch-size", GLOBAL_BATCH, "--zero-stage", zero,
            "--train-iters", iters, "--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", s["vocab"] - 1,
            "--make-vocab-size-divisible-by", "128", "--data-path", prefix, "--data-cache-path", cache,
            "--split", "100,0,0", "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "0",
            "--log-interval", 10 ** 6]
    return [str(a) for a in argv] + list(extra)


def _rank(rank: int, port: int, argv: list[str], queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (every library run() imports lazily, imported before the baseline)

    import megatron_ru.deepspeed_bridge.engine  # noqa: F401
    import megatron_ru.training.engine  # noqa: F401
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its first construction imports torch._dynamo (~70 MiB)
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.plan.api import predict_for_arguments
    from megatron_ru.training.pretrain import run
    args = parse_arguments(argv, world_size=WORLD, device_type="cpu")
    prediction = predict_for_arguments(args, device="cpu")
    before = reset_resident_peak()
    run(args)
    peak = resident_peak_above(before)
    stage = args.layout.coord(rank).pp
    queue.put((rank, stage, peak, prediction.stage_totals, prediction.stage, prediction.summary()))


def measure(argv: list[str]) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, argv, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with {p.exitcode}: {' '.join(argv)}")
    return sorted(results)


def main(argv: list[str] | None = None) -> int:
    from megatron_ru.plan.search import MEMORY_MARGIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=3, help="iterations per layout (the optimizer state exists from "
                                                          "the first step on, so 2 or more)")
    ap.add_argument("--only", type=int, nargs="*", help="row numbers of LAYOUTS to run (default: all)")
    ap.add_argument("--shape", choices=["model", "tiny"], default="model",
                    help="tiny: a model whose planner terms are all under 1 MiB (what a rank holds beyond them)")
    args = ap.parse_args(argv)
    s = SHAPE if args.shape == "model" else TINY
    print(f"model: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads / {s['groups']} KV groups, FFN "
          f"{s['ffn']} (SwiGLU), vocab {s['vocab']} (untied); sequence {s['seq']}, global batch {GLOBAL_BATCH}; "
          f"{WORLD} gloo ranks, 1 thread each; {args.iters} iterations; each layout with glibc's defaults and with "
          f"MALLOC_MMAP_THRESHOLD_=65536", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = make_corpus(tmp, s["vocab"], 200_000)
        for i, (name, tp, pp, micro, zero, extra) in enumerate(LAYOUTS):
            if args.only and i not in args.only:
                continue
            argv_ = argv_for(prefix, os.path.join(tmp, "cache"), tp, pp, micro, zero, extra, args.iters, s)
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
            results = measure(argv_)
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned rank's C library at start
            returned = measure(argv_)
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
            totals = results[0][3]
            measured = [max(r[2] for r in results if r[1] == st) for st in range(pp)]
            live = [max(r[2] for r in returned if r[1] == st) for st in range(pp)]
            ratios = [m / t for m, t in zip(live, totals)]
            worst = max(range(pp), key=lambda st: ratios[st])
            rows.append((name, totals[worst], live[worst], ratios[worst], measured[worst], worst, pp, min(ratios)))
            print(f"  {name}: stage {worst}: predicted {totals[worst] / 2**20:.0f} MiB, measured {live[worst] / 2**20:.0f}"
                  f" MiB ({ratios[worst]:.3f}), {measured[worst] / 2**20:.0f} MiB with glibc's defaults; "
                  f"{results[0][5]}", flush=True)
    print("\n| layout | stage | predicted (MiB) | measured, freed memory returned (MiB) | measured / predicted | "
          "other stages | measured, glibc defaults (MiB) | / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for name, pred, live, ratio, measured, stage, pp, low in rows:
        others = f"≥ {low:.3f}" if pp > 1 else "-"
        print(f"| {name} | {stage if pp > 1 else '-'} | {pred / 2**20:.0f} | {live / 2**20:.0f} | {ratio:.3f} | {others} | "
              f"{measured / 2**20:.0f} | {measured / pred:.3f} |")
    worst = max(r[3] for r in rows)
    best = min(min(r[3], r[7]) for r in rows)
    inside = worst <= 1 / (1 - MEMORY_MARGIN)
    print(f"\nmeasured (freed memory returned) / predicted from {best:.3f} to {worst:.3f}; --auto-layout keeps "
          f"{100 * MEMORY_MARGIN:.0f}% of a device free (a prediction may be {100 * (1 / (1 - MEMORY_MARGIN) - 1):.1f}% "
          f"short): {'inside' if inside else 'OUTSIDE'} the margin")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
