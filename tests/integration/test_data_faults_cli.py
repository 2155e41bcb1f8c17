"""pretrain_gpt.py on faulty data and flags, as a user runs it: exit status 2, one message that
names the dataset or flag, no traceback, nothing trained."""
from __future__ import annotations

import os
import pytest
import struct
import subprocess
import sys

import numpy as np

from tests.integration._train_helpers import REPO, tiny_argv
from tests.fixtures.datasets import write_dataset

pytestmark = pytest.mark.slow


def pretrain(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    env.pop("MEGATRON_RU_DEBUG", None)
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)


def _set(argv: list[str], flag: str, *values: str) -> list[str]:
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + [flag, *values] + argv[j:]


def test_ids_of_another_tokenizer_fail_at_start_naming_dataset_id_and_vocabulary(tmp_path):
    prefix = write_dataset(str(tmp_path / "big_text_document"), max_id=1999)  # a 2,000-piece tokenizer's data
    p = pretrain(_set(tiny_argv(prefix, str(tmp_path / "cache")), "--vocab-size", "100"), tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"--data-path {prefix}: token id 1999 is outside the tokenizer's vocabulary of 101 ids" in p.stderr
    assert "Traceback" not in p.stderr and "loss" not in p.stdout


def test_every_problem_in_one_error_before_any_process_group(tmp_path):
    good = write_dataset(str(tmp_path / "good"))
    corrupt = write_dataset(str(tmp_path / "corrupt"), seed=1)
    with open(corrupt + ".idx", "r+b") as f:  # one flipped bit in the document count
        f.seek(26)
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(26)
        f.write(struct.pack("<Q", n ^ 64))
    bogus = tmp_path / "tokenizer.model"
    bogus.write_bytes(b"<html>not a model</html>")
    argv = tiny_argv(good, str(tmp_path / "cache"))
    argv = _set(argv, "--data-path", good, corrupt)
    argv = _set(argv, "--lr", "-1e-3")
    argv = _set(argv, "--split", "100,0,0")
    argv = _set(argv, "--seq-length", "64")  # rope with --max-position-embeddings 32
    argv = _set(argv, "--tokenizer-type", "GPTSentencePieceTokenizer")
    argv = _set(argv, "--vocab-size", "--tokenizer-model", str(bogus))
    argv = [a for a in argv if a != "--vocab-size"]
    p = pretrain(argv, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr
    assert "expected one argument" not in err and "--lr and --min-lr must be >= 0" in err
    assert "--seq-length (64) exceeds --max-position-embeddings (32) with --position-embedding-type rope" in err
    assert f"--tokenizer-model {bogus}: not a SentencePiece model" in err
    assert f"--data-path {corrupt}: {corrupt}.idx: inconsistent index" in err
    assert f"--split 100,0,0: the valid split of {good} receives no documents" in err
    assert err.count("invalid configuration (") == 1 and "Traceback" not in err


def test_ids_beyond_the_vocabulary_outside_the_startup_sample_fail_at_their_batch(tmp_path):
    """3,000 documents: the start-up check reads 1,024 of them; every other one holds id 500."""
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "mixed")
    sampled = set(np.unique(np.linspace(0, 2999, num=1024).round().astype(int)).tolist())
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
        for d in range(3000):
            b.add_item([1, 2, 3, 4, 5, 6, 7, 8] if d in sampled else [1, 2, 3, 500, 5, 6, 7, 8])
            b.end_document()
        b.finalize(prefix + ".idx")
    argv = _set(tiny_argv(prefix, str(tmp_path / "cache")), "--eval-iters", "0")
    p = pretrain(argv, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"train batch: token id 500 from dataset {prefix} is outside the tokenizer's vocabulary of 96 ids" \
        in p.stderr
    assert "Traceback" not in p.stderr
