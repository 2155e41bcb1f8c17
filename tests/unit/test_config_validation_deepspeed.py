"""The DeepSpeed config generated from the flags (fp16 loss scaling is tested here: the CPU
accelerator refuses fp16 training)."""
import json

from megatron_ru.flags.arguments import parse_arguments
from tests.fixtures.datasets import write_dataset
from megatron_ru.flags.deepspeed import build_ds_config
from megatron_ru.training.engine import optimizer_param_groups


def _args(tmp_path, *extra, world_size=4, device_type="cuda"):
    write_dataset(str(tmp_path / "c"))
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-position-embeddings", "64", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "16", "--train-iters", "10", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--data-path", str(tmp_path / "c"), "--clip-grad", "0.5", *extra]
    return parse_arguments(argv, world_size=world_size, device_type=device_type)


def test_fp16_dynamic_loss_scaling_flags(tmp_path):
    cfg = build_ds_config(_args(tmp_path, "--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "500",
                                "--hysteresis", "3", "--min-loss-scale", "2", "--zero-stage", "2",
                                "--tensor-model-parallel-size", "2"))
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
                           "hysteresis": 3, "min_loss_scale": 2.0}
    assert cfg["bf16"] == {"enabled": False}
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (16, 2, 4)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["gradient_clipping"] == 0.5
    static = build_ds_config(_args(tmp_path, "--fp16", "--loss-scale", "128"))
    assert static["fp16"]["loss_scale"] == 128.0


def test_bf16_accumulates_in_fp32_and_user_config_is_merged(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_batch_size": 16, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 1, "reduce_bucket_size": 12345},
                                "wall_clock_breakdown": True}))
    cfg = build_ds_config(_args(tmp_path, "--bf16", "--zero-stage", "1", "--deepspeed_config", str(user),
                                device_type="cpu"))
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 12345}
    assert cfg["wall_clock_breakdown"] is True and cfg["gradient_accumulation_steps"] == 2


def test_grad_reduce_in_bf16_is_deepspeeds_bf16_gradient_accumulation(tmp_path):
    import pytest
    cfg = build_ds_config(_args(tmp_path, "--bf16", "--grad-reduce-in-bf16", "--use-distributed-optimizer",
                                device_type="cpu"))
    assert cfg["data_types"]["grad_accum_dtype"] == "bf16" and cfg["zero_optimization"]["stage"] == 1
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 reduces bfloat16 gradients: add --bf16"):
        _args(tmp_path, "--grad-reduce-in-bf16", device_type="cpu")


def test_no_weight_decay_on_biases_and_norms():
    import torch
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    m[0].bias.requires_grad_(False)
    groups = optimizer_param_groups(m, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 2]
    assert groups[0]["params"][0] is m[0].weight and groups[0]["weight_decay"] == 0.1
    assert groups[1]["weight_decay"] == 0.0
