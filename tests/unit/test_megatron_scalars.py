"""Megatron-LM's optional scalars (--log-params-norm, --log-*-to-tensorboard) under its tag names: the
record keys map to the tags, the ``vs samples`` tags step by consumed samples, validation ppl only with its
switch, and TensorBoard and metrics.jsonl carry the same numbers."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_ru.config.training import LoggingConfig
from megatron_ru.training.metrics import MetricsWriter, eval_scalars, memory_bytes, train_scalars


def _rec(it, **extra):
    return dict(iteration=it, train_iters=10, consumed_samples=8 * it, elapsed_ms=12.5, lr=3e-4,
                global_batch_size=8, lm_loss=1.5, loss_scale=1.0, grad_norm=0.75, skipped_iterations=0,
                tokens_per_sec=1234.5, tflops_per_device=0.01, mfu=None, memory_label="peak RSS",
                peak_memory_mib=100.0, **extra)


def test_no_switch_no_megatron_tag():
    s = train_scalars(_rec(1))
    assert not [t for t in s.values if "-" in t or " " in t]
    assert "lm loss validation ppl" not in eval_scalars({"split": "validation", "iteration": 1, "val_loss": 1.0,
                                                        "val_ppl": math.e}).values


def test_tags_and_steps():
    s = train_scalars(_rec(3, params_norm=12.5, batch_size=8, world_size=4, iteration_time=0.25,
                           mem_max_rss_bytes=2.0 ** 30))
    assert {t: s.values[t] for t in ("params-norm", "batch-size", "world-size", "iteration-time",
                                     "mem-max-rss-bytes")} == {"params-norm": 12.5, "batch-size": 8.0,
                                                               "world-size": 4.0, "iteration-time": 0.25,
                                                               "mem-max-rss-bytes": 2.0 ** 30}
    for tag in ("params-norm", "batch-size", "world-size"):
        assert s.values[f"{tag} vs samples"] == s.values[tag]
        assert s.step_of(f"{tag} vs samples") == 24 and s.step_of(tag) == 3
    assert s.step_of("iteration-time") == 3
    e = eval_scalars({"split": "validation", "iteration": 3, "val_loss": 2.0, "val_ppl": math.exp(2.0),
                      "consumed_samples": 24}, megatron_ppl=True)
    assert e.values["lm loss validation ppl"] == math.exp(2.0)
    assert e.step_of("lm loss validation ppl") == 3 and e.step_of("lm loss validation ppl vs samples") == 24


def test_memory_on_cpu_is_peak_rss():
    m = memory_bytes(torch.device("cpu"))
    assert list(m) == ["mem_max_rss_bytes"] and m["mem_max_rss_bytes"] > 2 ** 20


def test_tensorboard_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = LoggingConfig(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"),
                          log_validation_ppl_to_tensorboard=True)
    w = MetricsWriter(cfg, active=True)
    for it in (1, 2):
        w.log_train(_rec(it, params_norm=10.0 + it, batch_size=8, world_size=2, iteration_time=0.5))
    w.log_eval(2, 1.25, consumed_samples=16)
    w.close()
    recs = [json.loads(line) for line in open(cfg.metrics_file)]
    assert [r["params_norm"] for r in recs if r["type"] == "train"] == [11.0, 12.0]
    assert recs[-1]["consumed_samples"] == 16 and recs[-1]["val_ppl"] == math.exp(1.25)
    acc = EventAccumulator(cfg.tensorboard_dir)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("params-norm")] == [(1, 11.0), (2, 12.0)]
    assert [(e.step, e.value) for e in acc.Scalars("params-norm vs samples")] == [(8, 11.0), (16, 12.0)]
    assert [(e.step, e.value) for e in acc.Scalars("batch-size vs samples")] == [(8, 8.0), (16, 8.0)]
    assert [(e.step, e.value) for e in acc.Scalars("world-size")] == [(1, 2.0), (2, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("iteration-time")] == [(1, 0.5), (2, 0.5)]
    ppl = acc.Scalars("lm loss validation ppl")
    assert [e.step for e in ppl] == [2] and ppl[0].value == pytest.approx(math.exp(1.25), rel=1e-6)
    assert [e.step for e in acc.Scalars("lm loss validation ppl vs samples")] == [16]


def test_params_norm_refused_at_zero3():
    from megatron_ru.flags.arguments import parse_arguments
    with pytest.raises((ValueError, SystemExit)) as e:
        parse_arguments(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                         "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1",
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--mock-data",
                         "--zero-stage", "3", "--log-params-norm"], world_size=1, device_type="cpu")
    assert "--log-params-norm cannot be combined with --zero-stage 3" in str(e.value)
