"""Validation reports bits per byte and per character next to the loss (the adaptation issue, part 2):
the JSONL record's numbers equal a hand computation from the logged loss and the UTF-8 bytes of the
validation samples' scored tokens, at PP = 2 (the first stage counts, the last scores) and DP = 2
(counts summed over the replicas); the log line and TensorBoard carry them too."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.dist_utils import run_distributed
from tests.fixtures.tokenizers import make_sentencepiece, sample_texts
from tests.integration._train_helpers import REPO, tiny_argv, train_body, without_flags

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}


def _expected_bytes(argv: list[str], world_size: int, n_samples: int, sp_model: str) -> tuple[int, int]:
    """UTF-8 bytes and characters of the labels of the first ``n_samples`` validation samples."""
    from megatron_ru.data.token_text import byte_and_char_counts, token_texts
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
    from megatron_ru.training.data import build_datasets
    args = parse_arguments(argv, world_size=world_size, device_type="cpu")
    tok = GPTSentencePieceTokenizer(sp_model)
    _, valid, _ = build_datasets(args, is_builder_rank=True, barrier=lambda: None, vocab_size=tok.vocab_size)
    nbytes, nchars = byte_and_char_counts(token_texts(tok))
    b = c = 0
    for i in range(n_samples):
        labels = valid[i]["tokens"][1:]
        b += int(nbytes[labels].sum())
        c += int(nchars[labels].sum())
    return b, c


def test_validation_bits_per_byte(tmp_path):
    sp = make_sentencepiece(str(tmp_path), vocab=500)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in sample_texts(150, seed=4)),
                      encoding="utf-8")
    prefix = str(tmp_path / "sp")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
                           "--tokenizer-model", sp, "--append-eod", "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = without_flags(tiny_argv(prefix + "_text_document", str(tmp_path / "cache"), iters=2),
                         "--tokenizer-type", "--vocab-size", "--eval-interval", "--eval-iters", "--lr-warmup-iters")
    base += ["--lr-warmup-iters", "1", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp, "--eval-interval", "2",
             "--eval-iters", "2"]
    runs = {"pp2": base + ["--pipeline-model-parallel-size", "2", "--metrics-file", str(tmp_path / "pp2.jsonl"),
                           "--tensorboard-dir", str(tmp_path / "tb")],
            "dp2": base + ["--metrics-file", str(tmp_path / "dp2.jsonl")]}
    run_distributed(train_body, 2, args=(list(runs.values()),), timeout=300, env=ENV)
    nbytes, nchars = _expected_bytes(runs["dp2"], 2, 2 * 4, sp)      # eval-iters x global batch samples
    assert nbytes > 0 and nchars < nbytes                                # Cyrillic: 2 bytes per character
    for name in runs:
        (rec,) = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl") if '"eval"' in line]
        tokens = 2 * 4 * 32
        assert (rec["val_tokens"], rec["val_bytes"], rec["val_chars"]) == (tokens, nbytes, nchars), name
        bits = rec["val_loss"] * tokens / math.log(2)
        assert math.isclose(rec["val_bits_per_byte"], bits / nbytes, rel_tol=1e-12), name
        assert math.isclose(rec["val_bits_per_char"], bits / nchars, rel_tol=1e-12), name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "validation/bits_per_byte" in acc.Tags()["scalars"] and "validation/bits_per_char" in acc.Tags()["scalars"]
