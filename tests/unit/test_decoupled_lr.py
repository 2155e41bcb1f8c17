"""--decoupled-lr / --decoupled-min-lr (Megatron-LM's): the input word embedding and the output layer follow
the schedule's shape between their own peak and end; every other parameter keeps --lr / --min-lr. Checked
against the schedule written out by hand and against plain SGD updates computed from the gradients."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.config.lr_schedule import LRSchedule
from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel
from megatron_ru.model.spec import VOCAB_WEIGHTS, canonical_named_parameters
from megatron_ru.training.engine import build_optimizer
from megatron_ru.training.lr import DECOUPLED, MegatronLRScheduler, schedule_changes

VOCAB = 37


def _cosine(step, max_lr, min_lr, warmup=2, decay=10):
    if step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (decay - warmup))) * (max_lr - min_lr)


def test_decoupled_schedule_has_its_own_peak_and_end():
    s = LRSchedule(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, decay_style="cosine",
                   decoupled_lr=5e-3, decoupled_min_lr=2e-4)
    for step in range(13):
        assert s.lr(step) == pytest.approx(_cosine(step, 1e-3, 1e-4), rel=1e-12)
        assert s.decoupled().lr(step) == pytest.approx(_cosine(step, 5e-3, 2e-4), rel=1e-12)
    # Megatron-LM: without --decoupled-min-lr the end is --min-lr
    no_min = dataclasses.replace(s, decoupled_min_lr=None)
    assert no_min.decoupled().lr(10) == pytest.approx(1e-4) and no_min.decoupled().lr(2) == pytest.approx(5e-3)
    assert dataclasses.replace(s, decoupled_lr=None, decoupled_min_lr=None).decoupled().lr(2) == pytest.approx(1e-3)
    assert schedule_changes(s, dataclasses.replace(s, decoupled_lr=1e-2)) == ["--decoupled-lr 0.005 -> 0.01"]


def _model(tied: bool) -> tuple[GPTModel, ModelConfig]:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                      hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                      untie_embeddings_and_output_weights=not tied)
    return GPTModel(cfg, VOCAB, seed=3), cfg


@pytest.mark.parametrize("tied", [False, True])
def test_sgd_updates_follow_each_groups_learning_rate(tied):
    model, cfg = _model(tied)
    opt_cfg = SimpleNamespace(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, lr=1e-3, decoupled_lr=5e-3)
    opt = build_optimizer(model, opt_cfg, cfg)
    schedule = LRSchedule(max_lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, decay_style="cosine",
                          decoupled_lr=5e-3, decoupled_min_lr=2e-4)
    sched = MegatronLRScheduler(opt, schedule)
    named = list(canonical_named_parameters(model, cfg))
    decoupled_names = {n for n, p in named if any(p is q for g in opt.param_groups if g.get(DECOUPLED)
                                                  for q in g["params"])}
    # Megatron marks the word embedding and the output layer's weight (not the learned position table)
    assert decoupled_names == ({VOCAB_WEIGHTS[0]} if tied else set(VOCAB_WEIGHTS))
    assert "embedding.position_embeddings.weight" in {n for n, _ in named}
    g = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        tokens, labels = torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g)
        before = {n: p.detach().clone() for n, p in named}
        opt.zero_grad()
        model(tokens, labels=labels).backward()
        grads = {n: p.grad.detach().clone() for n, p in named}
        opt.step()
        sched.step()
        for n, p in named:  # lr(step - 1) applied at the step-th update
            lr = _cosine(step - 1, *((5e-3, 2e-4) if n in decoupled_names else (1e-3, 1e-4)))
            torch.testing.assert_close(p.detach(), before[n] - lr * grads[n], rtol=0, atol=1e-7)


def test_flag_validation():
    def problems(*extra):
        with pytest.raises(ValueError) as e:
            parse_arguments(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                             "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size",
                             "1", "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "64", "--lr", "1e-3", "--min-lr", "1e-4", *extra], world_size=1,
                            device_type="cpu")
        return str(e.value)
    assert "--decoupled-min-lr needs --decoupled-lr" in problems("--decoupled-min-lr", "1e-5")
    assert "must not exceed --decoupled-lr (5e-05)" in problems("--decoupled-lr", "5e-5")  # --min-lr 1e-4 above it
