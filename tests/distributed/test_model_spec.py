"""The one model description: GPTModel and the DeepSpeed pipeline stages hold exactly the parameters
of ``parameter_specs`` under their canonical names, with the shapes of their TP shards, at any
layout; the stage split is DeepSpeed's; each canonical parameter starts with the same values at
every layout (initialisation keyed by the canonical name)."""
from __future__ import annotations

import pytest
import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import GPTModel
from megatron_ru.model.spec import (canonical_name, canonical_named_parameters, local_name_of, model_description,
                                    parameter_specs)
from megatron_ru.model.shards import padded_vocab_rows
from megatron_ru.parallel.utils import shard_tensor
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 61


def _cfg(tied: bool, gpt2: bool = False) -> ModelConfig:
    if gpt2:
        return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                           untie_embeddings_and_output_weights=not tied, make_vocab_size_divisible_by=8)
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm",
                       swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=not tied,
                       make_vocab_size_divisible_by=8)


def _full_padded(spec, full: torch.Tensor, cfg: ModelConfig, tp: int) -> torch.Tensor:
    if not spec.vocab:
        return full
    rows = padded_vocab_rows(cfg, VOCAB, tp)
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


@pytest.mark.parametrize("tied,gpt2", [(False, False), (True, False), (True, True)])
def test_gpt_model_parameters_are_the_specs(tied, gpt2):
    cfg = _cfg(tied, gpt2)
    model = GPTModel(cfg, VOCAB)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    specs = parameter_specs(cfg, VOCAB)
    want = {s.name: tuple(_full_padded(s, torch.empty(s.shape), cfg, 1).shape) for s in specs}
    assert got == want
    assert [n for n, _ in model.named_parameters()] == [s.name for s in specs]  # model order
    descs = model_description(cfg)
    assert [d.index for d in descs] == list(range(cfg.num_layers + 3))
    assert descs[-1].tied_output == tied
    for s in specs:
        assert canonical_name(f"{s.layer_index}.{s.local_name}", cfg) == s.name
        assert local_name_of(s.name) == s.local_name


def _stage_body(rank, world_size, tp, pp, cfg_args):
    import deepspeed

    from megatron_ru.deepspeed_bridge.pipeline import pipeline_module
    from megatron_ru.model.gpt import GPTLoss, pipeline_layers
    from megatron_ru.model.spec import stage_bounds
    from megatron_ru.parallel.state import ParallelState
    from megatron_ru.deepspeed_bridge.compat import disable_cpu_shm_comm
    disable_cpu_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
    cfg = _cfg(*cfg_args)
    state = ParallelState.build(tp, pp, device=torch.device("cpu"))
    group = state.tp_group if tp > 1 else None
    module = pipeline_module(pipeline_layers(cfg, VOCAB, group, seed=11), GPTLoss(VOCAB, group), state,
                             partition_method="type:TransformerLayer")
    assert module.parts == [b[0] for b in stage_bounds(cfg, pp)] + [stage_bounds(cfg, pp)[-1][1]]
    reference = dict(GPTModel(cfg, VOCAB, seed=11).named_parameters())
    out = {}
    for name, p in canonical_named_parameters(module, cfg):
        full = reference[name].detach()
        if getattr(p, "tensor_model_parallel", False):
            full = shard_tensor(full_padded_for(name, full, cfg, tp), p.partition_dim, state.tp_rank, tp,
                                p.partition_stride)
        assert torch.equal(p.detach(), full), name
        # a rank holds its shard's memory only (a row shard of the initialised full tensor was a view of it)
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
        out[name] = (tuple(p.shape), getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
    return state.pp_rank, out


def full_padded_for(name: str, full_tp1: torch.Tensor, cfg: ModelConfig, tp: int) -> torch.Tensor:
    """A TP=1 model's (padded) vocab matrix re-padded for ``tp``."""
    spec = {s.name: s for s in parameter_specs(cfg, VOCAB)}[name]
    return _full_padded(spec, full_tp1[:VOCAB] if spec.vocab else full_tp1, cfg, tp)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_hold_the_specs_at_tp2_pp2(tied):
    cfg = _cfg(tied)
    results = run_distributed(_stage_body, 4, args=(2, 2, (tied, False)), timeout=120)
    specs = {s.name: s for s in parameter_specs(cfg, VOCAB)}
    seen: dict[str, tuple] = {}
    for _, out in results:
        for name, (shape, dim, stride) in out.items():
            seen.setdefault(name, (shape, dim, stride))
    assert set(seen) == set(specs)  # every canonical parameter lives somewhere, nothing else does
    for name, (shape, dim, stride) in seen.items():
        s = specs[name]
        assert (dim, stride) == (s.partition_dim, s.partition_stride), name
        full = list(_full_padded(s, torch.empty(s.shape), cfg, 2).shape)
        if dim is not None:
            full[dim] //= 2
        assert shape == tuple(full), name
    # a tied weight lives on both end stages
    if tied:
        stages = {pp for pp, out in results if "embedding.word_embeddings.weight" in out}
        assert stages == {0, 1}
