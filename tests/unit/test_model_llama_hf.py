"""The LLaMA-style configuration is the LLaMA architecture: with weights mapped from a tiny
transformers LlamaForCausalLM, the logits agree to 1e-5."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 61, 64, 8, 2, 96, 3


def _configs(tied: bool) -> tuple[ModelConfig, LlamaConfig]:
    ours = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                       group_query_attention=True, num_query_groups=GROUPS, position_embedding_type="rope",
                       rotary_base=500000, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                       disable_bias_linear=True, untie_embeddings_and_output_weights=not tied,
                       hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=16)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
                     rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=tied, attention_bias=False,
                     mlp_bias=False, hidden_act="silu", attn_implementation="eager")
    return ours, hf


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])


def hf_to_ours(hf: LlamaForCausalLM, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Map HF LLaMA weights to our names; QKV packed per query group as [q_0..q_{r-1}, k, v]."""
    sd = hf.state_dict()
    d, r = HIDDEN // HEADS, HEADS // GROUPS
    out = {"embedding.word_embeddings.weight": _pad_rows(sd["model.embed_tokens.weight"], padded_vocab),
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and not hf.config.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(sd["lm_head.weight"], padded_vocab)
    for i in range(LAYERS):
        p, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].view(GROUPS, r * d, HIDDEN)
        k = sd[p + "self_attn.k_proj.weight"].view(GROUPS, d, HIDDEN)
        v = sd[p + "self_attn.v_proj.weight"].view(GROUPS, d, HIDDEN)
        out[o + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, HIDDEN)
        out[o + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[o + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[o + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[o + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[o + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_llama_logits_equal_transformers(tied: bool) -> None:
    torch.manual_seed(0)
    ours_cfg, hf_cfg = _configs(tied)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():   # HF initialises norms to 1; perturb them so the mapping is really checked
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ours = GPTModel(ours_cfg, VOCAB, seed=3).eval()
    missing, unexpected = ours.load_state_dict(hf_to_ours(hf, ours.padded_vocab_size), strict=True)
    assert not missing and not unexpected
    tokens = torch.randint(0, VOCAB, (2, 24))
    positions = torch.arange(5, 29).unsqueeze(0).expand(2, -1)     # offset positions exercise RoPE fully
    for pos in (None, positions):
        with torch.no_grad():
            ref = hf(input_ids=tokens, position_ids=pos).logits
            got = ours(tokens, position_ids=pos)
        assert got.shape == (2, 24, ours.padded_vocab_size)
        err = float((got[..., :VOCAB] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-5, f"logits differ from transformers by {err:.2e} (positions={pos is not None})"
        labels = torch.randint(0, VOCAB, (2, 24))
        ref_loss = F.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1))
        with torch.no_grad():
            got_loss = ours(tokens, labels=labels, position_ids=pos)
        assert abs(float(got_loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
