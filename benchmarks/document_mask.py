"""Packed documents: a training step with --reset-position-ids --reset-attention-mask --eod-mask-loss (SDPA with
the block-diagonal causal mask built from per-token document ids) against the plain causal step (SDPA's
``is_causal`` path), same model, same tokens, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/document_mask.py            # CPU preset, ~1 min
    .venv/bin/python benchmarks/document_mask.py --preset 1b --dtype bf16      # on a GPU

Step time: forward + loss + backward + AdamW step, the two variants interleaved (A B A B ...) after warm-up
steps, medians of wall time and (on CPU) of the process's CPU time, which other processes on a shared machine
disturb less. Peak memory: each variant in its own child process: the largest resident set sampled every
millisecond during the steps minus the resident set before them (on a GPU, ``torch.cuda.max_memory_allocated``
above the allocation before the steps). Prints a markdown row: with the mask / without.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.data.documents import DocumentMasking
from megatron_ru.model import GPTModel

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro batch, mean document length
    "cpu": dict(layers=4, hidden=256, heads=8, groups=4, ffn=640, vocab=8000, seq=1024, batch=2, doc=200),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=4096, batch=2, doc=800),
}


def build(p: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    cfg = ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                      group_query_attention=True, num_query_groups=p["groups"], ffn_hidden_size=p["ffn"],
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, make_vocab_size_divisible_by=128, max_position_embeddings=p["seq"])
    model = GPTModel(cfg, p["vocab"], device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    eod = p["vocab"] - 1
    tokens = torch.randint(0, eod, (p["batch"], p["seq"] + 1), generator=gen)
    tokens[torch.rand(tokens.shape, generator=gen) < 1.0 / p["doc"]] = eod   # documents of ~doc tokens
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions, documents, loss_mask = DocumentMasking(eod, True, True, True).apply(inputs)
    batch = {"plain": dict(tokens=inputs, labels=labels),
             "masked": dict(tokens=inputs, labels=(labels, loss_mask), position_ids=positions, document_ids=documents)}
    batch = {k: {n: (tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)) for n, v in b.items()}
             for k, b in batch.items()}
    return model, batch, int((inputs == eod).sum())


def step_fn(model, batch: dict):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class RssSampler(threading.Thread):
    """The largest resident set seen while running (sampled every millisecond)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = rss_mib(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.001)


def memory_child(args: argparse.Namespace) -> None:
    """One variant's peak memory over ``--steps`` steps above what the model and batch hold."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, batch, _ = build(PRESETS[args.preset], device, dtype)
    step = step_fn(model, batch[args.memory_child])
    step()  # the optimizer's state exists from the first step on: measure the steps after it
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2 ** 20
    else:
        base = rss_mib()
        sampler = RssSampler()
        sampler.start()
    for _ in range(args.steps):
        step()
    sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 20
    else:
        sampler.running = False
        sampler.join()
        peak = sampler.peak
    print(json.dumps({"peak_mib": peak - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "bf16"))
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each variant (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--memory-child", choices=("plain", "masked"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = "bfloat16" if args.dtype == "bf16" else args.dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args)
    device, dtype, p = torch.device(args.device), getattr(torch, args.dtype), PRESETS[args.preset]
    model, batch, eods = build(p, device, dtype)
    # one model, its weights restored between the variants: both start every step from the same state
    state = {k: v.clone() for k, v in model.state_dict().items()}
    steps = {name: step_fn(model, b) for name, b in batch.items()}
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    cpu_times: dict[str, list[float]] = {"plain": [], "masked": []}
    for i in range(args.steps + 2):
        for name, step in steps.items():
            model.load_state_dict(state)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync(device)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
    memory = {}
    for name in ("plain", "masked"):
        cmd = [sys.executable, __file__, "--preset", args.preset, "--device", args.device, "--dtype", args.dtype,
               "--steps", "2", "--memory-child", name] + (["--threads", str(args.threads)] if args.threads else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        memory[name] = json.loads(out)["peak_mib"]
    plain, masked = statistics.median(times["plain"]), statistics.median(times["masked"])
    cpu_plain, cpu_masked = statistics.median(cpu_times["plain"]), statistics.median(cpu_times["masked"])
    shape = (f"{p['layers']} layers, hidden {p['hidden']}, seq {p['seq']} x micro batch {p['batch']}, "
             f"{eods} EOD tokens ({args.device}, {args.dtype}, {torch.get_num_threads()} threads)")
    print("| shape | step without / with mask, wall (ms) | wall ratio | CPU time (ms) | CPU ratio "
          "| peak memory of a step without / with (MiB) | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {shape} | {1000 * plain:.1f} / {1000 * masked:.1f} | **{masked / plain:.3f}** | "
          f"{1000 * cpu_plain:.1f} / {1000 * cpu_masked:.1f} | **{cpu_masked / cpu_plain:.3f}** | "
          f"{memory['plain']:.1f} / {memory['masked']:.1f} | **{memory['masked'] / max(memory['plain'], 1e-9):.3f}** |")


if __name__ == "__main__":
    main()
