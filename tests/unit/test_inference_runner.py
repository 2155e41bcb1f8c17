"""The inference runner on one rank: the layers of the model description filled from canonical
tensors give GPTModel's logits (cut to the real vocabulary), and a checkpoint tensor of the wrong
shape is named."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.inference.runner import StageRunner
from megatron_ru.model import GPTModel
from megatron_ru.model.spec import canonical_named_parameters
from megatron_ru.parallel.topology import ParallelLayout

V = 37


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       disable_bias_linear=True, ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                       make_vocab_size_divisible_by=8, untie_embeddings_and_output_weights=not tied)


def single_rank_state() -> types.SimpleNamespace:
    """What StageRunner reads of a ParallelState, for TP = PP = 1 without a process group."""
    return types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, pp_ranks=[0],
                                 mp_group=None, mp_ranks=[0], layout=ParallelLayout(1, 1, 1),
                                 device=torch.device("cpu"))


def canonical_tensors(model: GPTModel, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full canonical tensors of a TP = 1 model (vocabulary matrices cut to V rows)."""
    out = {}
    for name, p in canonical_named_parameters(model, cfg):
        vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        out[name] = p.detach()[:V].clone() if vocab else p.detach().clone()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_runner_logits_equal_gpt_model(tied: bool) -> None:
    cfg = _cfg(tied)
    ref = GPTModel(cfg, V, seed=5).eval()
    runner = StageRunner(cfg, V, single_rank_state())
    tensors = canonical_tensors(ref, cfg)
    runner.load(tensors.__getitem__)
    assert sorted(runner.canonical_names()) == sorted(tensors)
    tokens = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        want = ref(tokens)[..., :V]
        got = runner(tokens)
        last = runner(tokens, last_only=True)
    assert got.shape == (2, 9, V) and got.dtype == torch.float32
    assert torch.equal(got, want)
    # the output layer on one position is a GEMM of another shape, which BLAS may block differently
    # (not bit-identical on every CPU: an AMD EPYC here differs in the last bits)
    torch.testing.assert_close(last, want[:, -1:], rtol=1e-6, atol=1e-6)


def test_wrong_shape_is_named() -> None:
    cfg = _cfg(False)
    tensors = canonical_tensors(GPTModel(cfg, V, seed=5), cfg)
    tensors["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(32, 63)
    runner = StageRunner(cfg, V, single_rank_state())
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.linear_fc2\.weight has shape \(32, 63\), "
                                         r"expected \(32, 64\)"):
        runner.load(tensors.__getitem__)


def test_layout_the_model_cannot_take_is_refused() -> None:
    state = single_rank_state()
    state.tp_size = 3
    with pytest.raises(ValueError, match="cannot run at this layout"):
        StageRunner(_cfg(False), V, state)


def test_forward_before_load_is_an_error() -> None:
    runner = StageRunner(_cfg(False), V, single_rank_state())
    with pytest.raises(RuntimeError, match=r"call load\(\) before running the model"):
        runner(torch.zeros(1, 3, dtype=torch.long))


def test_gpt2_style_batched_generation_equals_one_prompt_at_a_time() -> None:
    """Learned absolute positions, LayerNorm, biases, tied: left-padded prompts (per-sample positions
    into the position table) decode as each prompt alone, with and without the KV cache."""
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.sampling import SamplingParams
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=24,
                      hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                      init_method_std=0.2)
    runner = StageRunner(cfg, V, single_rank_state())
    runner.load(canonical_tensors(GPTModel(cfg, V, seed=9), cfg).__getitem__)
    prompts = [[3, 1, 4, 1, 5, 9], [2, 6], [5, 3, 5]]
    greedy = SamplingParams(greedy=True)
    batched = [c.token_ids for c in generate(runner, prompts, max_new_tokens=8, params=greedy, pad_id=0)]
    recomputed = [c.token_ids for c in generate(runner, prompts, max_new_tokens=8, params=greedy, use_cache=False)]
    alone = [generate(runner, [p], max_new_tokens=8, params=greedy)[0].token_ids for p in prompts]
    assert batched == recomputed == alone
    assert all(len(t) == 8 for t in batched)
    with pytest.raises(ValueError, match=r"exceeds the model's --max-position-embeddings \(24\)"):
        generate(runner, prompts, max_new_tokens=19, params=greedy)
