"""The one description of the linear layers (config/linears.py) and of the fused parts' row order
(model/spec.PartLayout): the Hugging Face names and shapes, LoRA targets and adapter shapes, the
converters and attention all derive from them, so these facts are checked once, here."""
import pytest
import torch

from megatron_ru.config.linears import LINEARS, hf_module, hf_targets, linear_inputs, part_rows
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import PartLayout, parameter_specs, split_heads


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=48, num_attention_heads=6, group_query_attention=True, num_query_groups=2,
                ffn_hidden_size=40, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                disable_bias_linear=True, max_position_embeddings=64)
    base.update(kw)
    return ModelConfig(**base)


def test_hugging_face_names_of_every_part():
    assert hf_targets() == {"q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"),
                            "v_proj": ("linear_qkv", "v"), "o_proj": ("linear_proj", None),
                            "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"),
                            "down_proj": ("linear_fc2", None)}
    assert hf_module("linear_qkv", "k") == "self_attn.k_proj"
    assert hf_module("linear_proj", "linear_proj") == "self_attn.o_proj"
    assert hf_module("linear_qkv", "linear_qkv") is None  # fused from three modules


def test_sizes_match_the_parameter_specs():
    cfg = _cfg()
    d = cfg.head_dim
    rows = part_rows(cfg)
    assert (rows["q"], rows["k"], rows["v"], rows["linear_qkv"]) == (6 * d, 2 * d, 2 * d, 10 * d)
    assert (rows["gate"], rows["up"], rows["linear_fc1"]) == (40, 40, 80)
    assert linear_inputs(cfg) == {"linear_qkv": 48, "linear_proj": 6 * d, "linear_fc1": 48, "linear_fc2": 40}
    specs = {s.name: s for s in parameter_specs(cfg, 100)}
    for lin in LINEARS.values():
        spec = specs[f"decoder.layers.1.{lin.path}.weight"]
        assert spec.shape == (lin.out_features(cfg), lin.in_features(cfg))
        assert spec.partition_dim == (0 if lin.column else 1)
    assert specs["decoder.layers.0.mlp.linear_fc1.weight"].partition_stride == 2
    assert LINEARS["linear_fc1"].part_rows(_cfg(swiglu=False)) == {"linear_fc1": 40}


@pytest.mark.parametrize("linear", ["linear_qkv", "linear_fc1", "linear_proj"])
@pytest.mark.parametrize("tp", [1, 2])
def test_split_and_join_are_inverse_and_match_select(linear, tp):
    cfg = _cfg()
    layout = PartLayout.full(linear, cfg, tp)
    rows = sum(LINEARS[linear].part_rows(cfg).values()) // tp
    t = torch.randn(rows, 5)
    parts = layout.split(t, dim=0)
    assert list(parts) == list(layout.parts())
    assert torch.equal(layout.join(parts, dim=0), t)
    for name, rows_of_part in parts.items():
        assert torch.equal(layout.select(t, name, 0), rows_of_part)
        assert torch.equal(layout.select(t.t(), name, -1), rows_of_part.t())  # along the last dim too
    if linear != "linear_proj":
        deltas = {layout.parts()[0]: torch.ones_like(parts[layout.parts()[0]].t())}
        assembled = layout.assemble(deltas, t.t())
        assert torch.equal(layout.select(assembled, layout.parts()[0], -1), deltas[layout.parts()[0]])
        assert assembled.sum() == deltas[layout.parts()[0]].numel()


def test_qkv_rows_are_grouped_query_then_key_then_value():
    """[q_0 .. q_{r-1}, k, v] per query group: the canonical and Megatron order that attention reads."""
    cfg = _cfg(hidden_size=12, num_attention_heads=4, num_query_groups=2)  # head_dim 3, r = 2
    d, r, g = 3, 2, 2
    labels = torch.tensor([[grp, slot] for grp in range(g) for slot in range(r + 2) for _ in range(d)])
    parts = PartLayout.full("linear_qkv", cfg).split(labels.float(), dim=0)
    assert parts["q"][:, 1].tolist() == [0.0] * d + [1.0] * d + [0.0] * d + [1.0] * d
    assert parts["k"][:, 1].tolist() == [2.0] * (g * d) and parts["v"][:, 1].tolist() == [3.0] * (g * d)
    assert parts["k"][:, 0].tolist() == [0.0] * d + [1.0] * d
    # attention's heads are the same rows: queries [g * r, d], keys and values [g, d]
    qkv = torch.arange(g * (r + 2) * d, dtype=torch.float32)
    q, k, v = split_heads(qkv[None], g, r, d)
    rows = PartLayout.full("linear_qkv", cfg).split(qkv)
    assert q.shape == (1, g * r, d) and k.shape == v.shape == (1, g, d)
    assert torch.equal(q.reshape(-1), rows["q"]) and torch.equal(k.reshape(-1), rows["k"])
    assert torch.equal(v.reshape(-1), rows["v"])
