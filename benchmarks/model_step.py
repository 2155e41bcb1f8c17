"""Forward + backward + AdamW step: megatron_ru's LLaMA-style GPTModel vs transformers'
LlamaForCausalLM of the same shape on the same batch, in one process and the same run.

    .venv/bin/python benchmarks/model_step.py                     # CPU preset (fp32)
    .venv/bin/python benchmarks/model_step.py --preset 1b --dtype bf16   # on a GPU: TFLOP/s and MFU
    .venv/bin/python benchmarks/model_step.py --family gemma3     # another family: transformers' own class

``--family`` (qwen3, gemma3, llama32, nemo) builds transformers' model of that family at the preset's shape
(Qwen3 and Nemo: head size 64 with hidden 256 and 8 heads, a query width twice the hidden size; Gemma 3: three
local layers of window 128 < the sequence and one global, tied; Llama-3.2: tied, llama3 RoPE scaling) and ours
from its config.json (the import's mapping), so both are the same architecture by construction.

Steps of the two models are interleaved (A B A B ...) so machine load affects both alike;
the figure is the ratio of median step times, transformers / ours (>= 1.0: ours no slower).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro-batch
    "cpu": dict(layers=4, hidden=256, heads=8, groups=4, ffn=640, vocab=8000, seq=256, batch=4),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=2048, batch=4),
}
PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "V100": 125.0}


def build_models(p: dict, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                      group_query_attention=True, num_query_groups=p["groups"], ffn_hidden_size=p["ffn"],
                      position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, make_vocab_size_divisible_by=128)
    ours = GPTModel(cfg, p["vocab"], device=device, dtype=dtype)
    hf_cfg = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["groups"], max_position_embeddings=p["seq"], rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    hf = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype)
    return ours, hf


FAMILIES = ("qwen3", "gemma3", "llama32", "nemo")


def build_family(family: str, p: dict, device: torch.device, dtype: torch.dtype):
    """(ours, transformers') of ``family`` at preset ``p``: ours built from the Hugging Face config.json."""
    import transformers as tf

    from megatron_ru.convert.hf_mapping import model_config_from_hf
    common = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                  num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["groups"],
                  max_position_embeddings=p["seq"], rms_norm_eps=1e-5)
    wide = 2 * p["hidden"] // p["heads"]   # a head size whose query width is twice the hidden size
    if family == "qwen3":
        config, cls = tf.Qwen3Config(head_dim=wide, tie_word_embeddings=False, **common), tf.Qwen3ForCausalLM
    elif family == "gemma3":
        config = tf.Gemma3TextConfig(head_dim=wide, sliding_window=p["seq"] // 2, query_pre_attn_scalar=wide,
                                     layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * (p["layers"] // 4),
                                     tie_word_embeddings=True, **common)
        cls = tf.Gemma3ForCausalLM
    elif family == "llama32":
        config = tf.LlamaConfig(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": p["seq"] // 2}, **common)
        cls = tf.LlamaForCausalLM
    elif family == "nemo":
        config = tf.MistralConfig(head_dim=wide, sliding_window=None, tie_word_embeddings=False, **common)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    hf = cls(config).to(device=device, dtype=dtype)
    cfg, vocab = model_config_from_hf({**config.to_dict(), "architectures": [cls.__name__]})
    return GPTModel(cfg, vocab, device=device, dtype=dtype), hf


def step_fns(ours, hf, tokens, labels):
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    vocab = hf.config.vocab_size

    def ours_step() -> float:
        loss = ours(tokens, labels=labels)
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return float(loss.detach())

    def hf_step() -> float:
        # the loss users write for HF: logits -> fp32 cross-entropy over the same (already shifted) labels
        logits = hf(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return float(loss.detach())

    return ours_step, hf_step


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). On a shared CPU machine the CPU time is the
    steadier figure: it does not count time spent descheduled by other jobs."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def flops_per_step(p: dict) -> float:
    """Model FLOPs of fwd+bwd (3x forward): 6 x matmul params x tokens + causal-free attention
    scores/values 12 x layers x hidden x seq x tokens (the usual MFU convention)."""
    h, L, s, b, f, v = p["hidden"], p["layers"], p["seq"], p["batch"], p["ffn"], p["vocab"]
    kv = h // p["heads"] * p["groups"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f
    tokens = b * s
    return 6.0 * (L * per_layer + h * v) * tokens + 12.0 * L * h * s * tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--family", choices=("llama",) + FAMILIES, default="llama",
                    help="the architecture of both models (default: Llama, ours built from flags)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per model (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default by GPU name)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    p = PRESETS[args.preset]
    torch.manual_seed(0)
    ours, hf = build_models(p, device, dtype) if args.family == "llama" else build_family(args.family, p, device, dtype)
    tokens = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), device=device)
    labels = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), device=device)
    ours_step, hf_step = step_fns(ours, hf, tokens, labels)
    for _ in range(2):
        ours_step(), hf_step()
    t_ours, t_hf = [], []
    for _ in range(args.steps):
        t_ours.append(timed(ours_step, device))
        t_hf.append(timed(hf_step, device))
    m_ours, m_hf = (statistics.median(t[0] for t in ts) for ts in (t_ours, t_hf))
    c_ours, c_hf = (statistics.median(t[1] for t in ts) for ts in (t_ours, t_hf))
    tokens_per_step = p["batch"] * p["seq"]
    result = {"preset": args.preset, "family": args.family, "dtype": args.dtype, "device": str(device),
              "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "shape": p,
              "ours_s_per_step": round(m_ours, 4), "transformers_s_per_step": round(m_hf, 4),
              "ours_tokens_per_s": round(tokens_per_step / m_ours, 1),
              "transformers_tokens_per_s": round(tokens_per_step / m_hf, 1),
              "ratio_transformers_over_ours": round(m_hf / m_ours, 3),
              "ours_cpu_s_per_step": round(c_ours, 4), "transformers_cpu_s_per_step": round(c_hf, 4),
              "cpu_time_ratio_transformers_over_ours": round(c_hf / c_ours, 3)}
    if device.type == "cuda":
        tflops = flops_per_step(p) / m_ours / 1e12
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)
        result.update({"ours_tflops": round(tflops, 1), "peak_tflops": peak,
                       "ours_mfu": round(tflops / peak, 3) if peak else None,
                       "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
    print(f"wall: ours {m_ours * 1e3:.1f} ms/step, transformers {m_hf * 1e3:.1f} ms/step, "
          f"ratio (transformers/ours) {m_hf / m_ours:.3f}; CPU time: ours {c_ours * 1e3:.1f} ms, "
          f"transformers {c_hf * 1e3:.1f} ms, ratio {c_hf / c_ours:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
