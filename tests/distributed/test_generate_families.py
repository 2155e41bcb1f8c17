"""Greedy generation of the families people adapt today equals transformers' ``generate`` token for token:
Qwen3 (query/key norms, head size != hidden / heads, tied), Gemma 3 (local sliding-window and global layers,
each with its RoPE; the KV cache of a local layer keeps only what its window sees), and the Llama-3.2
(tied, llama3 RoPE scaling) and Mistral-Nemo (head size != hidden / heads) shapes.

Each model is imported at TP 1 x PP 1 and at TP 2 x PP 2 and generates, with the KV cache, from a
left-padded batch of two prompts whose lengths plus the new tokens run past the window (8) several times.
transformers generates from the same batch (eager attention, fp32). A near-tie on the greedy path would
make the comparison meaningless: the smallest top-1/top-2 margin along transformers' path is checked first.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 33, 17, 8, 41, 3, 12, 44, 7], [12, 3, 30, 6]]   # 11 and 4 tokens, one batch
NEW = 20
PAD = 0
LAYOUTS = [(1, 1), (2, 2)]
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2)


def _hf_models() -> dict[str, object]:
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "qwen3": Qwen3ForCausalLM(Qwen3Config(vocab_size=64, tie_word_embeddings=True, head_dim=16, **_COMMON)),
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=64, head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **_COMMON)),
        "llama32": LlamaForCausalLM(LlamaConfig(vocab_size=64, tie_word_embeddings=True, rope_parameters=llama3,
                                                **_COMMON)),
        "nemo": MistralForCausalLM(MistralConfig(vocab_size=64, tie_word_embeddings=False, head_dim=16,
                                                 sliding_window=None, **_COMMON)),
    }


def _hf_greedy(model) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for PROMPTS (left-padded) and the smallest top-1/top-2 margin on the path."""
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True,
                             output_logits=True)
    tokens = [out.sequences[i, width:].tolist() for i in range(len(PROMPTS))]
    margin = min(float(step[i].topk(2).values.diff().abs()) for step in out.logits for i in range(len(PROMPTS)))
    return tokens, margin


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (Hugging Face directory, transformers' greedy tokens)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    out = {}
    for name, model in _hf_models().items():
        with torch.no_grad():   # norms start at 1 (or 0 for Gemma's 1 + w): move them so a lost one shows
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(str(root / name))
        ref = AutoModelForCausalLM.from_pretrained(str(root / name), attn_implementation="eager",
                                                   dtype=torch.float32).eval()
        tokens, margin = _hf_greedy(ref)
        assert margin > 1e-3, f"{name}: the greedy path has a near-tie ({margin:.2e}); pick another seed"
        out[name] = (str(root / name), tokens)
    return out


def _body(rank: int, world_size: int, tp: int, pp: int, ckpts: dict[str, str]) -> dict[str, list[list[int]]]:
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.runner import StageRunner
    from megatron_ru.inference.sampling import SamplingParams
    from megatron_ru.parallel.state import ParallelState

    state = ParallelState.build(tp, pp)
    out = {}
    for name, ckpt in ckpts.items():
        reader = read_checkpoint(ckpt)
        runner = StageRunner(reader.cfg, reader.vocab_size, state)
        runner.load(reader.get)
        done = generate(runner, PROMPTS, max_new_tokens=NEW, params=SamplingParams(greedy=True), pad_id=PAD)
        out[name] = [c.token_ids for c in done]
    return out


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_greedy_generation_equals_transformers(models, tmp_path, tp: int, pp: int) -> None:
    from megatron_ru.convert.import_hf import import_hf
    ckpts = {}
    for name, (hf_dir, _) in models.items():
        ckpts[name] = str(tmp_path / name)
        import_hf(hf_dir, ckpts[name], tp, pp)
    results = run_distributed(_body, tp * pp, args=(tp, pp, ckpts), timeout=240)
    for rank, got in enumerate(results):   # every rank holds the broadcast tokens
        for name, (_, want) in models.items():
            assert got[name] == want, f"{name} at TP {tp} x PP {pp}, rank {rank}: {got[name]} != {want}"
