"""Training throughput of pretrain_gpt.py (one process) against two baselines, same run:

* plain PyTorch: the same GPTModel, the same micro batches, the standard mixed-precision recipe —
  fp32 parameters under ``torch.autocast(bfloat16)``, torch ``AdamW(fused=True)``, grad-norm clipping —
  no DeepSpeed, no data pipeline (our framework overhead);
* transformers: LlamaForCausalLM of the same shape (RMSNorm, SwiGLU, RoPE, GQA, untied head, SDPA) with
  the same recipe on the same tokens.

Ours keeps the same numerics: bf16 weights and activations, fp32 master weights, fp32 gradient
accumulation and fp32 Adam state (DeepSpeed's bf16 optimizer). ``pretrain_gpt.py``'s step is the real
one: the trainer is built exactly as the script builds it (config parsing, data pipeline over a generated
corpus, DeepSpeed engine, LR schedule) and its ``train_step()`` (data loading + engine
forward/backward/step) is timed. Steps of the contenders are interleaved (A B C A B C ...) so machine
load hits all alike; figures are medians. ``benchmarks/gpu_suite.py`` runs this on a GPU for several
shapes and variants of ours.

    .venv/bin/python benchmarks/train_step.py                      # CPU preset, fp32
    .venv/bin/python benchmarks/train_step.py --preset 1b --bf16   # on a GPU: adds TFLOP/s and MFU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_step import timed  # noqa: E402  (wall + CPU seconds, CUDA-synchronised)

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro batch, grad accum
    "cpu": dict(layers=4, hidden=256, heads=8, groups=4, ffn=640, vocab=8064, seq=256, batch=4, accum=1),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=2048, batch=4, accum=1),
}

#: each contender's recipe, as the tables state it
RECIPES = {
    "pretrain_gpt": "DeepSpeed bf16 optimizer (ZeRO 1) under --bf16 (bf16 weights, fp32 masters + fp32 grad "
                    "accumulation), fp32 weights otherwise; torch AdamW(fused=True) as the baselines "
                    "(--adam-implementation fused unless --ours-flags names another)",
    "plain_torch": "same GPTModel, fp32 weights under torch.autocast(bf16), torch AdamW(fused=True)",
    "transformers": "LlamaForCausalLM (SDPA), fp32 weights under torch.autocast(bf16), torch AdamW(fused=True)",
}


def make_corpus(directory: str, vocab: int, tokens: int, structured: bool = False) -> str:
    """A ``.bin/.idx`` corpus of ``tokens`` ids in documents of 200-2000 tokens. ``structured``: 4096 of the
    ids occur, each followed by one of 4 fixed successors (probabilities 0.5/0.25/0.15/0.1), a text a model
    learns in tens of steps (loss falls from ln V towards ~1.2 nats), so that loss curves of two precisions
    can be compared."""
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    prefix = os.path.join(directory, "bench_text_document")
    rng = np.random.RandomState(0)
    active = min(vocab - 1, 4096)
    successors = rng.randint(0, active, (vocab, 4))
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    done = 0
    while done < tokens:
        n = int(rng.randint(200, 2000))
        if structured:
            choice = rng.choice(4, size=n, p=[0.5, 0.25, 0.15, 0.1])
            doc = np.empty(n, dtype=np.int64)
            doc[0] = rng.randint(0, active)
            for i in range(1, n):
                doc[i] = successors[doc[i - 1], choice[i]]
        else:
            doc = rng.randint(0, vocab - 1, n)
        builder.add_document(doc, [n])
        done += n
    builder.finalize(prefix + ".idx")
    return prefix


def pretrain_argv(p: dict, prefix: str, cache: str, iters: int, precision: str, zero_stage: int = 0,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """pretrain_gpt.py's flags for shape ``p``; ``precision`` is fp32, bf16 or fp16."""
    argv = ["--num-layers", p["layers"], "--hidden-size", p["hidden"], "--num-attention-heads", p["heads"],
            "--group-query-attention", "--num-query-groups", p["groups"], "--ffn-hidden-size", p["ffn"],
            "--seq-length", p["seq"], "--max-position-embeddings", p["seq"], "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", p["batch"], "--global-batch-size", p["batch"] * p.get("accum", 1),
            "--train-iters", iters, "--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", p["vocab"] - 1,
            "--make-vocab-size-divisible-by", "128", "--data-path", prefix, "--data-cache-path", cache,
            "--split", "100,0,0", "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "0",
            "--log-interval", 10 ** 6, "--zero-stage", zero_stage]
    flags = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}[precision]
    return [str(a) for a in argv] + flags + list(extra)


