"""ModelConfig: Megatron flags, derived sizes, and every validation message."""
from __future__ import annotations

import pytest

from megatron_ru.config.base import parse_configs
from megatron_ru.config.model import ModelConfig, model_parallel_problems

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8"]


def _cfg(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=8, max_position_embeddings=32)
    values.update(kw)
    return ModelConfig(**values)


def test_megatron_flags_parse() -> None:
    cfg = parse_configs([ModelConfig], BASE + [
        "--ffn-hidden-size", "96", "--group-query-attention", "--num-query-groups", "2",
        "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by", "64",
        "--init-method-std", "0.01", "--recompute-granularity", "full"])[ModelConfig]
    assert (cfg.resolved_ffn_hidden_size, cfg.query_groups, cfg.head_dim) == (96, 2, 8)
    assert cfg.rotary_base == 500000 and cfg.norm_epsilon == 1e-6 and cfg.make_vocab_size_divisible_by == 64
    assert cfg.recompute and not cfg.add_bias_linear and not cfg.tied_embeddings
    assert cfg.problems() == []


def test_hf_family_flags_parse() -> None:
    cfg = parse_configs([ModelConfig], BASE + [
        "--position-embedding-type", "rope", "--rotary-base", "1e6", "--kv-channels", "16", "--add-qkv-bias",
        "--disable-bias-linear", "--rope-scaling-type", "llama3", "--rope-scaling-factor", "32",
        "--rope-scaling-low-freq-factor", "1", "--rope-scaling-high-freq-factor", "4",
        "--rope-scaling-original-max-position-embeddings", "8192", "--sliding-window", "4096"])[ModelConfig]
    assert cfg.rotary_base == 1e6 and isinstance(cfg.rotary_base, float)
    assert (cfg.head_dim, cfg.add_qkv_bias_effective, cfg.add_bias_linear) == (16, True, False)
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings,
            cfg.sliding_window) == ("llama3", 32.0, 8192, 4096)
    assert cfg.problems() == []
    defaults = parse_configs([ModelConfig], BASE)[ModelConfig]   # defaults keep the old model exactly
    assert (defaults.rotary_base, defaults.rope_scaling_type, defaults.kv_channels, defaults.add_qkv_bias,
            defaults.sliding_window, defaults.head_dim) == (10000, "none", None, False, None, 8)
    with pytest.raises(SystemExit):
        parse_configs([ModelConfig], BASE + ["--rope-scaling-type", "yarn"])


def test_checkpoint_activations_alias_and_choices() -> None:
    assert parse_configs([ModelConfig], BASE + ["--checkpoint-activations"])[ModelConfig].recompute
    assert not parse_configs([ModelConfig], BASE)[ModelConfig].recompute
    with pytest.raises(SystemExit):
        parse_configs([ModelConfig], BASE + ["--normalization", "BatchNorm"])
    with pytest.raises(SystemExit):
        parse_configs([ModelConfig], BASE + ["--position-embedding-type", "alibi"])


def test_ffn_defaults_follow_megatron() -> None:
    assert _cfg().resolved_ffn_hidden_size == 256                      # 4h
    assert _cfg(hidden_size=4096, num_attention_heads=32, swiglu=True).resolved_ffn_hidden_size == 10880
    assert _cfg(swiglu=True).resolved_ffn_hidden_size == 128           # int(4*64*2/3/64)*64
    assert _cfg().query_groups == 8                                    # no GQA: one group per head
    assert _cfg(num_query_groups=2).query_groups == 8                  # ignored without the switch


