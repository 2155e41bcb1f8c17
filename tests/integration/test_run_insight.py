"""Run insight on a real job (issue 14, part 3): `torchrun` with 2 ranks, a pipeline of 2 stages (so
DeepSpeed's PipelineModule has its start-up prints to make), TensorBoard and Weights & Biases in offline
mode side by side.

* the offline W&B run, read back from its ``.wandb`` file (a LevelDB-style log of wandb's protobuf
  records), holds exactly TensorBoard's scalars: the same tags, steps and values; one run, written by
  the rank that logs;
* stdout holds none of DeepSpeed's start-up prints; they are debug records of ``megatron_ru.deepspeed``;
* the start-up banner and the ETA / consumed tokens of the progress line are logged.
"""
import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.dist_utils import free_port
from tests.fixtures.wandb_files import wandb_records
from tests.integration._train_helpers import REPO, make_corpus, tiny_argv

pytestmark = pytest.mark.slow

ITERS, SEQ = 6, 32
BIN = os.path.dirname(sys.executable)


def wandb_history(path):
    """{tag: [(step, value)]} of the run's logged metrics (W&B's own keys, ``_step`` etc., left out)."""
    out = {}
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        for key, value in items.items():
            if not key.startswith("_"):
                out.setdefault(key, []).append((int(items["_step"]), value))
    return out


def wandb_step_metrics(path):
    return {rec.metric.name: rec.metric.step_metric for rec in wandb_records(path)
            if rec.WhichOneof("record_type") == "metric" and rec.metric.step_metric}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("insight")
    prefix = make_corpus(str(tmp))
    argv = tiny_argv(prefix, str(tmp / "cache"), iters=ITERS, extra=[
        "--pipeline-model-parallel-size", "2", "--log-interval", "2", "--eval-interval", "4",
        "--metrics-file", str(tmp / "metrics.jsonl"), "--tensorboard-dir", str(tmp / "tb"),
        "--wandb-project", "insight-test", "--wandb-exp-name", "pp2", "--wandb-save-dir", str(tmp / "wb")])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "WANDB_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}:{env.get('PATH', '')}",
                "PYTHONPATH": REPO, "MEGATRON_RU_LOG_LEVEL": "DEBUG", "WANDB_MODE": "offline",
                "WANDB_CONFIG_DIR": str(tmp / "wandb_config"), "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
                "WANDB_DATA_DIR": str(tmp / "wandb_data")})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "pretrain_gpt.py", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp, proc


def test_wandb_offline_run_has_the_tensorboard_scalars(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, _ = job
    runs = glob.glob(str(tmp / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs  # one run for the job: only the logging rank writes one
    history = wandb_history(runs[0])
    acc = EventAccumulator(str(tmp / "tb"))
    acc.Reload()
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert {"train/lm_loss", "train/lr", "train/grad_norm", "train/consumed_tokens", "validation/loss",
            "validation/ppl", "train/lm_loss_vs_samples"} <= set(tb)
    assert set(history) == set(tb)
    step_metrics = wandb_step_metrics(runs[0])
    assert step_metrics == {"train/lm_loss_vs_samples": "train/consumed_samples"}
    samples = dict(history["train/consumed_samples"])
    for tag, points in tb.items():
        got = history[tag]
        if tag in step_metrics:  # TensorBoard's step is W&B's step metric at the same W&B step
            got = [(int(samples[step]), v) for step, v in got]
        # TensorBoard keeps float32 values; W&B the full float64
        assert [(s, struct.unpack("f", struct.pack("f", v))[0]) for s, v in got] == points, tag
    assert [s for s, _ in history["train/lm_loss"]] == [2, 4, 6]
    assert [s for s, _ in history["validation/loss"]] == [4, 6]
    metrics = [json.loads(line) for line in open(tmp / "metrics.jsonl")]
    assert [v for _, v in history["train/lm_loss"]] == [r["lm_loss"] for r in metrics if r["type"] == "train"]


def test_stdout_has_no_deepspeed_startup_prints(job):
    _, proc = job
    for text in ("SEED_LAYERS", "Using topology", "stage=0 layers", "loss: GPTLoss", "Warning"):
        assert text not in proc.stdout, proc.stdout[-3000:]
    # routed, not lost: debug records of rank 0 (MEGATRON_RU_LOG_LEVEL=DEBUG here)
    debug = [line.split(": ", 1)[1] for line in proc.stderr.splitlines()
             if "rank 0] DEBUG megatron_ru.deepspeed: " in line]
    assert any(line.startswith("SEED_LAYERS=") for line in debug)
    assert any(line.startswith("Using topology:") for line in debug)
    assert "stage=1 layers=4" in debug and "  loss: GPTLoss" in debug


def test_banner_eta_and_consumed_tokens(job):
    tmp, proc = job
    info = [line.split("INFO ", 1)[1] for line in proc.stderr.splitlines() if "rank 0] INFO " in line]
    banner = [line.split(": ", 1)[1] for line in info if line.startswith("megatron_ru.training.banner")]
    assert banner[0] == ("layout: TP 1 x PP 2 x DP 1 = 2 ranks | micro batch 1 x gradient accumulation 4 x DP 1 "
                         "= global batch 4 | ZeRO 0 | fp32 | sequence parallel off | recomputation none")
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.plan.params import stage_param_counts
    from tests.integration._train_helpers import VOCAB
    args = parse_arguments(tiny_argv(make_corpus(str(tmp)), str(tmp / "cache"), iters=ITERS,
                                     extra=["--pipeline-model-parallel-size", "2"]), world_size=2, device_type="cpu")
    per_stage = stage_param_counts(args.model, VOCAB - 1, 1, 2)  # the planner's count, from the description
    total = sum(per_stage)  # TP 1, untied output layer: the stages' sum is the model (vocabulary padded)
    assert banner[1].startswith(f"parameters: {total:,} "), banner[1]
    assert f"stage 0 {per_stage[0]:,}" in banner[1] and f"stage 1 {per_stage[1]:,}" in banner[1], banner[1]
    assert banner[2].startswith(f"tokens per step: {4 * SEQ:,} (global batch 4 x sequence {SEQ})")
    assert banner[3].startswith("datasets (samples): train ") and "test none" in banner[3]
    # the planner's prediction for this very layout, and the measured peak next to it after the first log
    from megatron_ru.plan import predict_for_arguments
    predicted = predict_for_arguments(args, 2, vocab_size=VOCAB - 1)
    assert banner[4] == f"memory (planner): {predicted.summary()}"
    assert banner[5] == "Weights & Biases: project insight-test (--wandb-project), run pp2"
    memory = [line for line in info if line.startswith("megatron_ru.training.loop: memory after the first")]
    assert len(memory) == 1 and (f"planner's prediction {predicted.total_bytes / 2 ** 20:.0f} MiB per GPU"
                                 in memory[0]), memory
    lines = [line for line in info if " iteration " in line and "consumed tokens:" in line]
    assert len(lines) == ITERS // 2
    assert "ETA" not in lines[0] and all("| ETA: 0:0" in line for line in lines[1:])
    recs = [json.loads(line) for line in open(tmp / "metrics.jsonl")]
    train = [r for r in recs if r["type"] == "train"]
    assert [r["consumed_tokens"] for r in train] == [r["consumed_samples"] * SEQ for r in train]
    assert train[0]["eta_seconds"] is None and train[-1]["eta_seconds"] == 0.0 and train[1]["eta_seconds"] > 0
    assert [r["consumed_tokens"] for r in recs if r["type"] == "eval"] == [4 * 4 * SEQ, 6 * 4 * SEQ]
