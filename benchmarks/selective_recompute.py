"""Activation recomputation: a training step with ``--recompute-granularity selective`` (the core attention
recomputed) and ``full`` (each layer recomputed) against no recomputation, same model, same tokens, one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/selective_recompute.py          # CPU preset, ~1 min
    .venv/bin/python benchmarks/selective_recompute.py --preset 1b --dtype bf16   # on a GPU

Three figures per variant, each as a ratio to no recomputation:
* step time: forward + loss + backward + AdamW, the variants interleaved (A B C A B C ...) after two warm-up
  rounds, medians;
* saved activations: the bytes of the distinct storages autograd keeps for backward during one forward
  (``saved_tensors_hooks``, parameters excluded) — exact and machine-independent;
* peak memory: each variant in its own child process over three steps: the process's peak RSS (model,
  optimizer and libraries included, so the ratio understates the activations' share) on a CPU,
  ``torch.cuda.max_memory_allocated`` on a GPU.
With attention dropout (the default here, as GPT-style models train) torch's CPU SDPA takes its math path,
which keeps the s x s scores: what selective recomputation removes. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel
from megatron_ru.parallel.random import model_parallel_seed

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro batch
    "cpu": dict(layers=4, hidden=256, heads=8, groups=4, ffn=640, vocab=8000, seq=1024, batch=2),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=4096, batch=2),
}
VARIANTS = ("none", "selective", "full")


def build(p: dict, variant: str, attention_dropout: float, device: torch.device, dtype: torch.dtype):
    cfg = ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                      group_query_attention=True, num_query_groups=p["groups"], ffn_hidden_size=p["ffn"],
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=attention_dropout, make_vocab_size_divisible_by=128,
                      max_position_embeddings=p["seq"])
    cfg = dataclasses.replace(cfg, recompute_granularity=None if variant == "none" else variant)
    model_parallel_seed(1234, 0)
    model = GPTModel(cfg, p["vocab"], device=device, dtype=dtype, seed=0).train()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), generator=gen).to(device)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step_fn(model, tokens, labels):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        loss = model(tokens, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def saved_bytes(model, tokens, labels) -> int:
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=labels)
    return sum(seen.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_child(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tokens, labels = build(PRESETS[args.preset], args.memory_child, args.attention_dropout, device, dtype)
    step = step_fn(model, tokens, labels)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        step()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else peak_rss_mib()
    print(json.dumps({"peak_mib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "bf16"))
    ap.add_argument("--attention-dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each variant (after 2 warm-up rounds)")
    ap.add_argument("--memory-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = "bfloat16" if args.dtype == "bf16" else args.dtype
    if args.memory_child:
        return memory_child(args)
    device, dtype, p = torch.device(args.device), getattr(torch, args.dtype), PRESETS[args.preset]
    # the children first: a child's peak RSS starts from its parent's at the fork, so the parent must be small
    peaks = {}
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--device", args.device, "--dtype",
                              args.dtype, "--attention-dropout", str(args.attention_dropout), "--memory-child", v],
                             check=True, capture_output=True, text=True).stdout
        peaks[v] = json.loads(out.strip().splitlines()[-1])["peak_mib"]
    built = {v: build(p, v, args.attention_dropout, device, dtype) for v in VARIANTS}
    saved = {v: saved_bytes(*built[v]) for v in VARIANTS}
    steps = {v: step_fn(*built[v]) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.steps + 2):
        for v, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            if i >= 2:
                times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    print(f"preset {args.preset} ({p}), {args.device} {args.dtype}, attention dropout {args.attention_dropout}, "
          f"{args.steps} timed steps each")
    print("| recomputation | step (ms) | step / none | saved activations (MiB) | / none | peak memory (MiB) | / none |")
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {1000 * med[v]:.0f} | {med[v] / med['none']:.2f} | {saved[v] / 2 ** 20:.1f} | "
              f"{saved[v] / saved['none']:.2f} | {peaks[v]:.0f} | {peaks[v] / peaks['none']:.2f} |")


if __name__ == "__main__":
    main()
