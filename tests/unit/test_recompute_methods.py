"""Megatron's --recompute-method uniform|block with --recompute-num-layers (full recomputation in chunks of N
layers, or only the first N layers of a stage): the same losses and gradients as no recomputation, bit for bit
in fp32 with dropout (the forward draws in the same order; a recomputation replays them), and what the layers
keep for backward, measured with saved_tensors_hooks, as the planner predicts (plan/activations.py).
--distribute-saved-activations at TP 2 is in tests/integration/test_train_layouts.py (4 ranks) and
tests/distributed (2 ranks)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel
from megatron_ru.parallel.random import model_parallel_seed
from megatron_ru.plan.activations import Runtime, stage_layer_bytes
from megatron_ru.plan.layout import Layout
from tests.integration.test_plan_activations import decoder_saved_bytes

VOCAB, S, B = 50, 32, 2
CFG = ModelConfig(num_layers=5, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, max_position_embeddings=S,
                  hidden_dropout=0.1, attention_dropout=0.1, make_vocab_size_divisible_by=8)
WAYS = [("uniform", 1), ("uniform", 2), ("uniform", 5), ("block", 2), ("block", 0)]


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)


def _run(cfg: ModelConfig):
    model = GPTModel(cfg, VOCAB, seed=3).train()
    tokens, labels = _batch()
    model_parallel_seed(11, 0)
    loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _full(method: str, n: int) -> ModelConfig:
    return dataclasses.replace(CFG, recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


@pytest.mark.parametrize("method, n", WAYS)
def test_every_way_computes_what_no_recomputation_computes(method, n):
    loss, grads = _run(CFG)
    loss_r, grads_r = _run(_full(method, n))
    assert torch.equal(loss, loss_r)
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name


def test_roles_follow_megatron():
    def roles(method, n):
        return [layer.recompute_role for layer in GPTModel(_full(method, n), VOCAB).decoder.layers]
    assert roles("uniform", 2) == ["lead", "member", "lead", "member", "lead"]
    assert roles("uniform", 1) == ["alone"] * 5
    assert roles("block", 2) == ["alone", "alone", "none", "none", "none"]
    assert roles("block", 9) == ["alone"] * 5
    assert [layer.recompute_role for layer in GPTModel(CFG, VOCAB).decoder.layers] == ["none"] * 5


@pytest.mark.parametrize("method, n", WAYS)
def test_what_the_layers_keep_is_what_the_planner_says(method, n):
    cfg = _full(method, n)
    model = GPTModel(cfg, VOCAB, seed=3).train()
    x = torch.randn(S, B, cfg.hidden_size, requires_grad=True)
    model_parallel_seed(1, 0)
    measured = decoder_saved_bytes(model, x)
    layout = Layout(1, 1, 1, B, B, S, recompute="full", recompute_method=method, recompute_num_layers=n,
                    precision="fp32")
    predicted, _ = stage_layer_bytes(cfg, layout, Runtime.for_device("cpu", cfg), cfg.num_layers)
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_flags_are_checked():
    bad = dataclasses.replace(CFG, recompute_method="block")
    assert any("--recompute-method applies to --recompute-granularity full" in p for p in bad.problems())
    sel = dataclasses.replace(CFG, recompute_granularity="selective", distribute_saved_activations=True)
    assert any("--distribute-saved-activations applies to --recompute-granularity full (or --checkpoint-activations), not selective" in p
               for p in sel.problems())
    zero = dataclasses.replace(CFG, recompute_granularity="full", recompute_num_layers=0)
    assert any("--recompute-num-layers must be >= 1" in p for p in zero.problems())
    assert not dataclasses.replace(zero, recompute_method="block").problems()
