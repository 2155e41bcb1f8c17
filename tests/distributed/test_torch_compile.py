"""``--torch-compile``: the compiled transformer layers (and, at TP 1, the compiled loss) compute what the
eager reference computes, to fp32 rounding, at TP 1 and at TP 2 with sequence parallelism and full
recomputation (the tensor-parallel collectives run eagerly between compiled graphs); all layers share one
compiled graph."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOL = 1e-5
VOCAB = 50


def _cfg():
    from megatron_ru.config.model import ModelConfig
    return ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                       num_query_groups=4, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                       attention_dropout=0.0, make_vocab_size_divisible_by=4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(model, tokens, labels, group):
    from megatron_ru.parallel.utils import gather_full_tensor
    loss = model(tokens, labels=labels)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if not getattr(p, "tensor_model_parallel", False) else \
            gather_full_tensor(p.grad, group, p.partition_dim, p.partition_stride)
        padded = "word_embeddings" in name or "output_layer" in name
        grads[name] = g[:VOCAB] if padded else g  # the real vocabulary rows (padding differs with TP)
    return loss.detach(), grads


def _body(rank: int, world_size: int) -> dict:
    import torch._dynamo.utils as dynamo_utils

    from megatron_ru.model import GPTModel
    from megatron_ru.model.compile import compile_model
    group = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 16), generator=gen)
    ref_loss, ref_grads = _run(GPTModel(_cfg(), VOCAB, None, seed=7), tokens, labels, None)
    out: dict = {}
    dynamo_utils.counters.clear()
    compiled = GPTModel(_cfg(), VOCAB, None, seed=7)
    out["layers_compiled"] = compile_model(compiled)
    loss, grads = _run(compiled, tokens, labels, None)
    out["graphs_at_tp1"] = int(dynamo_utils.counters["stats"]["unique_graphs"])
    out["tp1/loss"] = _rel(loss, ref_loss)
    out.update({f"tp1/grad/{n}": _rel(g, ref_grads[n]) for n, g in grads.items()})
    for sp, recompute in ((False, False), (True, True)):
        cfg = dataclasses.replace(_cfg(), recompute_granularity="full" if recompute else None)
        model = GPTModel(cfg, VOCAB, group, sequence_parallel=sp, seed=7)
        compile_model(model)
        loss, grads = _run(model, tokens, labels, group)
        key = f"tp2/sp={sp}/recompute={recompute}"
        out[f"{key}/loss"] = _rel(loss, ref_loss)
        out.update({f"{key}/grad/{n}": _rel(g, ref_grads[n]) for n, g in grads.items()})
    return out


def test_compiled_layers_equal_eager_at_tp1_and_tp2() -> None:
    per_rank = run_distributed(_body, world_size=2, timeout=600)
    for rank, res in enumerate(per_rank):
        assert res["layers_compiled"] == 3
        # one graph for the three layers and one for the loss: parameters are graph inputs
        assert res["graphs_at_tp1"] == 2, res["graphs_at_tp1"]
        checked = [k for k in res if "/grad/" in k]
        assert len(checked) == 3 * (3 * 6 + 3)  # every parameter, three runs
        for key, value in res.items():
            if key.startswith("tp"):
                assert value <= TOL, f"rank {rank}: {key} = {value:.3e} > {TOL}"
