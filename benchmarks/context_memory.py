"""Context parallelism on a long sequence: the peak memory per rank of one training step (forward, loss, backward)
on one 16K-token sample at CP 1, 2 and 4, and the step time of the ring against the all-to-all, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_memory.py            # CPU preset, ~3 min on 2 cores

Each CP size runs on its own gloo ranks (fresh processes). CP 1 is the model without context parallelism (SDPA's
causal path, which on CPU does not build the sequence x sequence matrix either); CP 2 and 4 hold 1/CP of the
tokens per rank and compute attention blockwise over the ring or the all-to-all (megatron_ru/parallel/context.py).
Peak memory: the kernel's high-water mark of the rank's resident set (VmHWM, reset through /proc/self/clear_refs
just before the step) minus the resident set before it: the step's activations, gradients and transients, not
the weights, libraries or interpreter; the largest rank's. Step time: medians of ``--steps`` steps after a
warm-up step, the slowest rank's. Prints a markdown table with the ratios to CP 1.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRESET = dict(layers=2, hidden=256, heads=8, groups=4, ffn=640, vocab=4000, seq=16384)


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def reset_resident_peak() -> int:
    """Reset this process's resident-set high-water mark (VmHWM) to its resident set now, and return that (bytes):
    the baseline of :func:`resident_peak_above` (the other memory benchmarks measure this way too)."""
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before * 1024


def resident_peak_above(before: int) -> int:
    """Bytes the resident set has reached above ``before`` (:func:`reset_resident_peak`) since the reset."""
    return _kib("VmHWM") * 1024 - before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, cp: int, comm: str, port: int, p: dict, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model import GPTModel
    from megatron_ru.parallel.context import enable_context_parallel, local_token_indices
    cfg = ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                      group_query_attention=True, num_query_groups=p["groups"], ffn_hidden_size=p["ffn"],
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                      make_vocab_size_divisible_by=128, max_position_embeddings=p["seq"])
    model = GPTModel(cfg, p["vocab"], seed=1)
    if cp > 1:
        enable_context_parallel(model, dist.new_group(list(range(cp))), comm)
    tokens = torch.randint(0, p["vocab"], (1, p["seq"] + 1), generator=torch.Generator().manual_seed(3))
    idx = local_token_indices(p["seq"], cp, rank)
    inputs, labels = tokens[:, :-1][:, idx].contiguous(), tokens[:, 1:][:, idx].contiguous()
    positions = idx[None] if cp > 1 else None

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(inputs, labels, position_ids=positions).backward()

    step()  # warm-up: the gradients exist from here on, as in training
    model.zero_grad(set_to_none=True)
    before = reset_resident_peak()
    step()
    peak = resident_peak_above(before) / 1024
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    queue.put((rank, peak / 1024, statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()


def run(cp: int, comm: str, p: dict, steps: int) -> tuple[float, float]:
    """(peak MiB of the largest rank, median step seconds of the slowest rank)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, comm, port, p, steps, queue)) for r in range(cp)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"CP {cp} {comm}: a rank exited with {proc.exitcode}")
    return max(r[1] for r in results), max(r[2] for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=PRESET["seq"])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    p = dict(PRESET, seq=args.seq)
    print(f"model: {p['layers']} layers, hidden {p['hidden']}, {p['heads']} heads / {p['groups']} KV groups, FFN "
          f"{p['ffn']}, vocab {p['vocab']}; one sample of {p['seq']} tokens, fp32, 1 thread per rank", flush=True)
    rows = []
    for cp in args.cp:
        for comm in (["p2p", "a2a"] if cp > 1 else ["none"]):
            peak, seconds = run(cp, comm, p, args.steps)
            rows.append((cp, comm, peak, seconds))
            print(f"  CP {cp} {comm}: peak {peak:.0f} MiB, step {seconds:.2f} s", flush=True)
    base_peak, base_time = rows[0][2], rows[0][3]
    print("\n| CP | exchange | tokens per rank | peak memory per rank (MiB) | / CP 1 | step (s) | / CP 1 |")
    print("|---|---|---|---|---|---|---|")
    for cp, comm, peak, seconds in rows:
        name = {"none": "-", "p2p": "ring (p2p)", "a2a": "all-to-all (a2a)"}[comm]
        print(f"| {cp} | {name} | {p['seq'] // cp:,} | {peak:.0f} | {peak / base_peak:.2f} | {seconds:.2f} | "
              f"{seconds / base_time:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