@pytest.mark.parametrize("kwargs, expected", [
    (dict(num_layers=None), "--num-layers is required"),
    (dict(hidden_size=0), "--hidden-size must be >= 1, got 0"),
    (dict(hidden_size=60), "--hidden-size (60) must be divisible by --num-attention-heads (8)"),
    (dict(group_query_attention=True, num_query_groups=3),
     "--num-attention-heads (8) must be divisible by --num-query-groups (3)"),
    (dict(max_position_embeddings=None),
     "--max-position-embeddings is required with --position-embedding-type learned_absolute"),
    (dict(hidden_dropout=1.0), "--hidden-dropout must be in [0, 1), got 1.0"),
    (dict(attention_dropout=-0.1), "--attention-dropout must be in [0, 1), got -0.1"),
    (dict(make_vocab_size_divisible_by=0), "--make-vocab-size-divisible-by must be >= 1, got 0"),
    (dict(hidden_size=24, num_attention_heads=8, position_embedding_type="rope"),
     "rotary embeddings need an even head size"),
    (dict(norm_epsilon=0.0), "--norm-epsilon must be > 0, got 0.0"),
    (dict(kv_channels=0), "--kv-channels must be >= 1, got 0"),
    (dict(kv_channels=5, position_embedding_type="rope"),
     "rotary embeddings need an even head size; --kv-channels is 5"),
    (dict(hidden_size=60), "or give the head size with --kv-channels"),
    (dict(rotary_base=0.0), "--rotary-base must be > 0, got 0.0"),
    (dict(rope_scaling_type="linear"), "--rope-scaling-type linear needs --position-embedding-type rope"),
    (dict(rope_scaling_type="linear", position_embedding_type="rope", rope_scaling_factor=0.0),
     "--rope-scaling-factor must be > 0, got 0.0"),
    (dict(rope_scaling_type="llama3", position_embedding_type="rope"),
     "--rope-scaling-type llama3 needs --rope-scaling-original-max-position-embeddings"),
    (dict(rope_scaling_type="llama3", position_embedding_type="rope",
          rope_scaling_original_max_position_embeddings=0),
     "--rope-scaling-original-max-position-embeddings must be >= 1, got 0"),
    (dict(rope_scaling_type="llama3", position_embedding_type="rope", rope_scaling_original_max_position_embeddings=8,
          rope_scaling_low_freq_factor=4.0),
     "llama3 RoPE scaling needs 0 < --rope-scaling-low-freq-factor (4.0) < --rope-scaling-high-freq-factor (4.0)"),
    (dict(sliding_window=0), "--sliding-window must be >= 1, got 0"),
])
def test_problems_name_the_flag(kwargs: dict, expected: str) -> None:
    found = _cfg(**kwargs).problems()
    assert any(expected in p for p in found), found


def test_kv_channels_frees_the_head_size() -> None:
    cfg = _cfg(hidden_size=60, kv_channels=16, position_embedding_type="rope")   # 60 / 8 heads: no problem
    assert cfg.problems() == [] and cfg.head_dim == 16
    assert model_parallel_problems(cfg, tp=2) == []   # heads and groups split over TP, not hidden / heads


def test_rope_needs_no_max_positions() -> None:
    assert _cfg(max_position_embeddings=None, position_embedding_type="rope").problems() == []


def test_model_parallel_problems() -> None:
    cfg = _cfg(num_attention_heads=8, group_query_attention=True, num_query_groups=2, ffn_hidden_size=102,
               num_layers=3)
    found = model_parallel_problems(cfg, tp=4, pp=4)
    assert found == [
        "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)",
        "the MLP size --ffn-hidden-size (102) must be divisible by --tensor-model-parallel-size (4)",
        "--pipeline-model-parallel-size (4) exceeds --num-layers (3): every pipeline stage needs at least one "
        "transformer layer"]
    assert model_parallel_problems(cfg, tp=1, pp=2) == []  # 3 layers over 2 stages: 2 + 1, as DeepSpeed splits
    assert model_parallel_problems(_cfg(num_attention_heads=8, hidden_size=48), tp=16, pp=1)[0] == \
        "--num-attention-heads (8) must be divisible by --tensor-model-parallel-size (16)"
    assert model_parallel_problems(cfg, tp=2, pp=3) == []


def test_invalid_model_config_is_refused_once_listing_all_problems(tmp_path) -> None:
    """Validated once, by parse_arguments, before any process group or model exists (GPTModel
    takes a validated config and does not check it again)."""
    from megatron_ru.flags.arguments import parse_arguments
    from tests.fixtures.datasets import write_dataset
    prefix = write_dataset(str(tmp_path / "d"))
    argv = ["--num-layers", "2", "--hidden-size", "60", "--num-attention-heads", "8", "--hidden-dropout", "2.0",
            "--max-position-embeddings", "64", "--seq-length", "32", "--train-iters", "2",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", prefix]
    with pytest.raises(ValueError) as info:
        parse_arguments(argv, world_size=1, device_type="cpu")
    text = str(info.value)
    assert "--hidden-size (60) must be divisible" in text and "--hidden-dropout must be in [0, 1)" in text
    assert text.startswith("invalid configuration (")
