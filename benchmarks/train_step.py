"""Training throughput of pretrain_gpt.py (one process) against two baselines, same run:

* plain PyTorch: the same GPTModel, the same micro batches, forward/backward, grad-norm clipping,
  torch AdamW step — no DeepSpeed, no data pipeline (our framework overhead; goal >= 0.9);
* transformers: LlamaForCausalLM of the same shape (RMSNorm, SwiGLU, RoPE, GQA, untied head) with
  torch AdamW on the same tokens (goal >= 1.0).

``pretrain_gpt.py``'s step is the real one: the trainer is built exactly as the script builds it
(config parsing, data pipeline over a generated corpus, DeepSpeed engine, LR schedule) and its
``train_step()`` (data loading + engine forward/backward/step) is timed. Steps of the three are
interleaved (A B C A B C ...) so machine load hits all alike; figures are medians.

    .venv/bin/python benchmarks/train_step.py                      # CPU preset, fp32
    .venv/bin/python benchmarks/train_step.py --preset 1b --bf16   # on a GPU: adds TFLOP/s and MFU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_step import timed  # noqa: E402  (wall + CPU seconds, CUDA-synchronised)

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro batch, grad accum
    "cpu": dict(layers=4, hidden=256, heads=8, groups=4, ffn=640, vocab=8064, seq=256, batch=4, accum=1),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=2048, batch=4, accum=1),
}


def make_corpus(directory: str, vocab: int, tokens: int) -> str:
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    prefix = os.path.join(directory, "bench_text_document")
    rng = np.random.RandomState(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    done = 0
    while done < tokens:
        n = int(rng.randint(200, 2000))
        builder.add_document(rng.randint(0, vocab - 1, n), [n])
        done += n
    builder.finalize(prefix + ".idx")
    return prefix


def pretrain_argv(p: dict, prefix: str, cache: str, iters: int, bf16: bool, zero_stage: int = 0) -> list[str]:
    argv = ["--num-layers", p["layers"], "--hidden-size", p["hidden"], "--num-attention-heads", p["heads"],
            "--group-query-attention", "--num-query-groups", p["groups"], "--ffn-hidden-size", p["ffn"],
            "--seq-length", p["seq"], "--max-position-embeddings", p["seq"], "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", p["batch"], "--global-batch-size", p["batch"] * p["accum"],
            "--train-iters", iters, "--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", p["vocab"] - 1,
            "--make-vocab-size-divisible-by", "128", "--data-path", prefix, "--data-cache-path", cache,
            "--split", "100,0,0", "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "0",
            "--log-interval", 10 ** 6, "--zero-stage", zero_stage]
    return [str(a) for a in argv] + (["--bf16"] if bf16 else [])


def baseline_steps(args, p: dict, device: torch.device, dtype: torch.dtype, padded: int):
    """The two baselines' step functions on one fixed batch of the benchmark's shape."""
    from megatron_ru.training.engine import optimizer_param_groups
    # plain PyTorch: the same model class and init, a batch of the same shape
    from megatron_ru.model.gpt import GPTModel
    plain = GPTModel(args.model, p["vocab"] - 1, seed=args.training.seed, device=device, dtype=dtype)
    plain_opt = torch.optim.AdamW(optimizer_param_groups(plain, args.optimizer.weight_decay), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, p["vocab"] - 1, (p["batch"], p["seq"] + 1), generator=g).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def plain_step() -> None:
        for _ in range(p["accum"]):
            loss = plain(inputs, labels=labels) / p["accum"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=padded, hidden_size=p["hidden"], intermediate_size=p["ffn"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], num_key_value_heads=p["groups"], max_position_embeddings=p["seq"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")).to(device=device, dtype=dtype)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def hf_step() -> None:
        for _ in range(p["accum"]):
            logits = hf(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().view(-1, padded), labels.reshape(-1)) / p["accum"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    return plain_step, hf_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=None,
                    help="pretrain_gpt's --zero-stage (default: 1 with --bf16, else 0; DeepSpeed refuses bf16 at "
                         "ZeRO 0: 'unsupported mix of model_dtype=bfloat16 and grad_accum_dtype=float32')")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", help="also write the results here")
    opts = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    p = PRESETS[opts.preset]
    total = opts.steps + opts.warmup
    tmp = tempfile.mkdtemp(prefix="train_step_")
    prefix = make_corpus(tmp, p["vocab"], (total + 2) * p["batch"] * p["accum"] * (p["seq"] + 1) * 2)

    from megatron_ru.config.arguments import parse_arguments
    from megatron_ru.training.metrics import device_peak_tflops, flops_per_token
    from megatron_ru.training.pretrain import model_shape, setup

    zero_stage = opts.zero_stage if opts.zero_stage is not None else (1 if opts.bf16 else 0)
    args = parse_arguments(pretrain_argv(p, prefix, os.path.join(tmp, "cache"), total + 1, opts.bf16, zero_stage),
                           world_size=1)
    trainer = setup(args)
    device = trainer.device
    dtype = torch.bfloat16 if opts.bf16 else torch.float32

    plain_step, hf_step = baseline_steps(args, p, device, dtype, trainer.engine.module.padded_vocab_size)

    def ours_step() -> None:
        trainer.train_step()

    names = ("pretrain_gpt", "plain_torch", "transformers")
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    fns = {"pretrain_gpt": ours_step, "plain_torch": plain_step, "transformers": hf_step}
    for i in range(total):
        for name, fn in fns.items():
            dt, dc = timed(fn, device)
            if i >= opts.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
    tokens_per_step = p["batch"] * p["accum"] * p["seq"]
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    flops = flops_per_token(model_shape(args, p["vocab"] - 1)) * tokens_per_step
    peak = device_peak_tflops("bf16" if opts.bf16 else "fp32", None)
    out = {"preset": opts.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "dtype": str(dtype), "zero_stage": zero_stage, "threads": torch.get_num_threads(), "median_step_s": med,
           "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()}, "tokens_per_sec": tps,
           "ratio_vs_plain_torch": tps["pretrain_gpt"] / tps["plain_torch"],
           "ratio_vs_transformers": tps["pretrain_gpt"] / tps["transformers"],
           "cpu_time_ratio_vs_plain_torch":
               statistics.median(cpu["plain_torch"]) / statistics.median(cpu["pretrain_gpt"]),
           "cpu_time_ratio_vs_transformers":
               statistics.median(cpu["transformers"]) / statistics.median(cpu["pretrain_gpt"]),
           "tflops_per_device": flops / med["pretrain_gpt"] / 1e12,
           "mfu": (flops / med["pretrain_gpt"] / 1e12 / peak) if peak else None,
           "load_average": os.getloadavg()[0]}
    print(json.dumps(out, indent=1))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
