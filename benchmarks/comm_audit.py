"""Communication audit: the bytes each rank actually sends per training step, counted by wrapping
torch.distributed (``--comm-audit``), against the planner's analytic volume
(:func:`megatron_ru.plan.comm.stage_comm_ops`), per layout and parallel dimension.

Tiny models train a few iterations on CPU with gloo at each layout (2 and 4 ranks); the table
shows, for each layout and dimension, the busiest rank's counted and analytic wire bytes per step
(iteration 2 on; iteration 1 also carries DeepSpeed's one-time pipeline shape messages) and
whether every rank matched exactly (wire and payload bytes). Conventions: docs/comm_audit.md.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python benchmarks/comm_audit.py
    .venv/bin/python benchmarks/comm_audit.py --only 2      # the 2-rank layouts only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist_utils import run_distributed  # noqa: E402
from tests.integration._train_helpers import make_corpus, tiny_argv, without_flags  # noqa: E402

ITERS = 3
#: a GPT-2-style variant: LayerNorm with biases, biased linears, learned positions, GELU, tied embeddings
GPT2_STYLE = ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute"]
UNLLAMA = ("--normalization", "--position-embedding-type", "--swiglu", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups")

#: ZeRO 3 with every parameter gathered per micro batch (the tiny model's are all under DeepSpeed's default
#: persistence threshold of 1e5 elements, so by default they stay gathered)
Z3_GATHER_ALL = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
MARKERS = ("tied", "gpt2", "z3-gather-all")

#: (name, world size, flags and markers); the base model is tests/integration/_train_helpers.tiny_argv's
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("TP2", 2, ["--tensor-model-parallel-size", "2"]),
    ("TP2 recompute", 2, ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"]),
    ("TP2 SP", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("TP2 SP recompute", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--recompute-granularity", "full"]),
    ("TP2 SP gpt2-style", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "gpt2"]),
    ("PP2", 2, ["--pipeline-model-parallel-size", "2"]),
    ("PP2 tied", 2, ["--pipeline-model-parallel-size", "2", "tied"]),
    ("DP2 ZeRO0", 2, ["--zero-stage", "0"]),
    ("DP2 ZeRO1", 2, ["--zero-stage", "1"]),
    ("TP2 bf16 ZeRO1", 2, ["--tensor-model-parallel-size", "2", "--bf16", "--zero-stage", "1"]),
    ("PP2 bf16 ZeRO1 tied", 2, ["--pipeline-model-parallel-size", "2", "--bf16", "--zero-stage", "1", "tied"]),
    ("DP2 bf16 ZeRO1", 2, ["--bf16", "--zero-stage", "1"]),
    ("DP2 ZeRO2", 2, ["--zero-stage", "2"]),
    ("DP2 bf16 ZeRO2", 2, ["--bf16", "--zero-stage", "2"]),
    ("DP2 ZeRO3", 2, ["--zero-stage", "3"]),
    ("DP2 ZeRO3 no persistent", 2, ["--zero-stage", "3", "z3-gather-all"]),
    ("DP2 bf16 ZeRO3 no persistent", 2, ["--bf16", "--zero-stage", "3", "z3-gather-all"]),
    ("PP4", 4, ["--pipeline-model-parallel-size", "4"]),
    ("TP2xPP2", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("TP2xPP2 SP", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel"]),
    ("TP2xDP2 ZeRO0", 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    ("TP2xDP2 ZeRO1", 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]),
    ("PP2xDP2 ZeRO1 tied", 4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "tied"]),
    ("TP2xPP2 SP bf16 ZeRO1", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                  "--sequence-parallel", "--bf16", "--zero-stage", "1"]),
    ("TP2xDP2 bf16 ZeRO1", 4, ["--tensor-model-parallel-size", "2", "--bf16", "--zero-stage", "1"]),
    ("TP2xDP2 bf16 ZeRO2", 4, ["--tensor-model-parallel-size", "2", "--bf16", "--zero-stage", "2"]),
    ("TP2xDP2 ZeRO3 no persistent", 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "z3-gather-all"]),
    # context parallelism: the ring's key/value blocks and their gradients, or the all-to-all of q, k, v and the
    # output; the gradients reduced over DP x CP
    ("CP2 ring", 2, ["--context-parallel-size", "2"]),
    ("CP2 a2a", 2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    ("CP2 ring recompute", 2, ["--context-parallel-size", "2", "--recompute-granularity", "full"]),
    ("CP2 ring bf16 ZeRO1", 2, ["--context-parallel-size", "2", "--bf16", "--zero-stage", "1"]),
    ("CP2xDP2 ZeRO1", 4, ["--context-parallel-size", "2", "--zero-stage", "1"]),
    ("TP2xCP2 SP", 4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]),
    ("PP2xCP2 a2a", 4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                        "--cp-comm-type", "a2a"]),
]


def layout_argv(prefix: str, cache: str, flags: list[str], iters: int = ITERS) -> list[str]:
    """tiny_argv's model and data with ``flags`` (and :data:`MARKERS`)."""
    argv = tiny_argv(prefix, cache, iters=iters, extra=["--eval-iters", "0", "--lr-warmup-iters", "0"])
    extra = [f for f in flags if f not in MARKERS]
    if "z3-gather-all" in flags:
        bf16 = "--bf16" in flags  # the file must agree with the precision flags
        path = os.path.join(os.path.dirname(prefix), f"z3_gather_all{'_bf16' if bf16 else ''}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**Z3_GATHER_ALL, "bf16": {"enabled": bf16}}, f)
        extra += ["--deepspeed_config", path]
    if "tied" in flags:
        argv = without_flags(argv, "--untie-embeddings-and-output-weights")
    if "gpt2" in flags:
        argv = without_flags(argv, *UNLLAMA) + GPT2_STYLE
    return argv + extra


def audit_body(rank: int, world_size: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    """Rank body: train each argv with the audit on; return its records, model config and vocabulary."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.parallel.comm_audit import CommAudit
    from megatron_ru.training.pretrain import setup
    out = []
    for argv in runs:
        args = parse_arguments(argv, world_size=world_size, device_type="cpu")
        trainer = setup(args)
        if not isinstance(trainer.comm_audit, CommAudit):  # no --comm-audit FILE: keep the records in memory
            trainer.comm_audit = CommAudit.for_state(trainer.state)
        try:
            trainer.train()
        finally:
            trainer.metrics.close()
        out.append({"history": trainer.comm_audit.history, "model": args.model,
                    "vocab_size": trainer.checkpoint_record["vocab_size"], "tp": args.tp, "pp": args.pp,
                    "dp": args.dp, "micro_batch": args.training.micro_batch_size,
                    "global_batch": args.global_batch_size, "seq_length": args.data.seq_length,
                    "sp": args.sequence_parallel, "recompute": args.model.recompute,
                    "zero": args.training.zero_stage, "precision": args.precision, "cp": args.cp,
                    "cp_comm": args.parallel.cp_comm_type})
    return out


def audit_layouts(layouts: list[tuple[str, int, list[str]]], workdir: str, iters: int = ITERS,
                  timeout: float = 900) -> dict[str, list[dict]]:
    """name -> comparison rows (:func:`megatron_ru.plan.comm.compare_with_audit`, with ``iteration``) of
    every audited iteration, for each layout; layouts of one world size share one spawn of gloo ranks."""
    from megatron_ru.plan.comm import compare_with_audit
    from megatron_ru.plan.layout import Layout
    prefix = make_corpus(workdir)
    cache = os.path.join(workdir, "cache")
    out: dict[str, list[dict]] = {}
    for world in sorted({w for _, w, _ in layouts}):
        chosen = [(n, f) for n, w, f in layouts if w == world]
        runs = [layout_argv(prefix, cache, f, iters) for _, f in chosen]
        results = run_distributed(audit_body, world, args=(runs,), timeout=timeout, env={"DS_ACCELERATOR": "cpu"})
        for i, (name, flags) in enumerate(chosen):
            kw = {"zero3_persistence_threshold": 0} if "z3-gather-all" in flags else {}
            r0 = results[0][i]
            layout = Layout(tp=r0["tp"], pp=r0["pp"], dp=r0["dp"], micro_batch=r0["micro_batch"],
                            global_batch=r0["global_batch"], seq_length=r0["seq_length"],
                            sequence_parallel=r0["sp"], recompute="full" if r0["recompute"] else "none",
                            zero_stage=r0["zero"], precision=r0["precision"], cp=r0["cp"],
                            cp_comm=r0["cp_comm"])
            rows = []
            for it in range(1, iters + 1):
                records = [results[rank][i]["history"][it - 1] for rank in range(world)]
                rows += [dict(row, iteration=it) for row in
                         compare_with_audit(records, r0["model"], r0["vocab_size"], layout, **kw)]
            out[name] = rows
    return out


def steady(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The rows of iterations 2 on (iteration 1 also carries one-time start-up messages)."""
    return {name: [r for r in rows if r["iteration"] >= 2] for name, rows in results.items()}


def first_iteration_extra(results: dict[str, list[dict]]) -> str:
    """Bytes iteration 1 moves beyond the analytic step, per layout and dimension (busiest rank)."""
    lines = []
    for name, rows in results.items():
        for dim in sorted({r["dim"] for r in rows}):
            extra = max((r["counted"] - r["analytic"] for r in rows if r["iteration"] == 1 and r["dim"] == dim),
                        default=0)
            if extra:
                lines.append(f"{name} {dim}: +{extra:,} B")
    return "\n".join(lines) or "none"


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| layout | dim | counted B/step (busiest rank) | analytic B/step | ratio | ranks exact |",
             "|---|---|---:|---:|---:|---|"]
    for name, rows in results.items():
        for dim in sorted({r["dim"] for r in rows}):
            sel = [r for r in rows if r["dim"] == dim]
            counted = max(r["counted"] for r in sel)
            analytic = max(r["analytic"] for r in sel)
            exact = sum(r["counted"] == r["analytic"] and r["counted_payload"] == r["analytic_payload"] for r in sel)
            ratio = f"{counted / analytic:.2f}" if analytic else ("-" if not counted else "inf")
            lines.append(f"| {name} | {dim} | {counted:,} | {analytic:,} | {ratio} | {exact}/{len(sel)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, choices=(2, 4), help="only the layouts of this world size")
    ns = parser.parse_args()
    layouts = [lay for lay in LAYOUTS if ns.only in (None, lay[1])]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = audit_layouts(layouts, tmp)
    print(table(steady(results)))
    print(f"\n(rows: iterations 2..{ITERS} x ranks; {time.time() - started:.0f} s)")
    print("\nIteration 1 only, beyond the analytic step (DeepSpeed's one-time pipeline shape messages):")
    print(first_iteration_extra(results))
    bad = [n for n, rows in steady(results).items() if any(r["counted"] != r["analytic"] for r in rows)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
