#!/usr/bin/env python
"""The built-in example, end to end on this machine (`make demo`), no download.

Steps (each a function, so that later steps, e.g. training a model, can be added):
  1. make_corpus          a synthetic JSONL corpus of multi-paragraph documents with
                          `text` and `domain` keys
  2. train_tokenizer      a SentencePiece BPE model with tools/train_tokenizer.py
  3. preprocess           tools/preprocess_data.py: whole documents; per-domain datasets with
                          --group-by-key domain; paragraph datasets with --split-paragraphs
  4. show                 tools/dataset_info.py on what was built
  5. train                pretrain_gpt.py under `mpirun -np 4` (gloo): a small LLaMA-style model
                          with TP = 2 and PP = 2, stopped by --exit-interval (checkpoint saved)
  6. resume               the same command with --load: continues from the checkpoint to the
                          end, evaluates on the validation split
  7. plot                 tools/plot_metrics.py: the run's metrics.jsonl as metrics.png (loss,
                          bits per byte, learning rate, gradient norm, tokens/s, memory)
  8. summary              losses before/after, validation loss and perplexity, where the
                          checkpoints, JSONL metrics, plot and TensorBoard logs are
Everything goes under demo_out/ (or --out).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ru.data.preprocess.synthetic import write_corpus  # noqa: E402
from megatron_ru.utils.cli import ArgumentParser  # noqa: E402

PY = sys.executable


def shown_command(cmd: list[str]) -> str:
    """``cmd`` as a shell line to paste from the repository root: paths under it made relative, every
    word quoted where the shell needs it (a report named ``instruct (English tokenizer).json``)."""
    return shlex.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)


def step(title: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
    print(f"\n== {title}\n$ {shown_command(cmd)}",
          flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


def make_corpus(out: str, megabytes: float = 4.0) -> str:
    path = os.path.join(out, "corpus.jsonl")
    if not os.path.exists(path):
        n = write_corpus(path, int(megabytes * 1e6), seed=0)
        print(f"== corpus: {path} ({n} documents, {os.path.getsize(path) / 1e6:.1f} MB)", flush=True)
    return path


def train_tokenizer(out: str, corpus: str, vocab_size: int = 4000) -> str:
    prefix = os.path.join(out, "tokenizer", f"bpe{vocab_size}")
    step("train a SentencePiece BPE tokenizer",
         [PY, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus, "--output-prefix", prefix,
          "--model-type", "bpe", "--vocab-size", str(vocab_size), "--heldout-every", "50"])
    return prefix + ".model"


def tokenizer_args(model: str) -> list[str]:
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]


def preprocess(out: str, corpus: str, model: str, workers: int = 2) -> dict[str, list[str]]:
    """Returns the dataset prefixes built, by kind ('documents', 'domains', 'paragraphs')."""
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    common = ["--input", corpus, *tokenizer_args(model), "--append-eod", "--workers", str(workers),
              "--log-interval", "500"]
    built: dict[str, list[str]] = {}
    prefix = os.path.join(out, "data", "corpus")
    step("preprocess: one dataset of whole documents", [PY, tool, *common, "--output-prefix", prefix])
    built["documents"] = [f"{prefix}_text_document"]
    prefix = os.path.join(out, "data", "by_domain")
    step("preprocess: one dataset per domain (--group-by-key domain), paragraphs as sequences",
         [PY, tool, *common, "--output-prefix", prefix, "--group-by-key", "domain", "--split-paragraphs"])
    built["domains"] = [f"{prefix}_{d}_text_document" for d in ("news", "wiki", "science")]
    prefix = os.path.join(out, "data", "paragraphs")
    step("preprocess: paragraphs as sequences (--split-paragraphs)",
         [PY, tool, *common, "--output-prefix", prefix, "--split-paragraphs"])
    built["paragraphs"] = [f"{prefix}_text_document"]
    return built


def show(built: dict[str, list[str]], model: str) -> None:
    prefixes = [p for ps in built.values() for p in ps]
    step("what was built", [PY, os.path.join(ROOT, "tools", "dataset_info.py"), "--data-path", *prefixes,
                            "--show-documents", "1", "--num-tokens", "24", *tokenizer_args(model)])


TRAIN_ITERS, STOP_AT = 80, 60


def train_argv(out: str, data_prefix: str, model: str) -> list[str]:
    """A 4-layer LLaMA-style model (RMSNorm, SwiGLU, RoPE, grouped-query attention) on TP=2 x PP=2."""
    return [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo",
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "352", "--seq-length", "128",
        "--max-position-embeddings", "128", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(TRAIN_ITERS),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
        *tokenizer_args(model), "--data-path", data_prefix, "--split", "95,5,0", "--num-workers", "0",
        "--log-interval", "5", "--eval-interval", "40", "--eval-iters", "4",
        "--save", os.path.join(out, "checkpoints"), "--metrics-file", os.path.join(out, "metrics.jsonl"),
        "--tensorboard-dir", os.path.join(out, "tensorboard"), "--distributed-timeout-minutes", "5"]


def mpirun(ranks: int) -> tuple[list[str], dict[str, str]]:
    """`mpirun -np N` plus the environment it needs here: Open MPI refuses root and more ranks than
    cores unless told so (by environment, so the command stays the plain one users type)."""
    exe = shutil.which("mpirun")
    if exe is None:
        raise SystemExit("mpirun not found: run `make install` (scripts/setup_env.sh installs Open MPI)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{os.path.dirname(PY)}:{os.environ.get('PATH', '')}")
    if not shutil.which("nvidia-smi"):
        env.setdefault("DS_ACCELERATOR", "cpu")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if (os.cpu_count() or 1) < ranks:
        env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    return [exe, "-np", str(ranks)], env


def train(out: str, data_prefix: str, model: str) -> None:
    for path in ("checkpoints", "tensorboard", "metrics.jsonl", "metrics.png"):  # a rerun starts from scratch
        full = os.path.join(out, path)
        if os.path.isdir(full):
            shutil.rmtree(full)
        elif os.path.isfile(full):
            os.remove(full)
    launcher, env = mpirun(4)
    base = [*launcher, PY, os.path.join(ROOT, "pretrain_gpt.py"), *train_argv(out, data_prefix, model)]
    step(f"train: 4 ranks (TP=2 x PP=2) via mpirun, stop at iteration {STOP_AT} with a checkpoint",
         [*base, "--exit-interval", str(STOP_AT)], env=env)
    step(f"resume from the checkpoint to iteration {TRAIN_ITERS}, then evaluate",
         [*base, "--load", os.path.join(out, "checkpoints")], env=env)


def plot(out: str) -> str:
    png = os.path.join(out, "metrics.png")
    step("plot the metrics (training and validation loss, bits per byte, learning rate, gradient norm, tokens/s, "
         "memory)", [PY, os.path.join(ROOT, "tools", "plot_metrics.py"), "--metrics-file",
                     os.path.join(out, "metrics.jsonl"), "--label", "demo", "--x", "tokens", "--output", png,
                     "--title", f"make demo: 4-layer LLaMA-style model, TP 2 x PP 2, 4 CPU ranks, stopped at "
                                f"{STOP_AT} and resumed"])
    return png


def summary(out: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
    trains = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    first, last = trains[0], trains[-1]
    stop = next(r for r in trains if r["iteration"] == STOP_AT)
    latest = open(os.path.join(out, "checkpoints", "latest_checkpointed_iteration.txt")).read().strip()
    print("\n== summary")
    print(f"training loss: {first['lm_loss']:.3f} (iterations 1-{first['iteration']}) -> {stop['lm_loss']:.3f} "
          f"(at the stop, iteration {STOP_AT}) -> {last['lm_loss']:.3f} (iteration {last['iteration']}, "
          f"after resuming)")
    for e in evals:
        print(f"validation at iteration {e['iteration']}: loss {e['val_loss']:.3f}, perplexity {e['val_ppl']:.1f}")
    print(f"throughput: {last['tokens_per_sec']:.0f} tokens/s, {last['elapsed_ms']:.0f} ms per iteration (4 ranks)")
    print(f"checkpoints: {os.path.join(out, 'checkpoints')} (latest: iteration {latest})")
    print(f"metrics (JSONL): {os.path.join(out, 'metrics.jsonl')}, plotted in {os.path.join(out, 'metrics.png')}")
    print(f"TensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}")
    if not last["lm_loss"] < first["lm_loss"] - 1.0:
        raise SystemExit(f"the loss did not drop clearly ({first['lm_loss']:.3f} -> {last['lm_loss']:.3f})")
    return {"first_loss": first["lm_loss"], "loss_at_stop": stop["lm_loss"], "final_loss": last["lm_loss"],
            "evals": evals, "latest": int(latest)}


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "demo_out"))
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    corpus = make_corpus(args.out, args.corpus_mb)
    model = train_tokenizer(args.out, corpus)
    built = preprocess(args.out, corpus, model)
    show(built, model)
    train(args.out, built["documents"][0], model)
    plot(args.out)
    result = summary(args.out)
    return {"corpus": corpus, "tokenizer": model, "datasets": built, "training": result}


if __name__ == "__main__":
    main()
