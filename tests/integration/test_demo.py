"""`make demo` is one of the README's two commands: run the whole example as a user would
(corpus → tokenizer → preprocess → mpirun TP=2 × PP=2 training → stop → resume → evaluate)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--out", str(out),
                           "--corpus-mb", "2"], capture_output=True, text=True, timeout=900, cwd=ROOT)
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
