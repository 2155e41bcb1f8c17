"""Acceptance 1 of issue 10: a Hugging Face model imported with ``import-hf`` gives transformers'
logits (fp32, eager attention, <= 1e-5 relative) through the inference runner at (TP, PP) in
{(1,1), (2,1), (1,2), (2,2)}, for every family detail the import must get right:

* Llama with GQA, untied; Llama tied;
* Llama with ``llama3`` RoPE scaling, evaluated at positions beyond original_max_position_embeddings;
* Qwen2 with Q/K/V biases, tied, whose safetensors holds no ``lm_head.weight``;
* Mistral with an odd vocabulary size (and a sliding window shorter than the sequence);
* Llama-3.2-shaped (tied, llama3 RoPE scaling) and Mistral-Nemo-shaped (head size 16 with hidden 32 and 4
  heads: the query width is not the hidden size);
* Qwen3 with per-head query/key norms and a head size whose query width is not the hidden size, tied; and
  Qwen3 windowed in every layer (use_sliding_window, max_window_layers 0), untied;
* Gemma 3 with local and global layers (window 12 < the sequence), linear RoPE scaling on the global ones.

An odd TP (3, one stage) runs the four families of the model-families issue (Qwen3, Gemma 3, Llama-3.2- and
Nemo-shaped) built with 6 query and 3 key/value heads, vocabularies that 3 does not divide (padded).

Each layout is one spawned process group that runs every model (imported at that layout). A second
batch, left-padded with an attention mask and per-sample positions, is compared with transformers
given the same mask: the padded path of generation.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SEQ = 40          # > original_max_position_embeddings (16) of the llama3 model
TOL = 1e-5

_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


_ODD = dict(_COMMON, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3)


def _hf_models() -> dict[str, object]:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Gemma3TextConfig, Gemma3ForCausalLM
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama_gqa_untied": LlamaForCausalLM(LlamaConfig(vocab_size=96, tie_word_embeddings=False, **_COMMON)),
        "llama_tied": LlamaForCausalLM(LlamaConfig(vocab_size=96, tie_word_embeddings=True, **_COMMON)),
        "llama3_rope_scaling": LlamaForCausalLM(LlamaConfig(vocab_size=80, tie_word_embeddings=False,
                                                            rope_parameters=llama3, **_COMMON)),
        "qwen2_bias_tied": Qwen2ForCausalLM(Qwen2Config(vocab_size=90, tie_word_embeddings=True, **_COMMON)),
        "mistral_odd_vocab": MistralForCausalLM(MistralConfig(vocab_size=67, tie_word_embeddings=False,
                                                              sliding_window=24, **_COMMON)),
        # Llama-3.2's shape: tied, llama3 RoPE scaling; Mistral-Nemo's: head size (16) != hidden / heads (8)
        "llama32_tied_rope_scaling": LlamaForCausalLM(LlamaConfig(vocab_size=84, tie_word_embeddings=True,
                                                                  rope_parameters=llama3, **_COMMON)),
        "nemo_head_dim": MistralForCausalLM(MistralConfig(vocab_size=70, tie_word_embeddings=False, head_dim=16,
                                                          sliding_window=None, **_COMMON)),
        "qwen3_qknorm_tied": Qwen3ForCausalLM(Qwen3Config(vocab_size=88, tie_word_embeddings=True, head_dim=16,
                                                          **_COMMON)),
        "qwen3_window": Qwen3ForCausalLM(Qwen3Config(vocab_size=77, tie_word_embeddings=False, head_dim=8,
                                                     use_sliding_window=True, sliding_window=24,
                                                     max_window_layers=0, **_COMMON)),
        # local (window 12 < 40) and global layers, each with its RoPE, scale 1/sqrt(20), GeGLU, four (1 + w)
        # norms a layer, embeddings x sqrt(h), tied
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=86, head_dim=16, sliding_window=12, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **_COMMON)),
    }


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to 1 and biases to 0: perturb them so the mapping is checked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def _hf_models_odd_tp() -> dict[str, object]:
    """The new families and the shapes that already loaded, with heads that TP 3 divides."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM, Gemma3TextConfig, Gemma3ForCausalLM
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama32_tied_rope_scaling": LlamaForCausalLM(LlamaConfig(vocab_size=83, tie_word_embeddings=True,
                                                                  rope_parameters=llama3, **_ODD)),
        "nemo_head_dim": MistralForCausalLM(MistralConfig(vocab_size=71, tie_word_embeddings=False, head_dim=16,
                                                          sliding_window=None, **_ODD)),
        "qwen3_qknorm_tied": Qwen3ForCausalLM(Qwen3Config(vocab_size=89, tie_word_embeddings=True, head_dim=16,
                                                          **_ODD)),
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=85, head_dim=16, sliding_window=12, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **_ODD)),
    }


