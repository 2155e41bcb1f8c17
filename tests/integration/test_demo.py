"""`make demo` is one of the README's two commands: run the whole example as a user would
(corpus → tokenizer → preprocess → mpirun TP=2 × PP=2 training → stop → resume → evaluate → plot), and
see what the user sees: no DeepSpeed start-up prints, no repeated warnings, the banner and the ETA."""
import json
import os
import re
import sys

import pytest

from tests.progress_guard import run_guarded

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    # about 130 CPU-s; stopped by its progress guard (tests/progress_guard.py) when hung, never for being starved
    proc = run_guarded([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--out", str(out),
                        "--corpus-mb", "2"], cpu_budget_s=600, stall_s=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "== summary" in proc.stdout
    # stopped at 60 with a checkpoint, resumed to 80 from it, evaluated
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "80"
    assert (out / "checkpoints" / "iter_0000060").is_dir()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_iters = [r["iteration"] for r in records if r["type"] == "train"]
    assert train_iters == sorted(set(train_iters)) and train_iters[-1] == 80 and 60 in train_iters
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and all(r["val_ppl"] > 1.0 for r in evals)
    first = next(r for r in records if r["type"] == "train")
    last = [r for r in records if r["type"] == "train"][-1]
    assert last["lm_loss"] < first["lm_loss"] - 1.0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # quiet start-up: DeepSpeed's prints (seed, topology, per-stage layer listing) are debug records now
    for text in ("SEED_LAYERS", "Using topology", "stage=0 layers", "stage=1 layers", "loss: GPTLoss"):
        assert text not in proc.stdout and text not in proc.stderr, text
    # no warning repeated (per rank and per run they were: a torch deprecation DeepSpeed triggers)
    warned = [re.sub(r"^\[[0-9:]+ rank \d+\] ", "", line) for line in (proc.stdout + proc.stderr).splitlines()
              if "Warning" in line]
    assert len(warned) == len(set(warned)), warned
    # the start-up banner and the ETA, from rank 0 of each of the two training runs
    assert proc.stderr.count("INFO megatron_ru.training.banner: layout: TP 2 x PP 2 x DP 1 = 4 ranks") == 2
    assert proc.stderr.count("INFO megatron_ru.training.banner: parameters: ") == 2
    assert proc.stderr.count("INFO megatron_ru.training.banner: tokens per step: 2,048 ") == 2
    assert proc.stderr.count("INFO megatron_ru.training.banner: datasets (samples): train ") == 2
    progress = [line for line in proc.stderr.splitlines() if " iteration " in line and "consumed tokens:" in line]
    assert len(progress) == len(train_iters) and sum("| ETA: " in line for line in progress) == len(progress) - 2
    assert all(r["consumed_tokens"] == 128 * r["consumed_samples"] for r in records if r["type"] == "train")
