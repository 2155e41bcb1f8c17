"""LoRA training step: megatron_ru's adapters vs full training of the same model vs peft + transformers
(the baseline users have today), same shape, same batch, one process, one run.

    .venv/bin/python benchmarks/lora_step.py                      # CPU preset (fp32)
    .venv/bin/python benchmarks/lora_step.py --preset 1b --dtype bf16   # on a GPU

Adapters: rank 32, alpha 32, dropout 0.05 on every projection (q, k, v, o, gate, up, down: peft's
usual target list, the recipe of docs/adaptation.md), AdamW over the trainable parameters only.
Steps of the contenders are interleaved (A B C A B C ...) so machine load affects them alike. Figures:
tokens/s of ours and of peft (ratio >= 1.0: ours no slower), and the optimizer state's bytes of LoRA
as a share of full training's (goal <= 5 %).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_ru.config.lora import LoraSpec
from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel

PRESETS = {  # layers, hidden, heads, query groups, ffn, vocab, seq, micro-batch
    "cpu": dict(layers=4, hidden=1024, heads=16, groups=8, ffn=2816, vocab=8000, seq=256, batch=1),
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=5504, vocab=32000, seq=2048, batch=4),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def our_model(p: dict, lora: bool, device: torch.device, dtype: torch.dtype) -> GPTModel:
    cfg = ModelConfig(num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"],
                      group_query_attention=True, num_query_groups=p["groups"], ffn_hidden_size=p["ffn"],
                      position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, make_vocab_size_divisible_by=128)
    if lora:
        cfg.lora = LoraSpec(rank=32, alpha=32, dropout=0.05, targets=TARGETS).to_dict()
    model = GPTModel(cfg, p["vocab"], device=device, dtype=dtype)
    if lora:
        for name, w in model.named_parameters():
            w.requires_grad_(".lora." in name)
    return model


def peft_model(p: dict, device: torch.device, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["groups"], max_position_embeddings=p["seq"], rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    hf = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype)
    return get_peft_model(hf, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS))


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim())


def make_step(model, tokens, labels, hf: bool):
    opt = torch.optim.AdamW([w for w in model.parameters() if w.requires_grad], lr=1e-4)

    def step() -> float:
        if hf:  # the loss users write for HF: logits -> fp32 cross-entropy over the same labels
            logits = model(input_ids=tokens).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        else:
            loss = model(tokens, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step, opt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per contender (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    p = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    tokens = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), device=device)
    labels = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), device=device)
    contenders = {"ours LoRA": (our_model(p, True, device, dtype), False),
                  "ours full": (our_model(p, False, device, dtype), False),
                  "peft + transformers LoRA": (peft_model(p, device, dtype), True)}
    steps, opts, trainable = {}, {}, {}
    for name, (model, hf) in contenders.items():
        model.train()
        steps[name], opts[name] = make_step(model, tokens, labels, hf)
        trainable[name] = sum(w.numel() for w in model.parameters() if w.requires_grad)
    times: dict[str, list[float]] = {n: [] for n in contenders}
    for i in range(args.steps + 2):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    tokens_per_step = p["batch"] * p["seq"]
    rows = {n: {"median_step_s": statistics.median(t), "spread_s": [min(t), max(t)],
                "tokens_per_s": tokens_per_step / statistics.median(t), "trainable_params": trainable[n],
                "optimizer_state_bytes": optimizer_bytes(opts[n])} for n, t in times.items()}
    out = {"preset": args.preset, "dtype": args.dtype, "device": str(device), "threads": torch.get_num_threads(),
           "rows": rows,
           "ours_vs_peft_tokens_per_s": rows["ours LoRA"]["tokens_per_s"] / rows["peft + transformers LoRA"][
               "tokens_per_s"],
           "lora_vs_full_step_time": rows["ours LoRA"]["median_step_s"] / rows["ours full"]["median_step_s"],
           "lora_optimizer_state_share": rows["ours LoRA"]["optimizer_state_bytes"] / rows["ours full"][
               "optimizer_state_bytes"]}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