def _save(root, models: dict[str, object]) -> dict[str, str]:
    torch.manual_seed(0)
    out = {}
    for i, (name, model) in enumerate(models.items()):
        _perturb(model, i)
        model.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    out = _save(tmp_path_factory.mktemp("hf"), _hf_models())
    from safetensors import safe_open
    with safe_open(os.path.join(out["qwen2_bias_tied"], "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.layers.0.self_attn.q_proj.bias" in keys
    return out


def _inputs(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain tokens [2, SEQ], and a left-padded batch: lengths SEQ and SEQ - 13 (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=gen)
    padded = tokens.clone()
    padded[1, :13] = 0
    valid = torch.ones_like(padded, dtype=torch.bool)
    valid[1, :13] = False
    return tokens, valid


def _reference(path: str, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    padded = tokens.masked_fill(~valid, 0)
    with torch.no_grad():
        plain = model(input_ids=tokens).logits
        masked = model(input_ids=padded, attention_mask=valid.long(), position_ids=positions).logits
    return plain, masked


def _body(rank: int, world_size: int, tp: int, pp: int, cases: dict) -> dict:
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.inference.batching import attention_mask
    from megatron_ru.inference.runner import StageRunner
    from megatron_ru.parallel.state import ParallelState

    state = ParallelState.build(tp, pp)
    out = {}
    for name, (ckpt, tokens, valid) in cases.items():
        reader = read_checkpoint(ckpt)
        runner = StageRunner(reader.cfg, reader.vocab_size, state)
        runner.load(reader.get)
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        plain_pos = torch.arange(SEQ).expand(2, SEQ)
        with torch.no_grad():
            # causal masks: each windowed layer narrows them to its window (Gemma 3's global layers do not)
            plain = runner(tokens, plain_pos, attention_mask=attention_mask(torch.ones_like(valid), SEQ))
            masked = runner(tokens.masked_fill(~valid, 0), positions, attention_mask=attention_mask(valid, SEQ))
        if runner.is_last:
            out[name] = (plain, masked)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_imported_logits_equal_transformers(hf_dirs: dict[str, str], tmp_path, tp: int, pp: int) -> None:
    _check_layout(hf_dirs, tmp_path, tp, pp)


def test_imported_logits_equal_transformers_at_odd_tp(tmp_path) -> None:
    """TP 3: each rank 2 query heads and 1 key/value head, the vocabulary padded to a multiple of 3."""
    _check_layout(_save(tmp_path / "hf", _hf_models_odd_tp()), tmp_path, 3, 1)


def _check_layout(hf_dirs: dict[str, str], tmp_path, tp: int, pp: int) -> None:
    from megatron_ru.convert.import_hf import import_hf

    cases, refs = {}, {}
    for i, (name, path) in enumerate(hf_dirs.items()):
        ckpt = str(tmp_path / name)
        import_hf(path, ckpt, tp, pp)
        from transformers import AutoConfig
        tokens, valid = _inputs(AutoConfig.from_pretrained(path).vocab_size, seed=i)
        cases[name] = (ckpt, tokens, valid)
        refs[name] = _reference(path, tokens, valid)
    results = run_distributed(_body, tp * pp, args=(tp, pp, cases), timeout=240)
    last_stage = [r for r in results if r]
    assert len(last_stage) == tp
    for name, (ref_plain, ref_masked) in refs.items():
        for rank_out in last_stage:
            plain, masked = rank_out[name]
            assert plain.shape == ref_plain.shape, (name, plain.shape, ref_plain.shape)
            err = _rel(plain, ref_plain)
            assert err <= TOL, f"{name} at TP={tp} PP={pp}: logits differ from transformers by {err:.2e}"
            keep = cases[name][2]
            err = _rel(masked[keep], ref_masked[keep])
            assert err <= TOL, f"{name} at TP={tp} PP={pp}: left-padded logits differ by {err:.2e}"
        # every last-stage TP rank holds the same gathered logits
        assert all(torch.equal(r[name][0], last_stage[0][name][0]) for r in last_stage)
