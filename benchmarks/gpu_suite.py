"""The GPU suite: correctness on the device, the training-throughput matrix, fp16, and generation, in one
command that prints one table and writes ``suite.json`` and ``suite.md``.

    python3 benchmarks/gpu_suite.py --out DIR        # on one GPU (DIR default: $OUT)
    python3 benchmarks/gpu_suite.py --cpu-smoke      # the same code paths at tiny shapes on the CPU (make test)

Parts, each in its own process (a failure is reported in the table, the rest still runs):

* ``correctness``: the model's forward and backward on the device (fp32, TF32 off) against the CPU's; each
  fused path against its reference (``--torch-compile``'s layers and loss, fused AdamW against the for-loop);
  50 steps of bf16 training against fp32 (loss curves); the SDPA backends at the 1B attention shape.
* ``matrix-<shape>``: pretrain_gpt's real train step against the plain PyTorch loop and transformers (recipes
  in ``benchmarks/train_step.py``), interleaved, medians; at the 1B shape also the variants of ours that show
  what each change brought (the former defaults: eager, for-loop AdamW; eager with fused AdamW); the peers a user
  would pick instead (the plain loop and transformers under ``torch.compile``, transformers with liger-kernel's
  fused Llama kernels; ours over the fastest of them: "vs best peer") and ours with ``--fp8-format hybrid``, at
  the 1B and the 8B-layer shapes (on the CPU smoke at the first; liger, GPU only, says "skipped: needs CUDA").
  Shapes: the 1B preset at seq 2048 (micro batch 4) and 4096 (micro batch 2, the same tokens per step), and
  one TP = 1 slice of LLaMA-3-8B (hidden 4096, 32 heads, 8 query groups, FFN 14336, 4 layers, vocabulary
  128,256, seq 4096, micro batch 1); ours alone on one 32K-token sample of the 1B preset (what one GPU of a
  context-parallel group computes at 128K over CP 4). When the contenders' states would not fit in the GPU's memory together,
  each runs in its own process, one after the other (the table says so).
* ``fp16``: 100 steps of the 1B preset in fp16 with dynamic loss scaling against the same in bf16, steps
  interleaved, on a learnable corpus: the largest loss difference and the skipped steps.
* ``fp8``: 100 steps of the 1B preset with ``--fp8-format hybrid`` against the same in bf16, interleaved: the
  largest relative loss difference against the stated tolerance (2 x 2^-4, e4m3's rounding of two operands).
* ``memory``: the planner's predicted peak of ours at the 1B preset against a real run of it alone
  (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``; on the CPU the resident set's peak).
* ``generation``: greedy decoding of 8 prompts x 256 new tokens at the 1B shape with the library behind
  ``tools/generate.py`` against transformers' ``generate`` (KV cache both): tokens/s in bf16, and the tokens
  of both in fp32 compared.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.train_step import PRESETS, RECIPES  # noqa: E402

_1B = {k: v for k, v in PRESETS["1b"].items() if k != "accum"}  # train_step.py's 1B preset
SHAPES = {  # layers, hidden, heads, query groups, ffn, vocab (padded), seq, micro batch
    "1b-seq2048": _1B,
    "1b-seq4096": {**_1B, "seq": 4096, "batch": 2},
    "8b-layer-seq4096": dict(layers=4, hidden=4096, heads=32, groups=8, ffn=14336, vocab=128256, seq=4096,
                             batch=1),
    "1b-seq32768": {**_1B, "seq": 32768, "batch": 1},  # one long sample (context parallelism's per-GPU share)
}
SMOKE_SHAPES = {  # the same code paths at sizes two CPU cores run in seconds
    "1b-seq2048": dict(layers=2, hidden=64, heads=4, groups=2, ffn=160, vocab=512, seq=64, batch=2),
    "1b-seq4096": dict(layers=2, hidden=64, heads=4, groups=2, ffn=160, vocab=512, seq=128, batch=1),
    "8b-layer-seq4096": dict(layers=2, hidden=128, heads=8, groups=2, ffn=352, vocab=1024, seq=128, batch=1),
    "1b-seq32768": dict(layers=2, hidden=64, heads=4, groups=2, ffn=160, vocab=512, seq=512, batch=1),
}
#: variants of ours: pretrain_gpt flags and shape changes. "ours" is what the headline figures use; the others
#: show what each change brought (ours-before: the former defaults) and what a larger micro batch gives.
OURS = {
    "ours": (("--torch-compile", "--adam-implementation", "fused"), {}),
    "ours-eager": (("--adam-implementation", "fused"), {}),
    "ours-before": (("--adam-implementation", "for-loop"), {}),
    "ours-ds-step": (("--torch-compile", "--adam-implementation", "fused"), {}),
    "ours-mb8": (("--torch-compile", "--adam-implementation", "fused"), {"batch": 8}),
    "ours-mb8-ga4": (("--torch-compile", "--adam-implementation", "fused"), {"batch": 8, "accum": 4}),
    "ours-fp8": (("--torch-compile", "--adam-implementation", "fused", "--fp8-format", "hybrid"), {}),
}
ABLATION = ("ours-eager", "ours-ds-step", "ours-before")
#: variants that run DeepSpeed's own bf16 optimizer loops (before install_batched_bf16_step)
DEEPSPEED_STEP = ("ours-ds-step", "ours-before")
BASELINES = ("plain", "transformers")
#: the peers a user would pick instead of ours, at the same micro batch and accumulation: the plain loop and
#: transformers under torch.compile, transformers with liger-kernel's fused Llama kernels
PEERS = ("plain-compile", "transformers-compile", "transformers-liger")
STATE_BYTES = {"ours": 18, "ours-eager": 18, "ours-before": 18, "ours-mb8": 18, "ours-mb8-ga4": 18, "ours-ds-step": 18,
               "ours-fp8": 18, "plain": 16, "transformers": 16, "plain-compile": 16, "transformers-compile": 16,
               "transformers-liger": 16}
#: e4m3 rounds each operand to 3 mantissa bits (relative 2^-4): an FP8 loss is held to 2 x 2^-4 of bf16's
FP8_LOSS_RTOL = 2 * 2.0 ** -4


# ---- helpers shared by the parts ------------------------------------------------------------------------

def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _precision(smoke: bool) -> str:
    # bf16 on the GPU; fp32 on the CPU smoke run (DeepSpeed's bf16 optimizer is a GPU path)
    return "fp32" if smoke else "bf16"


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rel(a, b) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    import torch
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.abs().max().item()
    return float((a - b).abs().max().item() / scale) if scale else float((a - b).abs().max().item())


def _small_cfg(**over: Any):
    from megatron_ru.config.model import ModelConfig
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, group_query_attention=True,
                num_query_groups=4, ffn_hidden_size=704, position_embedding_type="rope", normalization="RMSNorm",
                swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=4096)
    base.update(over)
    return ModelConfig(**base)


@contextlib.contextmanager
def _no_tf32():
    import torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _fwd_bwd(model, tokens, labels, autocast_dtype=None):
    import torch
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(tokens.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with ctx:
        logits = model(tokens)
        loss = model.loss_fn(logits, labels)
    loss.backward()
    return logits.detach().float(), loss.detach().float(), {n: p.grad.detach().float().clone()
                                                            for n, p in model.named_parameters()}


def _grads_rel(a: dict, b: dict) -> float:
    return max(_rel(a[n], b[n]) for n in b)


# ---- correctness --------------------------------------------------------------------------------------

def part_correctness(smoke: bool, tmp: str) -> dict[str, Any]:
    import copy

    import torch

    from megatron_ru.model.compile import compile_model
    from megatron_ru.model.gpt import GPTModel
    device = _device()
    rows: list[dict[str, Any]] = []

    def row(check: str, value: float, tolerance: float, note: str = "") -> None:
        rows.append({"check": check, "value": value, "tolerance": tolerance, "pass": bool(value <= tolerance),
                     "note": note})

    seq, vocab = (32, 500) if smoke else (256, 8000)
    cfg = _small_cfg(num_layers=2, hidden_size=64 if smoke else 256, num_attention_heads=4 if smoke else 8,
                     num_query_groups=2 if smoke else 4, ffn_hidden_size=160 if smoke else 704)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)

    # 1. the device against the CPU, fp32, TF32 off
    with _no_tf32():
        cpu_model = GPTModel(cfg, vocab, seed=7)
        dev_model = GPTModel(cfg, vocab, seed=7, device=device)
        ref = _fwd_bwd(cpu_model, tokens, labels)
        got = _fwd_bwd(dev_model, tokens.to(device), labels.to(device))
        row(f"{device.type} vs CPU fp32: logits", _rel(got[0], ref[0]), 1e-5)
        row(f"{device.type} vs CPU fp32: loss", _rel(got[1], ref[1]), 1e-5)
        row(f"{device.type} vs CPU fp32: gradients (worst tensor)", _grads_rel(got[2], ref[2]), 1e-5)

        # 2. --torch-compile (layers + loss) against eager, fp32
        compiled = copy.deepcopy(dev_model)
        compile_model(compiled)
        eager = _fwd_bwd(dev_model, tokens.to(device), labels.to(device))
        fused = _fwd_bwd(compiled, tokens.to(device), labels.to(device))
        row("--torch-compile vs eager fp32: loss", _rel(fused[1], eager[1]), 1e-5)
        row("--torch-compile vs eager fp32: gradients (worst tensor)", _grads_rel(fused[2], eager[2]), 1e-5)

    # 3. in bf16 the fused path is no less accurate than eager bf16 (both against fp32)
    if device.type == "cuda":
        dtype = torch.bfloat16
        e16 = copy.deepcopy(dev_model).to(dtype)
        c16 = copy.deepcopy(dev_model).to(dtype)
        compile_model(c16)
        t, lab = tokens.to(device), labels.to(device)
        ref32 = _fwd_bwd(dev_model, t, lab)
        err_e = _grads_rel(_fwd_bwd(e16, t, lab)[2], ref32[2])
        err_c = _grads_rel(_fwd_bwd(c16, t, lab)[2], ref32[2])
        row("--torch-compile bf16 gradient error / eager bf16 error (both vs fp32)", err_c / err_e, 1.5,
            f"eager bf16 error {err_e:.2e}, compiled {err_c:.2e}")

    # 4. fused AdamW against the for-loop reference, fp32, 3 steps on the same gradients
    params = [torch.randn(1000, 64, generator=g).to(device) for _ in range(3)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for kw in ({"foreach": False}, {"fused": True}):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **kw)
        for _ in range(3):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
        results.append(ps)
    row("fused AdamW vs for-loop AdamW (3 steps, fp32)",
        max(_rel(a, b) for a, b in zip(results[1], results[0])), 1e-6)

    # 5. 50 training steps: bf16 against fp32 (pretrain_gpt's trainer, learnable corpus); CPU smoke: 5 fp32 steps
    from benchmarks.train_step import build_trainer, make_corpus
    p = dict(layers=4, hidden=512, heads=8, groups=4, ffn=1408, vocab=8064, seq=512, batch=8)
    iters = 50
    if smoke:
        p, iters = dict(layers=2, hidden=64, heads=4, groups=2, ffn=160, vocab=512, seq=32, batch=2), 5
    prefix = make_corpus(tmp, p["vocab"], (iters + 2) * p["batch"] * (p["seq"] + 1) * 2, structured=True)
    extra = ("--lr", "3e-4", "--lr-warmup-iters", "5", "--seed", "5")
    curves = {}
    precisions = ("fp32",) if smoke else ("fp32", "bf16")
    for prec in precisions:
        with _no_tf32():
            _, trainer = build_trainer(p, prefix, os.path.join(tmp, "cache"), iters, prec,
                                       0 if prec == "fp32" else 1, extra)
            curves[prec] = [trainer.train_step() for _ in range(iters)]
        del trainer
    if "bf16" in curves:
        diffs = [abs(a - b) for a, b in zip(curves["bf16"], curves["fp32"])]
        row("bf16 vs fp32 training, 50 steps: max |loss difference| (nats)", max(diffs), 0.05,
            f"fp32 loss {curves['fp32'][0]:.3f} -> {curves['fp32'][-1]:.3f}, bf16 {curves['bf16'][-1]:.3f}")
    else:
        finite = all(v == v and abs(v) != float("inf") for v in curves["fp32"])
        row(f"training smoke: {iters} fp32 steps, non-finite losses", 0.0 if finite else 1.0, 0.0)
    out: dict[str, Any] = {"rows": rows, "curves": curves}
    if device.type == "cuda":
        out["sdpa"] = _sdpa_backends()
    return out


def _sdpa_backends() -> dict[str, Any]:
    """Forward + backward of SDPA at the 1B attention shape (b 4, 16 heads, 8 KV groups, s 2048, d 128, causal,
    bf16) with each backend forced, and the default choice (grouped keys/values, as the model calls it)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, kv, s, d = 4, 16, 8, 2048, 128
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out: dict[str, Any] = {}
    cases: dict[str, Callable[[], Any]] = {
        "default (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        cases[name + " (keys repeated)"] = run
    for name, fn in cases.items():
        try:
            times = []
            for i in range(8):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn().sum().backward()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            out[name] = round(statistics.median(times) * 1e3, 3)
        except Exception as e:  # noqa: BLE001 - a backend this build lacks is a finding, not a failure
            out[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return {"ms_fwd_bwd": out, "shape": "b 4, heads 16, kv groups 8, seq 2048, head dim 128, causal, bf16"}


# ---- the throughput matrix ----------------------------------------------------------------------------

def part_matrix(smoke: bool, tmp: str, shape: str, contenders: list[str], steps: int, warmup: int
                ) -> dict[str, Any]:
    import torch

    from benchmarks.train_step import NotHere, build_trainer, hf_step_fn, interleave, make_corpus, plain_step_fn
    from megatron_ru.model.flops import flops_per_token
    from megatron_ru.plan.hardware import device_peak_tflops
    from megatron_ru.training.pretrain import model_shape
    p = (SMOKE_SHAPES if smoke else SHAPES)[shape]
    precision = _precision(smoke)
    device = _device()
    total = warmup + steps
    most = max([p["batch"]] + [OURS[c][1].get("batch", 0) * OURS[c][1].get("accum", 1)
                               for c in contenders if c in OURS])
    prefix = make_corpus(tmp, p["vocab"], (total + 3) * most * (p["seq"] + 1) * 2)
    fns: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}
    args = None
    keep: list[Any] = []

    def build(name: str, make: Callable[[], Callable[[], None]]) -> None:
        try:  # a contender that cannot be built or stepped is reported; the others still run
            fn = make()
            fn()  # its first step (compilation included) before the timed rounds
            fns[name] = fn
        except NotHere as e:  # cannot run on this device (liger on a CPU): said so, not a failure
            skipped[name] = str(e)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"

    shapes = {name: {**p, **OURS[name][1]} if name in OURS else p for name in contenders}
    for name in contenders:
        if name in OURS:
            def make(name=name):
                nonlocal args
                args, trainer = build_trainer(shapes[name], prefix, os.path.join(tmp, "cache"), total + 2,
                                              precision, 0 if precision == "fp32" else 1, OURS[name][0])
                keep.append(trainer)
                if name in DEEPSPEED_STEP:  # back to the class's methods: DeepSpeed's loops
                    for attr in ("step", "update_hp_grads"):
                        vars(trainer.engine.optimizer).pop(attr, None)
                return trainer.train_step
            build(name, make)
    if args is None:  # the baselines alone (a process of their own): the model flags without an engine
        from benchmarks.train_step import pretrain_argv
        from megatron_ru.flags.arguments import parse_arguments
        args = parse_arguments(pretrain_argv(p, prefix, os.path.join(tmp, "cache"), total + 1, precision),
                               world_size=1)
    vocab = p["vocab"] - 1
    if "plain" in contenders:
        build("plain", lambda: plain_step_fn(p, args.model, vocab, device, precision))
    if "transformers" in contenders:
        build("transformers", lambda: hf_step_fn(p, p["vocab"], device, precision))
    # the peers' compile: inductor, as their users run them; the CPU smoke traces the same graphs with aot_eager
    # (dynamo and AOT autograd, what could fail on a GPU too; inductor's CPU code is not what a GPU runs)
    backend = "aot_eager" if smoke else "inductor"
    if "plain-compile" in contenders:
        build("plain-compile", lambda: plain_step_fn(p, args.model, vocab, device, precision, compiled=backend))
    if "transformers-compile" in contenders:
        build("transformers-compile", lambda: hf_step_fn(p, p["vocab"], device, precision, compiled=backend))
    if "transformers-liger" in contenders:
        build("transformers-liger", lambda: hf_step_fn(p, p["vocab"], device, precision, liger=True))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats = interleave(fns, warmup, steps, device) if fns else {}
    profile = None
    if device.type == "cuda" and "ours" in fns and shape == "1b-seq2048":
        try:
            profile = _profile(fns["ours"], device)
            profile["idle_causes"] = _idle_causes(fns["ours"])
            if "ours-ds-step" in fns:
                profile["idle_causes_ds_step"] = _idle_causes(fns["ours-ds-step"])
        except Exception as e:  # noqa: BLE001 - the figures above stand without it
            profile = {"error": f"{type(e).__name__}: {e}"}
    smoke_idle = _idle_causes(fns["ours"], kernel_cat="cpu_op", top=3) if smoke and "ours" in fns else None
    tokens = p["batch"] * p["seq"]
    flops = flops_per_token(model_shape(args, vocab)) * tokens
    peak = device_peak_tflops(precision, None)
    for name, st in stats.items():
        st["micro_batch"] = shapes[name]["batch"]
        st["grad_accum"] = shapes[name].get("accum", 1)
        scale = shapes[name]["batch"] * st["grad_accum"] / p["batch"]
        st["tokens_per_s"] = scale * tokens / st["median_s"]
        st["tflops"] = scale * flops / st["median_s"] / 1e12
        st["mfu"] = st["tflops"] / peak if peak else None
    return {"shape": shape, "dims": p, "precision": precision, "contenders": stats, "errors": errors,
            "skipped": skipped,
            "profile_of_ours": profile, "idle_causes_smoke": smoke_idle,
            "tokens_per_step": tokens,
            "flops_per_step": flops, "peak_tflops": peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


def _idle_causes(step: Callable[[], None], kernel_cat: str = "kernel", top: int = 15) -> dict[str, Any]:
    """Where the GPU waits for the host: one step traced with Python stacks; every gap between kernels
    is charged to the Python frames (of megatron_ru, DeepSpeed, benchmarks) and the aten op that launched
    the kernel after it. Profiling slows the host, so the gaps are larger than unprofiled; their ranking
    is the point. ``kernel_cat``: the trace category of the device's work ("cpu_op" exercises the code
    on a CPU)."""
    import bisect
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernel_cat == "kernel" else [])
    with profile(activities=acts, with_stack=True) as prof:
        step()
        _sync(_device())
    with tempfile.TemporaryDirectory(prefix="gpu_suite_trace_") as trace_dir:
        path = os.path.join(trace_dir, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == kernel_cat), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})}
    def per_thread(cat: str) -> dict[Any, tuple[list[float], list[dict]]]:
        out: dict[Any, list[dict]] = {}
        for e in events:
            if e.get("cat") == cat:
                out.setdefault(e.get("tid"), []).append(e)
        return {tid: ([e["ts"] for e in evs], evs) for tid, evs in
                ((tid, sorted(evs, key=lambda e: e["ts"])) for tid, evs in out.items())}

    ops, py = per_thread("cpu_op"), per_thread("python_function")
    py_by_id = {e["args"].get("Python id"): e for _, evs in py.values() for e in evs}
    ours = ("megatron_ru/", "deepspeed/", "benchmarks/")

    def enclosing(table, tid, t):
        starts, evs = table.get(tid, ([], []))
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(i - 5000, -1), -1):  # nested: the latest start that still spans t is the innermost
            if evs[j]["ts"] + evs[j]["dur"] >= t:
                return evs[j]
        return None

    def frames(tid, t) -> str:
        e, names = enclosing(py, tid, t), []
        while e is not None and len(names) < 3:
            if any(k in e["name"] for k in ours):
                names.append(e["name"].split("site-packages/")[-1][:80])
            e = py_by_id.get(e["args"].get("Python parent id"))
        return " < ".join(names) or ("(no Python frame: autograd or another thread)" if e is None
                                     else "(no frame of ours)")

    by_frames: dict[str, float] = {}
    by_op: dict[str, float] = {}
    total = 0.0
    for prev, k in zip(kernels, kernels[1:]):
        gap = k["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 5:  # µs: back to back
            continue
        total += gap
        launch = launches.get(k.get("args", {}).get("correlation"), k)
        t, tid = launch["ts"], launch.get("tid")
        key = frames(tid, t)
        by_frames[key] = by_frames.get(key, 0.0) + gap
        op = enclosing(ops, tid, t)
        by_op[op["name"] if op else "?"] = by_op.get(op["name"] if op else "?", 0.0) + gap
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0.0
    rank = lambda d: [(k, round(v / 1e3, 3)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"kernels": len(kernels), "span_ms": span / 1e3, "gaps_ms": total / 1e3,
            "gaps_by_python_frames_ms": rank(by_frames), "gaps_by_launching_op_ms": rank(by_op)}


def _profile(step: Callable[[], None], device, steps: int = 2) -> dict[str, Any]:
    """Where a step of ours spends its GPU time: torch.profiler over ``steps`` warmed-up steps; the kernel
    time against the wall time (the rest is the GPU waiting for the host) and the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall = time.perf_counter() - t0
    # kernels only: a user annotation (e.g. "Optimizer.step#AdamW.step") spans kernels already counted
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and "#" not in e.key]
    kernel_s = sum(e.self_device_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:25]
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "kernel_ms_per_step": 1e3 * kernel_s / steps,
            "gpu_idle_ms_per_step": 1e3 * (wall - kernel_s) / steps,
            "top_kernels_ms_per_step": [(e.key[:90], round(e.self_device_time_total / 1e3 / steps, 3), e.count // steps)
                                        for e in top]}


# ---- fp16 ---------------------------------------------------------------------------------------------

def part_fp16(smoke: bool, tmp: str, iters: int) -> dict[str, Any]:
    from benchmarks.train_step import build_trainer, make_corpus
    p = dict(SMOKE_SHAPES if smoke else SHAPES)["1b-seq2048"]
    prefix = make_corpus(tmp, p["vocab"], (iters + 2) * p["batch"] * (p["seq"] + 1) * 2, structured=True)
    extra = ("--lr", "1e-4", "--lr-warmup-iters", "10", "--initial-loss-scale", "65536", "--seed", "3",
             "--adam-implementation", "fused")
    precisions = ("fp32",) if smoke else ("bf16", "fp16")  # the CPU has no fp16 training path
    trainers = {prec: build_trainer(p, prefix, os.path.join(tmp, "cache"), iters, prec,
                                    0 if prec == "fp32" else 1, extra)[1] for prec in precisions}
    curves: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(iters):
        for prec, trainer in trainers.items():
            curves[prec].append(trainer.train_step())
    out: dict[str, Any] = {"iters": iters, "curves": curves,
                           "skipped_steps": {k: int(t.engine.skipped_steps) for k, t in trainers.items()}}
    if "fp16" in curves:
        diffs = [abs(a - b) for a, b in zip(curves["fp16"], curves["bf16"])]
        out.update(max_abs_diff=max(diffs), last10_mean_abs_diff=statistics.mean(diffs[-10:]),
                   final={k: v[-1] for k, v in curves.items()},
                   loss_scale=float(getattr(trainers["fp16"].engine.optimizer, "cur_scale", float("nan"))))
    return out


def part_fp8(smoke: bool, tmp: str, iters: int) -> dict[str, Any]:
    """``iters`` steps of the 1B preset with --fp8-format hybrid against the same in bf16 (fp32 on the CPU smoke,
    where FP8 is torchao's emulation), steps interleaved, on a learnable corpus: the loss curves and the largest
    relative difference against FP8_LOSS_RTOL."""
    from benchmarks.train_step import build_trainer, make_corpus
    p = dict(SMOKE_SHAPES if smoke else SHAPES)["1b-seq2048"]
    prefix = make_corpus(tmp, p["vocab"], (iters + 2) * p["batch"] * (p["seq"] + 1) * 2, structured=True)
    extra = ("--lr", "1e-4", "--lr-warmup-iters", "10", "--seed", "3", "--adam-implementation", "fused")
    precision = _precision(smoke)
    zero = 0 if precision == "fp32" else 1
    trainers = {name: build_trainer(p, prefix, os.path.join(tmp, "cache"), iters, precision, zero, extra + fp8)[1]
                for name, fp8 in ((precision, ()), ("fp8", ("--fp8-format", "hybrid")))}
    curves: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(iters):
        for name, trainer in trainers.items():
            curves[name].append(trainer.train_step())
    rel = [abs(a - b) / abs(b) for a, b in zip(curves["fp8"], curves[precision])]
    return {"iters": iters, "reference": precision, "curves": curves, "max_rel_diff": max(rel),
            "last10_mean_rel_diff": statistics.mean(rel[-10:]), "tolerance": FP8_LOSS_RTOL,
            "within": max(rel) <= FP8_LOSS_RTOL, "final": {k: v[-1] for k, v in curves.items()}}


def part_memory(smoke: bool, tmp: str, steps: int) -> dict[str, Any]:
    """The planner's predicted peak of ours at the 1B preset (seq 2048, micro batch 4, bf16, ZeRO 1) against the
    peak of a real run of it alone: on a GPU ``torch.cuda.max_memory_allocated`` (the tensors) and
    ``max_memory_reserved`` (with the caching allocator's slack) against the prediction without and with its
    fragmentation share (the CUDA context is not in either figure); on a CPU the resident set's high-water mark
    above the one before the run (benchmarks/plan_memory.py's measure) against the whole prediction."""
    import torch

    from benchmarks.context_memory import reset_resident_peak, resident_peak_above
    from benchmarks.train_step import build_trainer, make_corpus
    from megatron_ru.plan.api import predict_for_arguments
    from megatron_ru.plan.memory import CPU_PROCESS_BYTES, CUDA_CONTEXT_BYTES
    device = _device()
    p = dict(SMOKE_SHAPES if smoke else SHAPES)["1b-seq2048"]
    precision = _precision(smoke)
    prefix = make_corpus(tmp, p["vocab"], (steps + 3) * p["batch"] * (p["seq"] + 1) * 2)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its first construction imports torch's compiler

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        before = reset_resident_peak()
    args, trainer = build_trainer(p, prefix, os.path.join(tmp, "cache"), steps + 2, precision,
                                  0 if precision == "fp32" else 1)
    for _ in range(steps):
        trainer.train_step()
    _sync(device)
    pred = predict_for_arguments(args, device=device.type)
    out: dict[str, Any] = {"shape": "1b-seq2048", "precision": precision, "steps": steps, "layout": "TP1 PP1 DP1",
                           "micro_batch": p["batch"], "device": device.type, "predicted_bytes": pred.total_bytes,
                           "predicted_terms": pred.terms}
    if device.type == "cuda":
        fixed = CUDA_CONTEXT_BYTES
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        tensors = pred.total_bytes - pred.terms["allowance"]
        out.update(allocated_bytes=allocated, reserved_bytes=reserved, predicted_tensor_bytes=tensors,
                   predicted_without_context_bytes=pred.total_bytes - fixed,
                   allocated_over_predicted=allocated / tensors, reserved_over_predicted=reserved / (pred.total_bytes - fixed))
    else:
        measured = resident_peak_above(before)
        out.update(measured_bytes=measured, measured_over_predicted=measured / pred.total_bytes,
                   cpu_allowance_bytes=CPU_PROCESS_BYTES)
    return out


# ---- generation ---------------------------------------------------------------------------------------

def part_generation(smoke: bool, new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ru.convert.hf_mapping import model_config_from_hf, to_canonical
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.runner import StageRunner
    from megatron_ru.inference.sampling import SamplingParams
    from megatron_ru.parallel.env import init_distributed
    from megatron_ru.parallel.state import ParallelState
    p = (SMOKE_SHAPES if smoke else SHAPES)["1b-seq2048"]
    device = _device()
    init_distributed(None, 10)
    state = ParallelState.build(1, 1)
    hf_cfg = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["groups"], max_position_embeddings=p["seq"], rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa", bos_token_id=None,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        hf32 = LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    cfg, vocab = model_config_from_hf(hf_cfg.to_dict())
    hf_tensors = dict(hf32.state_dict())
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, p["vocab"], (8, 32), generator=g)
    greedy = SamplingParams(greedy=True)

    def ours_run(dtype):
        runner = StageRunner(cfg, vocab, state, device=device, dtype=dtype)
        runner.load(lambda name: to_canonical(name, hf_tensors, cfg))
        return runner, lambda: [c.token_ids for c in generate(runner, prompts.tolist(), max_new_tokens=new_tokens,
                                                              params=greedy, pad_id=0)]

    def hf_run(model):
        ids = prompts.to(device)
        return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                                      pad_token_id=0)[:, ids.shape[1]:].tolist()

    def timed_run(fn):
        fn()  # warm-up (kernels, caches)
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return out, time.perf_counter() - t0

    with _no_tf32():
        _, ours32 = ours_run(torch.float32)
        tokens_ours, _ = timed_run(ours32)
        tokens_hf, _ = timed_run(hf_run(hf32))
    same = sum(a == b for x, y in zip(tokens_ours, tokens_hf) for a, b in zip(x, y))
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens_ours, tokens_hf)]
    speed_dtype = torch.float32 if smoke else torch.bfloat16
    _, ours16 = ours_run(speed_dtype)
    hf16 = hf32.to(speed_dtype)
    _, t_ours = timed_run(ours16)
    _, t_hf = timed_run(hf_run(hf16))
    n = prompts.shape[0] * new_tokens
    return {"prompts": prompts.shape[0], "prompt_tokens": prompts.shape[1], "new_tokens": new_tokens,
            "fp32_same_tokens": same, "fp32_total_tokens": n, "fp32_first_difference_per_prompt": first_diff,
            "speed_dtype": str(speed_dtype).replace("torch.", ""),
            "ours_tokens_per_s": n / t_ours, "transformers_tokens_per_s": n / t_hf, "ratio": t_hf / t_ours}


# ---- the orchestrator ---------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
           else "cpu"}
    for mod in ("deepspeed", "transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent is a fact for the table
            out[mod] = "absent"
    if torch.cuda.is_available():
        out["gpu_memory_gib"] = f"{torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.1f}"
    return out


def _plan(smoke: bool, gpu_bytes: Optional[int], no_ablation: bool = False, only: Optional[set[str]] = None
          ) -> list[tuple[str, list[str], list[str]]]:
    """(part, worker arguments, contenders) in run order: the headline first, so that a cut-short run
    still has it. Contenders whose states would not fit together run in processes of their own."""
    # ours-ds-step next to ours: the A/B of the bf16 optimizer's loops runs interleaved in one process
    ablation = [] if no_ablation else ["ours-ds-step", *(a for a in ABLATION if a != "ours-ds-step")]
    first = ["ours", *ablation[:1], *BASELINES, *PEERS, "ours-fp8", "ours-mb8-ga4", *ablation[1:]]
    plans: list[tuple[str, list[str], list[str]]] = [("matrix-1b-seq2048", ["--shape", "1b-seq2048"], first)]
    # the peers and FP8 at the 8B-layer shape on a GPU (on the CPU smoke the 1B shape runs their code paths)
    plans.append(("matrix-8b-layer-seq4096", ["--shape", "8b-layer-seq4096"],
                  ["ours", *BASELINES] + ([] if smoke else [*PEERS, "ours-fp8"])))
    plans.append(("fp8", [], []))
    plans.append(("fp16", [], []))
    plans.append(("matrix-1b-seq4096", ["--shape", "1b-seq4096"], ["ours", *BASELINES]))
    plans.append(("matrix-1b-seq32768", ["--shape", "1b-seq32768"], ["ours"]))
    plans.append(("memory", [], []))
    plans.append(("correctness", [], []))
    plans.append(("generation", [], []))
    out = []
    for part, argv, contenders in plans:
        if only and part.startswith("matrix"):
            contenders = [c for c in contenders if c in only]
            if not contenders:
                continue
        if part.startswith("matrix") and gpu_bytes and not smoke:
            p = SHAPES[argv[1]]
            params = p["layers"] * (p["hidden"] * (p["hidden"] + 2 * p["hidden"] // p["heads"] * p["groups"])
                                    + p["hidden"] ** 2 + 3 * p["hidden"] * p["ffn"]) + 2 * p["vocab"] * p["hidden"]
            states = sum(STATE_BYTES[c] for c in contenders) * params
            activations = 20 * 2 ** 30 * (p["batch"] * p["seq"] / 8192) * (p["hidden"] / 2048) * p["layers"] / 16
            activations += 12 * p["batch"] * p["seq"] * p["vocab"]  # fp32 logits and their gradient
            budget = 0.85 * gpu_bytes - activations
            if states > budget:  # pack the contenders into as few processes as fit, in order
                groups: list[list[str]] = [[]]
                for c in contenders:
                    if groups[-1] and sum(STATE_BYTES[x] for x in groups[-1] + [c]) * params > budget:
                        groups.append([])
                    groups[-1].append(c)
                for i, g in enumerate(groups):
                    out.append((f"{part}#{i}", argv, g))
                continue
        out.append((part, argv, contenders))
    return out


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"GPU suite, {results['started']} UTC, {results['versions'].get('device')}; "
             f"{', '.join(f'{k} {v}' for k, v in results['versions'].items() if k != 'device')}",
             f"Command: `{results['command']}`; wall time {results['wall_s']:.0f} s.", ""]
    matrix = {}
    for part, res in results["parts"].items():
        if part.startswith("matrix") and "contenders" in res:
            key = part.split("#")[0]
            m = matrix.setdefault(key, {"shape": res["shape"], "dims": res["dims"], "contenders": {},
                                        "split": "#" in part})
            m["contenders"].update(res["contenders"])
            m.setdefault("errors", {}).update(res.get("errors", {}))
            m.setdefault("skipped", {}).update(res.get("skipped", {}))
    if matrix:
        lines += ["| shape | contender | micro batch x accumulation | ms/step | tokens/s | TFLOP/s | MFU | vs plain | "
                  "vs transformers | vs best peer |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key, m in matrix.items():
            c = m["contenders"]
            peers = [c[k]["tokens_per_s"] for k in PEERS if k in c]
            for name, st in c.items():
                vp = (st["tokens_per_s"] / c["plain"]["tokens_per_s"]) if "plain" in c else None
                vt = (st["tokens_per_s"] / c["transformers"]["tokens_per_s"]) if "transformers" in c else None
                vb = st["tokens_per_s"] / max(peers) if peers and name not in PEERS else None
                mfu = f"{100 * st['mfu']:.1f} %" if st.get("mfu") is not None else "n/a"
                lines.append(f"| {m['shape']}{' (sequential)' if m['split'] else ''} | {name} | {st['micro_batch']} x {st.get('grad_accum', 1)} | "
                             f"{1e3 * st['median_s']:.1f} | {st['tokens_per_s']:,.0f} | {st['tflops']:.1f} | {mfu} | "
                             f"{'' if vp is None else f'{vp:.3f}'} | {'' if vt is None else f'{vt:.3f}'} | "
                             f"{'' if vb is None else f'{vb:.3f}'} |")
            for name, err in m.get("errors", {}).items():
                lines.append(f"| {m['shape']} | {name} | | **failed**: {err} | | | | | | |")
            for name, why in m.get("skipped", {}).items():
                lines.append(f"| {m['shape']} | {name} | | {why} | | | | | | |")
        prof = next((r.get("profile_of_ours") for r in results["parts"].values() if r.get("profile_of_ours")), None)
        if prof and "error" not in prof:
            lines += ["", f"Profile of ours (1b-seq2048, {prof['steps']} steps): {prof['wall_ms_per_step']:.1f} ms wall "
                          f"per step, {prof['kernel_ms_per_step']:.1f} ms of GPU kernels (the GPU waits "
                          f"{prof.get('gpu_idle_ms_per_step', 0.0):.1f} ms for the host); the largest: " + "; ".join(
                              f"{name} {ms} ms x{n}" for name, ms, n in prof["top_kernels_ms_per_step"][:8])]
            for key, label in (("idle_causes", "ours"), ("idle_causes_ds_step", "ours-ds-step")):
                idle = prof.get(key)
                if idle:
                    lines += ["", f"GPU idle of {label}, one step traced with Python stacks (slower host): "
                                  f"{idle['gaps_ms']:.1f} ms of gaps in {idle['span_ms']:.1f} ms, {idle['kernels']} "
                                  f"kernels; by the frames that launched the next kernel: " + "; ".join(
                                      f"{k} {v} ms" for k, v in idle["gaps_by_python_frames_ms"][:10])
                              + "; by launching op: " + "; ".join(
                                      f"{k} {v} ms" for k, v in idle["gaps_by_launching_op_ms"][:8])]
        lines += ["", "Recipes (all: the same tokens, bf16 compute, fp32 master weights and Adam state, clipping 1.0):"]
        lines += [f"- {name}: pretrain_gpt.py --bf16 --zero-stage 1 {' '.join(flags)}"
                  f"{' --micro-batch-size ' + str(shape['batch']) if shape else ''}"
                  f"{' --global-batch-size ' + str(shape['batch'] * shape['accum']) if 'accum' in shape else ''}; "
                  + RECIPES["pretrain_gpt"]
                  + ("; DeepSpeed's own per-parameter loops in the bf16 optimizer" if name in DEEPSPEED_STEP else "")
                  for name, (flags, shape) in OURS.items()]
        lines += [f"- plain: {RECIPES['plain_torch']}", f"- transformers: {RECIPES['transformers']}",
                  "- plain-compile, transformers-compile: the same, the model through torch.compile (inductor; the CPU "
                  "smoke traces with aot_eager)",
                  "- transformers-liger: transformers with liger-kernel's Llama kernels (RMSNorm, SwiGLU, RoPE, fused "
                  f"linear cross-entropy: no logits materialised); vs best peer: ours over the fastest of "
                  f"{', '.join(PEERS)} at the same micro batch and accumulation",
                  "MFU: model FLOPs (6 x matmul parameters x tokens + 12 x layers x hidden x seq x tokens, "
                  "megatron_ru/model/flops.py) against the dense bf16 peak (989 TFLOP/s for H100/H200).", ""]
    corr = results["parts"].get("correctness", {})
    if "rows" in corr:
        lines += ["| correctness check | value | tolerance | pass |", "|---|---|---|---|"]
        for r in corr["rows"]:
            lines.append(f"| {r['check']}{(' (' + r['note'] + ')') if r['note'] else ''} | {r['value']:.3g} | "
                         f"{r['tolerance']:g} | {'yes' if r['pass'] else '**no**'} |")
        lines.append("")
        if "sdpa" in corr:
            lines.append("SDPA fwd+bwd ms (" + corr["sdpa"]["shape"] + "): " + "; ".join(
                f"{k} {v}" for k, v in corr["sdpa"]["ms_fwd_bwd"].items()))
            lines.append("")
    fp16 = results["parts"].get("fp16", {})
    if "max_abs_diff" in fp16:
        lines += [f"fp16 vs bf16, {fp16['iters']} steps of the 1B preset: max |loss difference| "
                  f"{fp16['max_abs_diff']:.4f} nats, mean over the last 10 {fp16['last10_mean_abs_diff']:.4f}; "
                  f"final loss bf16 {fp16['final']['bf16']:.4f}, fp16 {fp16['final']['fp16']:.4f}; skipped steps "
                  f"{fp16['skipped_steps']}; final loss scale {fp16['loss_scale']:g}", ""]
    fp8 = results["parts"].get("fp8", {})
    if "max_rel_diff" in fp8:
        lines += [f"FP8 (--fp8-format hybrid, tensorwise) vs {fp8['reference']}, {fp8['iters']} steps of the 1B preset: "
                  f"max relative loss difference {fp8['max_rel_diff']:.4f} (tolerance {fp8['tolerance']:.4f}: "
                  f"{'held' if fp8['within'] else '**not held**'}), mean over the last 10 "
                  f"{fp8['last10_mean_rel_diff']:.4f}; final loss {fp8['reference']} "
                  f"{fp8['final'][fp8['reference']]:.4f}, fp8 {fp8['final']['fp8']:.4f}", ""]
    mem = results["parts"].get("memory", {})
    if "predicted_bytes" in mem:
        gib = 2 ** 30
        if mem["device"] == "cuda":
            lines += [f"Planner's memory, ours alone at {mem['shape']} (micro batch {mem['micro_batch']}, "
                      f"{mem['precision']}, ZeRO 1, {mem['steps']} steps): predicted {mem['predicted_bytes'] / gib:.2f} GiB "
                      f"({mem['predicted_tensor_bytes'] / gib:.2f} of tensors + the allowance); measured "
                      f"max_memory_allocated {mem['allocated_bytes'] / gib:.2f} GiB "
                      f"({mem['allocated_over_predicted']:.3f} of the tensors predicted), max_memory_reserved "
                      f"{mem['reserved_bytes'] / gib:.2f} GiB ({mem['reserved_over_predicted']:.3f} of the prediction "
                      f"without the CUDA context)", ""]
        else:
            lines += [f"Planner's memory, ours alone at the smoke shape ({mem['precision']}, {mem['steps']} steps, CPU): "
                      f"predicted {mem['predicted_bytes'] / 2 ** 20:.0f} MiB, resident set's peak above the start "
                      f"{mem['measured_bytes'] / 2 ** 20:.0f} MiB ({mem['measured_over_predicted']:.3f})", ""]
    gen = results["parts"].get("generation", {})
    if "ratio" in gen:
        lines += [f"Generation, {gen['prompts']} prompts x {gen['new_tokens']} new tokens, greedy, KV cache: ours "
                  f"{gen['ours_tokens_per_s']:,.0f} tokens/s, transformers {gen['transformers_tokens_per_s']:,.0f} "
                  f"({gen['speed_dtype']}; ours / transformers {gen['ratio']:.2f}); fp32 tokens equal "
                  f"{gen['fp32_same_tokens']} of {gen['fp32_total_tokens']}", ""]
    for part, res in results["parts"].items():
        if "error" in res:
            lines.append(f"**{part} failed**: {res['error']}")
    return "\n".join(lines) + "\n"


def _worker(opts: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _device().type == "cuda" else "cpu")
    part = opts.worker
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp:
        if part == "correctness":
            res = part_correctness(opts.cpu_smoke, tmp)
        elif part == "generation":
            res = part_generation(opts.cpu_smoke, 8 if opts.cpu_smoke else 256)
        elif part == "fp16":
            res = part_fp16(opts.cpu_smoke, tmp, 4 if opts.cpu_smoke else 100)
        elif part == "fp8":
            res = part_fp8(opts.cpu_smoke, tmp, 4 if opts.cpu_smoke else 100)
        elif part == "memory":
            res = part_memory(opts.cpu_smoke, tmp, 3)
        else:
            res = part_matrix(opts.cpu_smoke, tmp, opts.shape, opts.contenders.split(","), opts.steps, opts.warmup)
    with open(opts.json, "w") as f:
        json.dump(res, f)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for suite.json and suite.md "
                                                                 "(default: $OUT)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (make test)")
    ap.add_argument("--parts", default=None, help="comma-separated subset of parts (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 8; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; smoke 1)")
    ap.add_argument("--no-ablation", action="store_true",
                    help=f"leave out the variants of ours that only show what each change brought ({', '.join(ABLATION)})")
    ap.add_argument("--part-timeout", type=float, default=300, help="seconds before a part is stopped")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--contenders", help="comma-separated subset of the matrix's contenders (default: all)")
    ap.add_argument("--json", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.steps = opts.steps or (2 if opts.cpu_smoke else 8)
    opts.warmup = opts.warmup or (1 if opts.cpu_smoke else 2)
    if opts.worker:
        _worker(opts)
        return 0
    started = time.time()
    import torch
    if not opts.cpu_smoke and not torch.cuda.is_available():
        ap.error("no GPU here: run with --cpu-smoke for the CPU check of the suite's code paths")
    out_dir = opts.out or tempfile.mkdtemp(prefix="gpu_suite_out_")
    os.makedirs(out_dir, exist_ok=True)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    wanted = set(opts.parts.split(",")) if opts.parts else None
    results: dict[str, Any] = {"started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                               "command": " ".join(["python3", "benchmarks/gpu_suite.py", *(argv or sys.argv[1:])]),
                               "versions": _versions(), "parts": {}}
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               MEGATRON_RU_LOG_LEVEL=os.environ.get("MEGATRON_RU_LOG_LEVEL",
                                                                                           "WARNING"))
    failed = 0
    only = set(opts.contenders.split(",")) if opts.contenders else None
    for part, part_argv, contenders in _plan(opts.cpu_smoke, gpu_bytes, opts.no_ablation, only):
        if wanted and part.split("#")[0] not in wanted:
            continue
        with tempfile.TemporaryDirectory(prefix="gpu_suite_part_") as part_dir:
            path = os.path.join(part_dir, "result.json")
            worker = "matrix" if part.startswith("matrix") else part
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--json", path,
                   "--steps", str(opts.steps), "--warmup", str(opts.warmup), *part_argv]
            if contenders:
                cmd += ["--contenders", ",".join(contenders)]
            if opts.cpu_smoke:
                cmd.append("--cpu-smoke")
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.part_timeout)
                with open(os.path.join(out_dir, "parts.log"), "a") as log:
                    log.write(f"==== {part}: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
                if proc.returncode == 0 and os.path.exists(path):
                    with open(path) as f:
                        res = json.load(f)
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
                    res = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
            except subprocess.TimeoutExpired:
                res = {"error": f"stopped after {opts.part_timeout:.0f} s"}
        res["wall_s"] = time.time() - t0
        failed += "error" in res
        results["parts"][part] = res
        results["wall_s"] = time.time() - started
        _write(out_dir, results)  # after every part: a run cut short keeps what it measured
        print(f"[gpu_suite] {part}: {'FAILED ' + res['error'] if 'error' in res else 'done'} "
              f"({res['wall_s']:.0f} s)", flush=True)
    results["wall_s"] = time.time() - started
    _write(out_dir, results)
    failed += sum(not r["pass"] for r in results["parts"].get("correctness", {}).get("rows", []))
    print(_markdown(results), flush=True)
    print(f"[gpu_suite] wrote {out_dir}/suite.json and suite.md", flush=True)
    return 1 if failed else 0


def _write(out_dir: str, results: dict[str, Any]) -> None:
    for name, text in (("suite.json", json.dumps(results, indent=1)), ("suite.md", _markdown(results))):
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


if __name__ == "__main__":
    sys.exit(main())
