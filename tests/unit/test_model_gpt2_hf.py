"""The GPT-2-style configuration (learned positions, LayerNorm, GELU, biases, tied output) is
the GPT-2 architecture: with weights mapped from a tiny transformers GPT2LMHeadModel (exact
GELU), logits and gradients agree."""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel

VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS = 61, 32, 4, 2, 32


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])


def _per_head_qkv(t: torch.Tensor) -> torch.Tensor:
    """HF packs [q | k | v] on the output dim; ours packs per head [q_i, k_i, v_i]."""
    d = HIDDEN // HEADS
    q, k, v = (x.reshape(HEADS, d, *x.shape[1:]) for x in t.chunk(3, dim=0))
    return torch.stack([q, k, v], dim=1).reshape(t.shape)


def gpt2_to_ours(hf: GPT2LMHeadModel, padded_vocab: int) -> dict[str, torch.Tensor]:
    sd = hf.state_dict()           # HF Conv1D stores weights [in, out]: transpose to [out, in]
    out = {"embedding.word_embeddings.weight": _pad_rows(sd["transformer.wte.weight"], padded_vocab),
           "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
           "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
           "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"]}
    for i in range(LAYERS):
        p, o = f"transformer.h.{i}.", f"decoder.layers.{i}."
        out[o + "self_attention.linear_qkv.weight"] = _per_head_qkv(sd[p + "attn.c_attn.weight"].t())
        out[o + "self_attention.linear_qkv.bias"] = _per_head_qkv(sd[p + "attn.c_attn.bias"])
        for ours_name, hf_name in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                                   ("mlp.linear_fc2", "mlp.c_proj")):
            out[o + ours_name + ".weight"] = sd[p + hf_name + ".weight"].t()
            out[o + ours_name + ".bias"] = sd[p + hf_name + ".bias"]
        for ours_name, hf_name in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[o + ours_name + ".weight"] = sd[p + hf_name + ".weight"]
            out[o + ours_name + ".bias"] = sd[p + hf_name + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}


def test_gpt2_logits_and_grads_equal_transformers() -> None:
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS,
                                    n_head=HEADS, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, layer_norm_epsilon=1e-5, attn_implementation="eager"))
    with torch.no_grad():          # HF starts biases and norms at 0/1: perturb so the mapping is checked
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0,
                      make_vocab_size_divisible_by=16)
    ours = GPTModel(cfg, VOCAB, seed=1)
    ours.load_state_dict(gpt2_to_ours(hf, ours.padded_vocab_size), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 20))
    labels = torch.randint(0, VOCAB, (2, 20))
    ref = hf(input_ids=tokens).logits
    got = ours(tokens)
    err = float((got[..., :VOCAB] - ref).detach().abs().max() / ref.detach().abs().max())
    assert err <= 1e-5, f"logits differ from transformers GPT-2 by {err:.2e}"
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1))
    ref_loss.backward()
    ours(tokens, labels=labels).backward()
    ref_grad = hf.transformer.wte.weight.grad             # tied: input and output uses summed
    got_grad = ours.embedding.word_embeddings.weight.grad[:VOCAB]
    assert float((got_grad - ref_grad).abs().max() / ref_grad.abs().max()) <= 1e-5
    ref_fc = hf.transformer.h[1].mlp.c_fc.weight.grad.t()
    got_fc = ours.decoder.layers[1].mlp.linear_fc1.weight.grad
    assert float((got_fc - ref_fc).abs().max() / ref_fc.abs().max()) <= 1e-5
