"""--distribute-saved-activations (Megatron-DeepSpeed's --distribute-checkpointed-activations) at TP 2: every
recomputed chunk's input is kept as a half per rank and all-gathered in backward. The loss and every gradient
are bit for bit those of full recomputation without it and of no recomputation (dropout on: the generators are
replayed), and each rank keeps half the inputs (saved_tensors_hooks), as the planner predicts."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VOCAB, S, B = 50, 32, 2


def _body(rank: int, world_size: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model import GPTModel
    from megatron_ru.parallel.random import model_parallel_seed
    from megatron_ru.plan.activations import Runtime, stage_layer_bytes
    from megatron_ru.plan.layout import Layout
    from tests.integration.test_plan_activations import decoder_saved_bytes
    group = dist.new_group([0, 1])
    base = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                       max_position_embeddings=S, hidden_dropout=0.1, attention_dropout=0.1,
                       make_vocab_size_divisible_by=4)
    ways = {"none": base,
            "full": dataclasses.replace(base, recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=2),
            "distributed": dataclasses.replace(base, recompute_granularity="full", recompute_method="uniform",
                                               recompute_num_layers=2, distribute_saved_activations=True)}
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)
    out: dict = {}
    for name, cfg in ways.items():
        model = GPTModel(cfg, VOCAB, group, seed=3).train()
        model_parallel_seed(11, rank)
        loss = model(tokens, labels=labels)
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
        x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
        measured = decoder_saved_bytes(model, x)
        layout = Layout(2, 1, 1, B, B, S, recompute="none" if name == "none" else "full", recompute_method="uniform",
                        recompute_num_layers=2, distribute_saved_activations=name == "distributed", precision="fp32")
        predicted, _ = stage_layer_bytes(cfg, layout, Runtime.for_device("cpu", cfg), cfg.num_layers)
        out[name + "/bytes"] = (measured, predicted)
    loss, grads = out["none"]
    for name in ("full", "distributed"):
        assert torch.equal(out[name][0], loss), name
        for n in grads:
            assert torch.equal(out[name][1][n], grads[n]), (name, n)
    return {k: v for k, v in out.items() if k.endswith("/bytes")}


def test_distributed_inputs_are_halves_and_change_nothing():
    for rank_out in run_distributed(_body, 2, timeout=300):
        (full, full_pred), (dist_, dist_pred) = rank_out["full/bytes"], rank_out["distributed/bytes"]
        assert dist_ * 2 == full, (dist_, full)  # two chunk inputs, each half kept
        assert abs(full_pred - full) <= 0.15 * full and abs(dist_pred - dist_) <= 0.15 * dist_
        none, none_pred = rank_out["none/bytes"]
        assert full < none and abs(none_pred - none) <= 0.15 * none