def build_trainer(p: dict, prefix: str, cache: str, iters: int, precision: str, zero_stage: int,
                  extra: tuple[str, ...] = ()):
    """pretrain_gpt.py's trainer, built as the script builds it."""
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.pretrain import setup
    args = parse_arguments(pretrain_argv(p, prefix, cache, iters, precision, zero_stage, extra), world_size=1)
    return args, setup(args)


def _adamw(params, fused_ok: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused_ok else {"foreach": True}))


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def plain_step_fn(p: dict, model_cfg, vocab: int, device: torch.device, precision: str, seed: int = 1234,
                  compiled: Optional[str] = None) -> Callable[[], None]:
    """The plain PyTorch loop over our GPTModel: fp32 weights, autocast, fused AdamW, clipping. ``compiled``: a
    ``torch.compile`` backend ("inductor"; the CPU smoke traces with "aot_eager") for the model's forward (loss
    included) as a whole, what a user of a plain loop would do."""
    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.training.engine import optimizer_param_groups
    model = GPTModel(model_cfg, vocab, seed=seed, device=device, dtype=torch.float32)
    opt = _adamw(optimizer_param_groups(model, 0.01), fused_ok=True)
    inputs, labels = fixed_batch(p, device)
    forward = torch.compile(model, backend=compiled) if compiled else model

    def step() -> None:
        for _ in range(p.get("accum", 1)):
            with _autocast(device, precision):
                loss = forward(inputs, labels=labels) / p.get("accum", 1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


class NotHere(RuntimeError):
    """A contender that cannot run on this device (liger-kernel on a CPU): reported as skipped, not failed."""


def liger_problem(device: torch.device) -> Optional[str]:
    """Why transformers + liger-kernel cannot run here (None: it can): its kernels are Triton's, GPU only."""
    if device.type != "cuda":
        return "skipped: needs CUDA (liger-kernel's kernels are Triton GPU kernels)"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        return f"skipped: liger-kernel does not import ({e}); pip install liger-kernel"
    return None


def hf_step_fn(p: dict, padded: int, device: torch.device, precision: str, compiled: Optional[str] = None,
               liger: bool = False) -> Callable[[], None]:
    """transformers' LlamaForCausalLM of the same shape with the same recipe. ``compiled``: the model through
    ``torch.compile`` with this backend; ``liger``: liger-kernel's Llama kernels (fused RMSNorm, SwiGLU, RoPE, and the linear
    cross-entropy that never materialises the logits: the loss from the model, on the same shifted labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if liger:
        problem = liger_problem(device)
        if problem:
            raise NotHere(problem)
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=padded, hidden_size=p["hidden"], intermediate_size=p["ffn"],
                      num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["groups"],
                      max_position_embeddings=p["seq"], rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(torch.float32)
    opt = _adamw(hf.parameters(), fused_ok=True)
    inputs, labels = fixed_batch(p, device)
    forward = torch.compile(hf, backend=compiled) if compiled else hf

    def step() -> None:
        for _ in range(p.get("accum", 1)):
            with _autocast(device, precision):
                if liger:  # the fused linear cross-entropy: labels already shifted, as ours
                    loss = forward(input_ids=inputs, shift_labels=labels).loss / p.get("accum", 1)
                else:
                    logits = forward(input_ids=inputs).logits
            if not liger:
                loss = F.cross_entropy(logits.float().view(-1, padded), labels.reshape(-1)) / p.get("accum", 1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def fixed_batch(p: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, p["vocab"] - 1, (p["batch"], p["seq"] + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def interleave(fns: dict[str, Callable[[], None]], warmup: int, steps: int, device: torch.device
               ) -> dict[str, dict[str, float]]:
    """Run the step functions round-robin; per contender the median wall and CPU seconds of the timed
    rounds (the first ``warmup`` rounds, compilation included, are not timed)."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            dt, dc = timed(fn, device)
            if i >= warmup:
                times[name].append((dt, dc))
    return {k: {"median_s": statistics.median(t for t, _ in v), "median_cpu_s": statistics.median(c for _, c in v),
                "min_s": min(t for t, _ in v), "max_s": max(t for t, _ in v)} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=None,
                    help="pretrain_gpt's --zero-stage (default: 1 with --bf16, else 0; DeepSpeed refuses bf16 at "
                         "ZeRO 0: 'unsupported mix of model_dtype=bfloat16 and grad_accum_dtype=float32')")
    ap.add_argument("--ours-flags", default="", help="extra pretrain_gpt flags, e.g. '--torch-compile'")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", help="also write the results here")
    opts = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    p = PRESETS[opts.preset]
    precision = "bf16" if opts.bf16 else "fp32"
    total = opts.steps + opts.warmup
    tmp = tempfile.mkdtemp(prefix="train_step_")
    prefix = make_corpus(tmp, p["vocab"], (total + 2) * p["batch"] * p["accum"] * (p["seq"] + 1) * 2)

    from megatron_ru.model.flops import flops_per_token
    from megatron_ru.plan.hardware import device_peak_tflops
    from megatron_ru.training.pretrain import model_shape

    zero_stage = opts.zero_stage if opts.zero_stage is not None else (1 if opts.bf16 else 0)
    ours_flags = opts.ours_flags.split()
    if "--adam-implementation" not in ours_flags:
        # the baselines' optimizer kernel, so that the ratio is the trainer's overhead (on a CPU ours defaults
        # to the for-loop, the kernel whose result does not depend on how a tensor is sharded)
        ours_flags += ["--adam-implementation", "fused"]
    args, trainer = build_trainer(p, prefix, os.path.join(tmp, "cache"), total + 1, precision, zero_stage,
                                  tuple(ours_flags))
    device = trainer.device
    padded = trainer.engine.module.padded_vocab_size
    fns = {"pretrain_gpt": trainer.train_step,
           "plain_torch": plain_step_fn(p, args.model, p["vocab"] - 1, device, precision),
           "transformers": hf_step_fn(p, padded, device, precision)}
    stats = interleave(fns, opts.warmup, opts.steps, device)
    tokens_per_step = p["batch"] * p["accum"] * p["seq"]
    med = {k: v["median_s"] for k, v in stats.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    flops = flops_per_token(model_shape(args, p["vocab"] - 1)) * tokens_per_step
    peak = device_peak_tflops(precision, None)
    out = {"preset": opts.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "precision": precision, "zero_stage": zero_stage, "ours_flags": " ".join(ours_flags), "recipes": RECIPES,
           "threads": torch.get_num_threads(), "median_step_s": med,
           "median_step_cpu_s": {k: v["median_cpu_s"] for k, v in stats.items()}, "tokens_per_sec": tps,
           "ratio_vs_plain_torch": tps["pretrain_gpt"] / tps["plain_torch"],
           "ratio_vs_transformers": tps["pretrain_gpt"] / tps["transformers"],
           "tflops_per_device": flops / med["pretrain_gpt"] / 1e12,
           "mfu": (flops / med["pretrain_gpt"] / 1e12 / peak) if peak else None,
           "load_average": os.getloadavg()[0]}
    print(json.dumps(out, indent=1))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
