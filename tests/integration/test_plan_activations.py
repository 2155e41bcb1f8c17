"""Acceptance 2 of issue 14 (activations): the planner's activation bytes are within 15 % of what
autograd keeps, measured on CPU.

Measurement: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved for backward during
the forward of one micro batch; the bytes of their distinct storages (a view keeps its whole storage
alive), parameters excluded, are what the layer holds until its backward. Measured for one transformer
layer at TP 1 and TP 2 (with and without sequence parallelism; 2 gloo ranks), fp32 and bf16, GPT-style
(LayerNorm, GELU, learned positions, dropout: torch's CPU SDPA then takes its math path) and
LLaMA-style (RMSNorm, SwiGLU, RoPE, GQA, no dropout: the flash path), with full recomputation (only
the layer input stays), and for a whole PP = 1 model's forward with the loss (embedding, layers,
final norm, output head and the cross-entropy's softmax)."""
from __future__ import annotations

from typing import Any

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOLERANCE = 0.15
S, B = 64, 2
GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, max_position_embeddings=64,
           normalization="LayerNorm", hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
             ffn_hidden_size=176, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0, max_position_embeddings=64)
# Gemma 3's layer: query/key norms, four (1 + w) norms, GeGLU, a head size != hidden / heads, local layers (window
# 16 < S: an s x s mask) and global ones
GEMMA = dict(LLAMA, swiglu=False, geglu=True, qk_layernorm=True, sandwich_norm=True, apply_layernorm_1p=True,
             kv_channels=16, sliding_window=16, window_attn_skip_freq=2, softmax_scale=0.2, rotary_base_local=1e4,
             scale_embeddings=True, untie_embeddings_and_output_weights=False)
KINDS = {"gpt": GPT, "llama": LLAMA, "gemma": GEMMA}


def saved_bytes(fn: Any, exclude: Any = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (storages of ``exclude``,
    the parameters, left out)."""
    import torch
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def decoder_saved_bytes(model: Any, x: Any) -> int:
    """:func:`saved_bytes` of ``model``'s transformer layers run in order on ``x`` (parameters left out)."""
    def layers() -> Any:
        h = x
        for layer in model.decoder.layers:
            h = layer(h)
        return h
    return saved_bytes(layers, exclude=list(model.parameters()))


def _layer_case(kind: str, precision: str, tp: int, sp: bool, recompute: bool, tp_group: Any) -> tuple[int, int]:
    """(measured, predicted) bytes of one layer's forward on this rank."""
    import torch

    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model.transformer import TransformerLayer
    from megatron_ru.plan.activations import Runtime, layer_bytes
    from megatron_ru.plan.layout import Layout
    cfg = ModelConfig(**KINDS[kind], recompute_granularity="full" if recompute else None)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = TransformerLayer(cfg, 0, tp_group, sp, dtype=dtype).train()
    x = torch.randn(S // (tp if sp else 1), B, cfg.hidden_size, dtype=dtype, requires_grad=True)
    measured = saved_bytes(lambda: layer(x), exclude=list(layer.parameters()))
    layout = Layout(tp, 1, 1, B, B, S, sequence_parallel=sp, recompute="full" if recompute else "none",
                    precision=precision)
    return measured, layer_bytes(cfg, layout, Runtime.for_device("cpu", cfg))


def _model_case(kind: str, precision: str) -> tuple[int, int]:
    """(measured, predicted) bytes of a whole PP = 1 model's forward and loss, one micro batch."""
    import torch

    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.plan import activations as act
    from megatron_ru.plan.layout import Layout
    from megatron_ru.model.shards import padded_vocab_rows
    cfg = ModelConfig(**KINDS[kind])
    vocab = 1000
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = GPTModel(cfg, vocab, dtype=dtype).train()
    tokens = torch.randint(0, vocab, (B, S))
    labels = torch.randint(0, vocab, (B, S))
    measured = saved_bytes(lambda: model(tokens, labels=labels), exclude=list(model.parameters()))
    layout = Layout(1, 1, 1, B, B, S, precision=precision)
    rt = act.Runtime.for_device("cpu", cfg)
    head = act.logits_bytes(cfg, layout, padded_vocab_rows(cfg, vocab, 1))
    predicted = (cfg.num_layers * act.layer_bytes(cfg, layout, rt) + act.embedding_bytes(cfg, layout, rt)
                 + act.final_norm_bytes(cfg, layout, rt) + head["head_input"] + head["softmax"])
    return measured, predicted


CASES_1 = [("gpt", "fp32", False), ("gpt", "bf16", False), ("llama", "fp32", False), ("llama", "bf16", False),
           ("gemma", "fp32", False), ("gemma", "bf16", False), ("gpt", "fp32", True), ("llama", "bf16", True)]


def _seed(tp_rank: int = 0) -> None:
    from megatron_ru.parallel.random import model_parallel_seed
    model_parallel_seed(1234, tp_rank)


@pytest.mark.parametrize("kind,precision,recompute", CASES_1)
def test_layer_activations_tp1(kind, precision, recompute):
    _seed()
    measured, predicted = _layer_case(kind, precision, 1, False, recompute, None)
    assert abs(measured / predicted - 1) <= TOLERANCE, (measured, predicted)


@pytest.mark.parametrize("kind,precision", [("gpt", "fp32"), ("llama", "bf16"), ("gemma", "bf16")])
def test_model_activations_pp1(kind, precision):
    _seed()
    measured, predicted = _model_case(kind, precision)
    assert abs(measured / predicted - 1) <= TOLERANCE, (measured, predicted)


CASES_2 = [("gpt", "fp32", False), ("gpt", "fp32", True), ("llama", "bf16", False), ("llama", "bf16", True),
           ("gemma", "bf16", True)]


def _tp2_body(rank: int, world_size: int) -> list[tuple[int, int]]:
    import torch.distributed as dist
    _seed(rank)
    return [_layer_case(kind, precision, 2, sp, False, dist.group.WORLD) for kind, precision, sp in CASES_2]


def test_layer_activations_tp2():
    results = run_distributed(_tp2_body, 2, timeout=120, env={"DS_ACCELERATOR": "cpu"})
    bad = [(case, m, p) for rank in results for case, (m, p) in zip(CASES_2, rank)
           if abs(m / p - 1) > TOLERANCE]
    assert not bad, bad
