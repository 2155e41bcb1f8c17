#!/usr/bin/env python
"""Hugging Face import / export throughput and peak memory against safetensors alone.

    .venv/bin/python benchmarks/convert.py [--workdir DIR] [--layers 34] [--tp 2 --pp 2]

1. Generates a Llama-shaped bf16 model of >= 3 GiB (default: hidden 2048, FFN 5632, 34 layers,
   32 heads / 4 KV groups, vocabulary 32,000, untied: 1.63 B parameters, 3.26 GB = 3.04 GiB) as sharded
   safetensors (1 GB shards + index, random weights written with safetensors' save_file).
2. The I/O limit: every shard read with ``safetensors.torch.load_file`` and written again with
   ``save_file`` (+ fsync, as the tools do), i.e. the same tensors read and written once by
   safetensors alone.
3. ``tools/convert_checkpoint.py import-hf`` to TP x PP (default 2 x 2), then ``export-hf`` of that
   checkpoint back to safetensors (--max-shard-size 1GB), each checked bit-identical afterwards.

Each step runs in its own child process (the tools as a user runs them: interpreter start-up
and imports included), after ``sync`` and timed until a ``sync`` after it returns (its output on
disk); its wall time and peak RSS (``ru_maxrss`` from ``wait4``) are reported, with throughput =
model bytes / wall time. A round is limit, limit with new bytes (see ``step_limit_new``), import,
export; the figures are the medians over ``--rounds`` rounds of each step's ratio to the two limits
of the same round (the disk's speed drifts by 2-3x between runs here). Free disk space is checked first (~4x the model size at peak) and everything
is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 10**9


def llama_config(args: argparse.Namespace) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
            "hidden_size": args.hidden, "intermediate_size": args.ffn, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------- steps (each runs in a child process)
def step_generate(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    c = llama_config(args)
    shapes = tensor_shapes(c)
    shards, cur, size = [], [], 0
    for name, shape in shapes:
        n = 2 * _numel(shape)
        if cur and size + n > args.shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    os.makedirs(args.src)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shard}
        save_file(tensors, os.path.join(args.src, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in shard})
        del tensors
    total = sum(2 * _numel(s) for _, s in shapes)
    with open(os.path.join(args.src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(args.src, "config.json"), "w") as f:
        json.dump(c, f)


def _copy_shards(args: argparse.Namespace, change: bool) -> float:
    """Read every shard and write it again with safetensors alone (+ fsync); with ``change`` every
    byte is altered in between. Returns the seconds spent altering bytes."""
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(args.dst)
    modify = 0.0
    for name in sorted(os.listdir(args.src)):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(args.src, name))
            if change:
                t0 = time.perf_counter()
                tensors = {k: (v.view(torch.uint8) ^ 1).view(v.dtype) for k, v in tensors.items()}
                modify += time.perf_counter() - t0
            out = os.path.join(args.dst, name)
            save_file(tensors, out, metadata={"format": "pt"})
            del tensors
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return modify


def step_limit(args: argparse.Namespace) -> None:
    """Read every shard and write it again with safetensors alone (+ fsync)."""
    _copy_shards(args, change=False)


def step_limit_new(args: argparse.Namespace) -> None:
    """The same, writing new bytes: every tensor changed (one bit per byte) after reading, before writing.
    This VM's disk writes content it already holds ~3x faster than new content (measured with
    save_file alone: 2.3 s vs 7.8-8.3 s for these 3.26 GB); a byte-for-byte copy is the fast case,
    while a converter writes its tensors in new files and arrangements. The time spent changing the
    bytes is written to ``<dst>.modify`` and taken off the step's wall time."""
    modify = _copy_shards(args, change=True)
    with open(args.dst + ".modify", "w") as f:
        f.write(f"{modify}\n")


def step_verify(args: argparse.Namespace) -> None:
    """The export equals the generated model, tensor by tensor (bit for bit)."""
    import torch
    from megatron_ru.convert.hf_io import HFWeights
    a, b = HFWeights(args.src), HFWeights(args.dst)
    if sorted(a.names()) != sorted(b.names()):
        raise SystemExit(f"tensor names differ: {sorted(set(a.names()) ^ set(b.names()))[:5]}")
    for name in a.names():
        if not torch.equal(a.get(name), b.get(name)):
            raise SystemExit(f"tensor {name} differs after import + export")


