import json
import math

import pytest

from megatron_ru.config.training import LoggingConfig
from megatron_ru.model.flops import ModelShape, flops_per_token
from megatron_ru.plan.hardware import peak_tflops_for
from megatron_ru.training.metrics import MetricsWriter, format_train_line


def _gpt(**kw):
    base = dict(num_layers=24, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                num_query_groups=16, seq_length=2048, vocab_size=50304, gated_mlp=False)
    base.update(kw)
    return ModelShape(**base)


def test_flops_match_megatron_formula_for_plain_gpt():
    s = _gpt()
    B, L, h, sq, V = 1, s.num_layers, s.hidden_size, s.seq_length, s.vocab_size
    megatron = 72 * B * sq * L * h * h * (1 + sq / (6 * h)) + 6 * B * sq * h * V
    assert flops_per_token(s) * sq == pytest.approx(megatron, rel=1e-12)
    # full recompute: one more forward of the layers, not of the logits
    megatron_rc = 96 * B * sq * L * h * h * (1 + sq / (6 * h)) + 6 * B * sq * h * V
    assert flops_per_token(s, recompute=True) * sq == pytest.approx(megatron_rc, rel=1e-12)


def test_flops_for_llama_gqa_swiglu_by_hand():
    s = _gpt(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8, num_query_groups=2,
             seq_length=32, vocab_size=1000, gated_mlp=True)
    kv = 64 * 2 / 8  # 16
    layer = 2 * 64 * (64 + 2 * kv) + 2 * 64 * 64 + 4 * 32 * 64 + 2 * 64 * 176 * 3
    assert flops_per_token(s) == pytest.approx(3 * (2 * layer + 2 * 64 * 1000))


def test_peak_table_lookup():
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops_for("NVIDIA A100-SXM4-40GB", "bf16") == 312.0
    assert peak_tflops_for("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert peak_tflops_for("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops_for("NVIDIA H200", "fp32") == 67.0
    assert peak_tflops_for("cpu", "fp32") is None


def _rec(it, loss):
    return dict(iteration=it, train_iters=10, consumed_samples=8 * it, elapsed_ms=12.5, lr=3e-4,
                global_batch_size=8, lm_loss=loss, loss_scale=1.0, grad_norm=0.75, skipped_iterations=0,
                tokens_per_sec=1234.5, tflops_per_device=0.01, mfu=0.5, memory_label="peak RSS",
                peak_memory_mib=100.0)


def test_line_has_megatron_fields():
    line = format_train_line(_rec(3, 1.0 / 3.0))
    for part in ("iteration        3/      10", "consumed samples:", "learning rate: 3.000E-04",
                 "lm loss: 3.333333E-01", "grad norm: 0.750", "tokens/s: 1234.5", "TFLOP/s/device:",
                 "MFU: 50.0%", "peak RSS (MiB): 100"):
        assert part in line


def test_jsonl_full_precision_and_tensorboard_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = LoggingConfig(metrics_file=str(tmp_path / "m" / "metrics.jsonl"),
                          tensorboard_dir=str(tmp_path / "tb"))
    w = MetricsWriter(cfg, active=True)
    losses = [1.0 / 3.0, 2.0 / 7.0]
    for i, loss in enumerate(losses, 1):
        w.log_train(_rec(i, loss))
    ev = w.log_eval(2, 0.123456789012345)
    w.close()
    assert ev["val_ppl"] == math.exp(0.123456789012345)
    recs = [json.loads(line) for line in open(cfg.metrics_file)]
    assert [r["lm_loss"] for r in recs if r["type"] == "train"] == losses  # exact, not rounded
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device"):
        assert key in recs[0]
    assert recs[-1] == {"type": "eval", "split": "validation", "iteration": 2,
                        "val_loss": 0.123456789012345, "val_ppl": math.exp(0.123456789012345)}
    acc = EventAccumulator(cfg.tensorboard_dir)
    acc.Reload()
    scal = acc.Scalars("train/lm_loss")
    assert [e.step for e in scal] == [1, 2]
    assert [e.value for e in scal] == pytest.approx(losses, rel=1e-6)  # TB stores float32
    assert acc.Scalars("validation/ppl")[0].value == pytest.approx(math.exp(0.123456789012345), rel=1e-6)


def test_inactive_writer_writes_nothing(tmp_path):
    cfg = LoggingConfig(metrics_file=str(tmp_path / "x.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    w = MetricsWriter(cfg, active=False)
    w.log_train(_rec(1, 1.0))
    w.close()
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("kv_channels,groups", [(None, 2), (16, 2), (16, 8)])
def test_flops_equal_the_models_counted_matmuls(kv_channels, groups):
    """The forward third of the per-token count is what torch's flop counter sees in one forward of the
    built model (matmuls and attention, the full s x s square), also where the query width is not the hidden
    size (--kv-channels: Mistral-Nemo, Qwen3) and without GQA."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model import GPTModel
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=groups != 8,
                      num_query_groups=groups, kv_channels=kv_channels, ffn_hidden_size=96,
                      max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm",
                      swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                      qk_layernorm=kv_channels is not None, hidden_dropout=0.0, attention_dropout=0.0,
                      make_vocab_size_divisible_by=1)
    vocab, seq = 96, 32
    model = GPTModel(cfg, vocab).eval()
    # the math kernel: attention as two matmuls the counter sees (the CPU's fused kernel has no flop formula)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, seq, dtype=torch.long))
    assert counter.get_total_flops() == flops_per_token(ModelShape.of(cfg, vocab, seq)) / 3 * seq


@pytest.mark.parametrize("window,skip,local", [(8, 2, 2), (8, None, 4), (64, 2, 2)])
def test_flops_of_sliding_window_layers(window, skip, local):
    """A local layer counts min(s, window) keys per query instead of s (Gemma 3: all but every skip-th layer;
    Mistral: every layer); a window not shorter than the sequence changes nothing; a stage's share of local
    layers is the model's."""
    from megatron_ru.config.model import ModelConfig
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=8, kv_channels=16, ffn_hidden_size=96,
                  max_position_embeddings=64, position_embedding_type="rope", normalization="RMSNorm", geglu=True,
                  disable_bias_linear=True)
    seq, vocab = 32, 96
    windowed = ModelConfig(**common, sliding_window=window, window_attn_skip_freq=skip)
    shape = ModelShape.of(windowed, vocab, seq)
    assert (shape.window, shape.local_layers) == (window, local)
    full = flops_per_token(ModelShape.of(ModelConfig(**common), vocab, seq))
    saved = 3 * 4 * (8 * 16) * max(0, seq - window) * local   # fwd + bwd, Q.K^T and scores.V, per local layer
    assert flops_per_token(shape) == full - saved
    assert ModelShape.of(windowed, vocab, seq, num_layers=2).local_layers == local // 2
