"""The planner under --rampup-batch-size: the layouts that can run the ramp, the time over the ramp (the sum
of its steps' predicted times, by hand), memory at the full batch, and the command line's line."""
from __future__ import annotations

import dataclasses

from megatron_ru.config.batch_ramp import BatchRamp
from megatron_ru.config.model import ModelConfig
from megatron_ru.plan import Layout, predict_memory
from megatron_ru.plan.cli import run
from megatron_ru.plan.hardware import gpu_spec
from megatron_ru.plan.ramp import ramp_problem, ramp_time
from megatron_ru.plan.search import candidate_layouts
from megatron_ru.plan.throughput import predict_step_time

CFG = ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8, max_position_embeddings=1024)


def test_time_over_the_ramp_is_the_sum_of_its_steps():
    gpu = gpu_spec("h100-80gb")
    layout = Layout(tp=1, pp=4, dp=2, micro_batch=1, global_batch=32, seq_length=1024, zero_stage=1)
    ramp = BatchRamp(8, 8, 200, 32)
    got = ramp_time(CFG, 50304, layout, gpu, ramp)
    # by hand: the ramp's batches until the consumed samples pass 200
    consumed, counts = 0, {}
    while consumed <= 200:
        b = ramp.batch_size_at(consumed)
        counts[b] = counts.get(b, 0) + 1
        consumed += b
    assert got.steps_per_batch == counts and got.samples == consumed
    step = {b: predict_step_time(CFG, 50304, dataclasses.replace(layout, global_batch=b), gpu).seconds
            for b in (*counts, 32)}
    assert abs(got.seconds - sum(n * step[b] for b, n in counts.items())) < 1e-12 * got.seconds
    assert abs(got.constant_seconds - step[32] * consumed / 32) < 1e-12 * got.seconds
    assert got.slowdown > 1.0  # fewer micro batches per step: a larger pipeline bubble share
    assert "batch ramp-up:" in got.summary()


def test_memory_peak_is_at_the_full_batch():
    # the in-flight micro batches of a stage, min(PP - stage, micro batches), only grow with the batch
    small = Layout(tp=1, pp=4, dp=2, micro_batch=1, global_batch=4, seq_length=1024, zero_stage=1)
    full = dataclasses.replace(small, global_batch=32)
    assert predict_memory(CFG, 50304, full).total_bytes >= predict_memory(CFG, 50304, small).total_bytes


def test_only_layouts_that_can_run_the_ramp():
    ramp = BatchRamp(4, 4, 100, 32)
    layouts, invalid = candidate_layouts(CFG, 8, 32, 1024, "bf16", 8, ramp=ramp)
    assert layouts and all(ramp_problem(lay, ramp) is None for lay in layouts)
    assert all(4 % (lay.micro_batch * lay.dp) == 0 for lay in layouts)
    assert any("--rampup-batch-size 4 4 100" in line for line in invalid)  # DP 8: micro batch x DP > 4
    assert ramp_problem(Layout(tp=1, pp=1, dp=8, micro_batch=1, global_batch=32, seq_length=1024), ramp)


def test_cli_prints_the_time_over_the_ramp(capsys):
    argv = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--max-position-embeddings",
            "1024", "--vocab-size", "50304", "--seq-length", "1024", "--global-batch-size", "32", "--num-gpus", "8",
            "--gpu", "h100-80gb", "--top", "2"]
    assert run([*argv, "--rampup-batch-size", "8", "8", "1000"]) == 0
    assert "batch ramp-up: " in capsys.readouterr().out
    assert run([*argv, "--rampup-batch-size", "8", "5", "1000"]) == 2
    assert "must be a multiple of INCREMENT (5)" in capsys.readouterr().err
