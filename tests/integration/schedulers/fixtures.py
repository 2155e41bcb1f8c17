"""pytest fixtures: the two schedulers (one bring-up per test module) and a tiny training setup.

Import them into a test module: ``from tests.integration.schedulers.fixtures import grid_engine``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import gridengine, slurm

REPO = Path(__file__).resolve().parents[3]


# module scope: the daemons stop as soon as the module that needs them is done
@pytest.fixture(scope="module")
def grid_engine():
    ge = gridengine.bring_up()
    yield ge
    ge.stop()


@pytest.fixture(scope="module")
def slurm_cluster():
    cluster = slurm.bring_up()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict[str, str]:
    """A SentencePiece tokenizer and a ~70k-token dataset built with the project's own tools."""
    from tests.fixtures.tokenizers import make_sentencepiece, sample_texts

    d = tmp_path_factory.mktemp("tiny_corpus")
    model = make_sentencepiece(d, vocab=400)
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        for text in sample_texts(300, seed=1):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(d / "corpus.jsonl"),
                    "--output-prefix", str(d / "corpus"), "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", model, "--append-eod"],
                   check=True, capture_output=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return {"data_path": str(d / "corpus_text_document"), "tokenizer_model": model}
