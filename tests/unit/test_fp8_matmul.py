"""megatron_ru/model/fp8.py: the FP8 matmul of a column- or row-parallel linear is torchao's float8 training
matmul (bit for bit torchao's own ``Float8Linear`` at TP 1, every format and recipe, forward and both
gradients); which linears a model converts; a model whose conversion is undone computes bit for bit what it
computed before (FP8 off leaves no trace)."""
from __future__ import annotations

import pytest
import torch

from megatron_ru.model.fp8 import Fp8Matmul, Fp8Spec, convert_to_fp8, float8_config
from megatron_ru.parallel.layers import ColumnParallelLinear, RowParallelLinear

CPU = torch.device("cpu")


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_fp8_linear_is_torchaos_float8_linear(fmt, recipe, cls) -> None:
    from torchao.float8.float8_linear import Float8Linear
    spec = Fp8Spec(fmt, recipe)
    config = float8_config(spec, CPU)
    torch.manual_seed(0)
    ours = cls(64, 48, bias=True, dtype=torch.bfloat16)
    ref = torch.nn.Linear(64, 48, bias=True).bfloat16()
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    ref = Float8Linear.from_float(ref, config=config)
    ours.fp8 = Fp8Matmul(spec, config, "column" if cls is ColumnParallelLinear else "row", None, 1)
    x = torch.randn(4, 3, 64, dtype=torch.bfloat16)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_ours = ours(x_ours)
    y_ours.backward(grad)
    assert torch.equal(y_ours, y_ref)
    assert torch.equal(x_ours.grad, x_ref.grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert torch.equal(ours.bias.grad, ref.bias.grad)
    # FP8, not bf16: the product moved by the e4m3 rounding of its operands (relative ~2^-4 per operand)
    plain = torch.nn.functional.linear(x, ref.weight, ref.bias)
    rel = float((y_ours - plain).detach().float().norm() / plain.float().norm())
    assert 1e-3 < rel <= 2 * 2.0 ** -4, rel
    # the output gradient's format: e5m2 (hybrid) or e4m3
    grad_dtype = config.cast_config_grad_output.target_dtype
    assert grad_dtype == (torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn)


def _model(hidden: int = 64, ffn: int = 128):
    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model import GPTModel
    cfg = ModelConfig(num_layers=2, hidden_size=hidden, num_attention_heads=8, group_query_attention=True,
                      num_query_groups=4, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, ffn_hidden_size=ffn, make_vocab_size_divisible_by=16)
    return GPTModel(cfg, 80, None, seed=3)


def test_which_linears_are_converted() -> None:
    model = _model()
    converted, kept = convert_to_fp8(model, Fp8Spec(), CPU)
    names = [f"{p}.{m}" for p in ("layers.0", "layers.1") for m in ("self_attention.linear_qkv",
                                                                      "self_attention.linear_proj",
                                                                      "mlp.linear_fc1", "mlp.linear_fc2")]
    assert sorted(c.split("decoder.")[-1] for c in converted) == sorted(names), converted
    assert kept == []
    with_fp8 = {n for n, m in model.named_modules() if m.__dict__.get("fp8") is not None}
    assert with_fp8 == set(converted)
    # the output head and the embedding are not linears of a layer: untouched; no parameter, buffer or module added
    assert not any("output_layer" in c or "embedding" in c for c in converted)
    assert set(model.state_dict()) == set(_model().state_dict())
    # a dimension that is not a multiple of 16 keeps its linear in the training precision, and says why
    converted, kept = convert_to_fp8(_model(ffn=100), Fp8Spec(), CPU)
    assert len(converted) == 4 and len(kept) == 4, (converted, kept)
    assert all("mlp.linear_fc" in k and "multiples of 16" in k for k in kept), kept


def test_fp8_off_leaves_no_trace() -> None:
    tokens = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)

    def step(model):
        loss = model(tokens, labels=labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = step(_model())
    model = _model()
    converted, _ = convert_to_fp8(model, Fp8Spec(), CPU)
    fp8_loss, _ = step(model)
    assert fp8_loss != ref_loss
    model.zero_grad(set_to_none=True)
    for name, m in model.named_modules():
        if name in converted:
            del m.fp8
    loss, grads = step(model)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