STEPS = {"generate": step_generate, "limit": step_limit, "limit_new": step_limit_new, "verify": step_verify}


# ---------------------------------------------------------------- driver
def run_child(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in GB) of a child process."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MEGATRON_RU_LOG_LEVEL": "WARNING"}
    os.sync()  # every step starts with no dirty pages of an earlier step still to write back
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()  # ... and ends when its output is on disk (the checkpoint writer does not fsync its files)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"step failed (exit {proc.returncode}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024 / GB


def _self_step(args: argparse.Namespace, step: str, src: str, dst: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--step", step, "--src", src, "--dst", dst,
            "--layers", str(args.layers), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
            "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
            "--shard-bytes", str(args.shard_bytes)]


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-bytes", type=int, default=GB)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="limit, import, export repeated this many times")
    ap.add_argument("--step", choices=tuple(STEPS), help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        sys.path.insert(0, REPO)
        STEPS[args.step](args)
        return

    total = sum(2 * _numel(s) for _, s in tensor_shapes(llama_config(args)))
    work = args.workdir or f"/tmp/convert_bench_{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = 4 * total + GB
    if free < need:
        raise SystemExit(f"{work}: {free / GB:.1f} GB free, the benchmark needs {need / GB:.1f} GB "
                         "(source, limit copy, checkpoint, export); use --workdir elsewhere or fewer --layers")
    src, lim, ckpt, out = (os.path.join(work, n) for n in ("hf", "limit", "ckpt", "export"))
    print(f"model: {total / GB:.2f} GB bf16 ({total // 2 / 1e9:.2f} B parameters), {args.layers} layers, "
          f"hidden {args.hidden}; workdir {work} ({free / GB:.0f} GB free)", file=sys.stderr)
    results: dict = {"model_bytes": total, "tp": args.tp, "pp": args.pp, "load_before": os.getloadavg()[0],
                     "rounds": []}
    tool = [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py")]
    try:
        results["generate"] = run_child(_self_step(args, "generate", src, ""))
        for r in range(args.rounds):
            rnd = {"limit": run_child(_self_step(args, "limit", src, lim))}
            shutil.rmtree(lim)
            rnd["import"] = run_child(tool + ["import-hf", "--load", src, "--save", ckpt,
                                              "--target-tensor-parallel-size", str(args.tp),
                                              "--target-pipeline-parallel-size", str(args.pp)])
            wall, rss = run_child(_self_step(args, "limit_new", src, lim))
            with open(lim + ".modify") as f:
                rnd["limit_new"] = (wall - float(f.read()), rss)
            os.remove(lim + ".modify")
            shutil.rmtree(lim)
            rnd["export"] = run_child(tool + ["export-hf", "--load", ckpt, "--save", out, "--max-shard-size",
                                              str(args.shard_bytes)])
            if r == args.rounds - 1:
                run_child(_self_step(args, "verify", src, out))
                results["verified"] = True
            shutil.rmtree(ckpt)
            shutil.rmtree(out)
            results["rounds"].append(rnd)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[0]:.1f} s" for k, v in rnd.items()), file=sys.stderr)
    finally:
        for name in ("hf", "limit", "ckpt", "export"):
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()[0]
    print("| round | step | wall (s) | GB/s (model bytes) | vs limit (copy) | vs limit (new bytes) | peak RSS (GB) |",
          file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for r, rnd in enumerate(results["rounds"]):
        for step in ("limit", "limit_new", "import", "export"):
            wall, rss = rnd[step]
            print(f"| {r + 1} | {step} | {wall:.1f} | {total / wall / GB:.3f} | {rnd['limit'][0] / wall:.2f} | "
                  f"{rnd['limit_new'][0] / wall:.2f} | {rss:.2f} |", file=sys.stderr)
    for step in ("import", "export"):
        results[f"{step}_peak_rss_gb"] = max(rnd[step][1] for rnd in results["rounds"])
        for base in ("limit", "limit_new"):
            ratios = sorted(rnd[base][0] / rnd[step][0] for rnd in results["rounds"])
            results[f"{step}_vs_{base}_median"] = statistics.median(ratios)
            print(f"{step} vs {base}: median paired ratio {statistics.median(ratios):.2f} (min {ratios[0]:.2f}, "
                  f"max {ratios[-1]:.2f})", file=sys.stderr)
        print(f"{step}: peak RSS {results[f'{step}_peak_rss_gb']:.2f} GB", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
