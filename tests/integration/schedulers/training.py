"""The tiny training run the job scripts are submitted with, and what its output must show."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .system import FAULTHANDLER_ENV

# Overrides of the settings block at the top of every job script: a 2-layer model on CPU.
TINY_SETTINGS = {
    "NUM_LAYERS": "2", "HIDDEN_SIZE": "64", "NUM_ATTENTION_HEADS": "4", "FFN_HIDDEN_SIZE": "",
    "SEQ_LENGTH": "64", "MAX_POSITION_EMBEDDINGS": "64", "MODEL_ARGS": "",
    "TP": "1", "PP": "1", "ZERO_STAGE": "1", "PRECISION": "fp32",
    "MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "SEED": "1234",
    # constant LR: a resumed job may ask for more iterations without changing the schedule
    "LR": "3e-3", "MIN_LR": "3e-3", "LR_DECAY_STYLE": "constant", "LR_WARMUP_ITERS": "0",
    "SPLIT": "98,1,1", "LOG_INTERVAL": "1", "EVAL_INTERVAL": "1000", "EVAL_ITERS": "1", "SAVE_INTERVAL": "4",
}
# CPU, gloo and two "GPUs" per node; root may run mpirun here (a CI machine, not a cluster)
CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "2",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **FAULTHANDLER_ENV}
WORLD_SIZE = 2


def job_env(corpus: dict[str, str], save_dir: Path, metrics: Path, train_iters: int,
            extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """A clean submission environment: system PATH only (the job script activates the venv)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "USER": "root"}
    env.update(base or {})
    env.update(TINY_SETTINGS)
    env.update(CPU_ENV)
    env.update({
        "DATA_PATH": corpus["data_path"],
        "TOKENIZER_ARGS": f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {corpus['tokenizer_model']}",
        "SAVE_DIR": str(save_dir), "TRAIN_ITERS": str(train_iters),
        "EXTRA_ARGS": f"--metrics-file {metrics} --distributed-timeout-minutes 2",
    })
    env.update(extra or {})
    return env


def train_records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    return [r for r in recs if r.get("type") == "train"]


def latest_iteration(save_dir: Path) -> int:
    return int((save_dir / "latest_checkpointed_iteration.txt").read_text().strip())


def check_ranks(log: str, save_dir: Path, source: str) -> None:
    """Every rank joined: discovery saw the launcher and the world size, and each rank wrote its
    own RNG file into the newest checkpoint, whose metadata records the same layout."""
    m = re.search(r"rank discovery: source=(\w+) rank=0/(\d+)", log)
    assert m, f"no rank discovery line in the job log:\n{log[-3000:]}"
    assert (m.group(1), int(m.group(2))) == (source, WORLD_SIZE), m.group(0)
    ckpt = save_dir / f"iter_{latest_iteration(save_dir):07d}"
    rng_files = sorted(p.name for p in ckpt.glob("rng_rank_*.pt"))
    assert rng_files == [f"rng_rank_{r:05d}.pt" for r in range(WORLD_SIZE)], rng_files
    # ZeRO-1 (TINY_SETTINGS): every data-parallel rank writes the optimizer state its partition holds
    shards = sorted(p.name for p in ckpt.glob("optim_states-*.pt"))
    assert shards == [f"optim_states-pp00-tp00-dp{r:03d}.pt" for r in range(WORLD_SIZE)], shards
    meta = json.loads((ckpt / "metadata.json").read_text())
    world = (meta["tensor_model_parallel_size"] * meta["pipeline_model_parallel_size"]
             * meta["data_parallel_size"])
    assert world == WORLD_SIZE, meta


def log_losses(log: str) -> list[tuple[int, float]]:
    """(iteration, lm loss) of every Megatron-style progress line in a job log."""
    return [(int(it), float(loss)) for it, loss in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+.\dE]+) \|", log)]


def check_fresh_run(log: str, metrics: Path, save_dir: Path, iters: int | None = None) -> list[dict]:
    """Trained from scratch: iterations 1..iters (or 1..wherever it stopped) logged, the loss
    fell, and the last iteration is the saved one."""
    recs = train_records(metrics)
    iters = iters if iters is not None else len(recs)
    assert iters >= 4, f"too few iterations to judge the loss: {recs}\n{log[-3000:]}"
    assert [r["iteration"] for r in recs] == list(range(1, iters + 1)), f"iterations logged: {recs}\n{log[-3000:]}"
    losses = [r["lm_loss"] for r in recs]
    assert losses[-1] < losses[0] - 0.3, f"loss did not decrease: {losses}"
    # the job log shows the same falling curve as the JSONL metrics
    printed = log_losses(log)
    assert [it for it, _ in printed] == list(range(1, iters + 1)), printed
    assert all(abs(a - b) <= 1e-5 * abs(b) for (_, a), b in zip(printed, losses)), (printed, losses)
    assert latest_iteration(save_dir) == iters
    assert "training from scratch" in log
    return recs


def check_resumed(log: str, metrics: Path, save_dir: Path, start: int, previous: list[dict]) -> list[dict]:
    """The job loaded iteration ``start`` and carried on: iterations start+1..., losses continue
    from where ``previous`` ended rather than from an untrained model."""
    assert f"resuming from {save_dir} (iteration {start})" in log, log[-3000:]
    recs = train_records(metrics)
    assert recs, f"the resumed job logged no iteration:\n{log[-3000:]}"
    assert recs[0]["iteration"] == start + 1, [r["iteration"] for r in recs]
    untrained = previous[0]["lm_loss"]
    assert recs[0]["lm_loss"] < untrained - 0.3, (recs[0]["lm_loss"], untrained)
    return recs
