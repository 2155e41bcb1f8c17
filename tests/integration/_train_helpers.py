"""Shared pieces of the training integration tests: a tiny corpus, the flags of a tiny model, and
an in-process rank body for ``run_distributed``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 96


def make_corpus(directory: str, num_docs: int = 120, seed: int = 0) -> str:
    """A learnable token corpus (documents are runs of +1/+3 arithmetic sequences mod VOCAB with
    some noise) written as MMIDIDX; returns the dataset prefix (NullTokenizer --vocab-size VOCAB)."""
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    prefix = os.path.join(directory, "tiny_text_document")
    if os.path.exists(prefix + ".idx"):
        return prefix
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(num_docs):
        n = int(rng.randint(20, 90))
        step = int(rng.choice([1, 3]))
        doc = (int(rng.randint(0, VOCAB - 1)) + step * np.arange(n)) % (VOCAB - 1)
        noise = rng.rand(n) < 0.05
        doc[noise] = rng.randint(0, VOCAB - 1, int(noise.sum()))
        builder.add_document(np.append(doc, VOCAB - 1), [n + 1])  # VOCAB-1 plays the end-of-document id
    builder.finalize(prefix + ".idx")
    return prefix


def tiny_argv(prefix: str, cache: str, *, iters: int = 10, extra: Sequence[str] = ()) -> list[str]:
    """A 4-layer, hidden-64 LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, untied output) on seq 32."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
        "--num-query-groups", "4", "--ffn-hidden-size", "128", "--seq-length", "32",
        "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "7",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
        "--data-path", prefix, "--data-cache-path", cache, "--split", "90,10,0", "--num-workers", "0",
        "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "2", "--distributed-timeout-minutes", "2",
        *extra]


def trained_iterations(metrics_file: str | Path) -> int:
    """How many iterations a ``--metrics-file`` still being written has logged: its complete train
    records (a last line without its newline is still being written); 0 before the file exists."""
    try:
        text = Path(metrics_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    complete = text.split("\n")[:-1]
    return sum(json.loads(line).get("type") == "train" for line in complete if line.strip())


#: the model flags of :func:`tiny_argv` (what ``--use-checkpoint-args`` takes from a checkpoint instead)
TINY_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--group-query-attention",
                    "--num-query-groups", "--ffn-hidden-size", "--max-position-embeddings",
                    "--position-embedding-type", "--normalization", "--swiglu", "--disable-bias-linear",
                    "--untie-embeddings-and-output-weights")


def without_flags(argv: Sequence[str], *flags: str) -> list[str]:
    """``argv`` without the given flags and their values."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


AUTOGRAD_WARNING = "an autograd kernel was not registered"


def train_body(rank: int, world_size: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    """Rank body for ``run_distributed``: train once per argv in ``runs`` (several engines in one
    spawn to save start-up time); return losses and grad norms of each run. An argv starting with
    ``"expect-error"`` must raise ValueError; its message is returned instead."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.pretrain import run
    out = []
    for argv in runs:
        if argv[0] == "expect-error":
            try:
                run(parse_arguments(argv[1:], world_size=world_size, device_type="cpu"))
            except ValueError as e:
                out.append({"error": str(e)})
                continue
            raise AssertionError(f"expected a ValueError from {argv[1:]}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run(parse_arguments(argv, world_size=world_size, device_type="cpu"))
        # torch's warning for an op autograd cannot differentiate (a tied weight's in-place broadcast once made
        # every backward at PP 2 print it): returned for the tests to assert on; the other warnings shown
        autograd = [str(w.message) for w in caught if AUTOGRAD_WARNING in str(w.message)]
        for w in caught:
            if AUTOGRAD_WARNING not in str(w.message):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        out.append({"losses": result.losses, "grad_norms": result.grad_norms, "evals": result.evals,
                    "iteration": result.iteration, "autograd_warnings": autograd,
                    "exit_reason": result.exit_reason, "saved": result.saved})
    return out


def relative_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in a)


def convert_cli(*argv: str) -> subprocess.CompletedProcess:
    """``tools/convert_checkpoint.py ARGV`` as users run it (CPU, one thread), output captured."""
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
