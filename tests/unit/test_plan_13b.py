"""Acceptance 1 of issue 14: the seed fact (GPT 13B on 32 x V100-16GB: micro batch 1, TP 4, PP 8 fits
with full recomputation, not without) and the published throughput reference points, predicted
with the one achievable-fraction constant of megatron_ru/plan/throughput.py (docs/planner.md)."""
from __future__ import annotations

import pytest

from megatron_ru.config.model import ModelConfig
from megatron_ru.plan import Layout, predict_memory
from megatron_ru.plan.hardware import gpu_spec
from megatron_ru.plan.throughput import Overlap, predict_step_time

#: GPT-3 13B (Brown et al. 2020, table 2.1): GPT-2 vocabulary, learned positions, tied embeddings
GPT13B = dict(num_layers=40, hidden_size=5120, num_attention_heads=40, max_position_embeddings=2048)
VOCAB_GPT2 = 50257
TOLERANCE = 0.25


def _gpt(**kw) -> ModelConfig:
    return ModelConfig(**{**GPT13B, **kw})


@pytest.mark.parametrize("zero", [0, 1])
def test_13b_v100_16gb_fits_with_recomputation(zero):
    v100 = gpu_spec("v100-16gb")
    layout = Layout(tp=4, pp=8, dp=1, micro_batch=1, global_batch=512, seq_length=2048, recompute="full",
                    zero_stage=zero, precision="fp16")
    pred = predict_memory(_gpt(), VOCAB_GPT2, layout)
    assert pred.total_bytes < v100.memory_bytes, pred.summary()


def test_13b_v100_16gb_does_not_fit_without_recomputation():
    """The published layout (ZeRO-1; no sequence parallelism, which did not exist then) runs out of
    memory without recomputation: 8 micro batches in flight on the first stage."""
    v100 = gpu_spec("v100-16gb")
    layout = Layout(tp=4, pp=8, dp=1, micro_batch=1, global_batch=512, seq_length=2048, recompute="none",
                    zero_stage=1, precision="fp16")
    pred = predict_memory(_gpt(), VOCAB_GPT2, layout)
    assert pred.total_bytes > v100.memory_bytes, pred.summary()
    assert pred.stage == 0 and pred.details["in_flight"] == 8
    # the math attention path (the s x s scores kept, as Megatron's kernels did in 2021) keeps twice as much
    from megatron_ru.plan.activations import Runtime
    math = predict_memory(_gpt(), VOCAB_GPT2, layout, runtime=Runtime("cuda", "math"))
    assert math.terms["activations"] > 2 * pred.terms["activations"]


def test_megatron_deepspeed_13b_on_128_v100():
    """Megatron-DeepSpeed GPT-3 13B, TP 4 x PP 8 x ZeRO-1 (DP 4) on 128 V100, fp16, full recomputation:
    55.6 TFLOP/s per GPU (recomputation counted, as Megatron-DeepSpeed's log). Global batch 1024 and
    micro batch 1 assumed (not stated with the figure; 512 or 2048 change the prediction by < 4 %)."""
    layout = Layout(tp=4, pp=8, dp=4, micro_batch=1, global_batch=1024, seq_length=2048, recompute="full",
                    zero_stage=1, precision="fp16")
    cfg = _gpt()
    gpu = gpu_spec("v100-32gb")
    t = predict_step_time(cfg, VOCAB_GPT2, layout, gpu, gpus_per_node=8, memory=predict_memory(cfg, VOCAB_GPT2, layout))
    ratio = t.tflops_per_gpu / 55.6
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (t.tflops_per_gpu, t.parts)


#: Megatron-LM README, "Weak scaling" table (images/model_table.png): GPT, vocabulary 131,072, sequence
#: 4096, H100, bf16; (size, heads, hidden, layers, TP, PP, DP, GPUs, batch, TFLOP/s per GPU, MFU)
MEGATRON_LM_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]
#: what that README states about the runs: TP (--tp-comm-overlap) and DP (--overlap-grad-reduce,
#: --overlap-param-gather) communication overlapped with compute; micro batch 1 and no interleaving assumed
MEGATRON_LM_OVERLAP = Overlap(tp=1.0, dp=1.0)


@pytest.mark.parametrize("row", MEGATRON_LM_H100, ids=[r[0] for r in MEGATRON_LM_H100])
def test_megatron_lm_h100_weak_scaling(row):
    name, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu = row
    assert tp * pp * dp == gpus
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=4096,
                      untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=1, global_batch=batch, seq_length=4096, zero_stage=1,
                    precision="bf16")
    t = predict_step_time(cfg, 131072, layout, gpu_spec("h100-80gb"), gpus_per_node=8,
                          memory=predict_memory(cfg, 131072, layout), overlap=MEGATRON_LM_OVERLAP)
    assert 1 - TOLERANCE <= t.mfu / mfu <= 1 + TOLERANCE, (name, t.mfu, mfu, t.parts)
