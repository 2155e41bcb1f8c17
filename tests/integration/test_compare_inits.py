"""tools/compare_inits.py on a tiny model: one row per method, the original first; the numbers equal
tools/evaluate.py's on the checkpoint adapt_vocab writes with that method (focus too, from the same
corpus), and are the same at PP = 2 as in one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import run_distributed
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import adaptation_tokenizers, focus_corpus, language_texts

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _body(rank: int, world_size: int, argv: list[str]) -> dict:
    from megatron_ru.adapt.compare_inits import build_parser, run
    return run(build_parser().parse_args(argv))


def test_compare_inits_matches_evaluate(tmp_path):
    from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
    old_sp, new_sp, tok_dir = adaptation_tokenizers(str(tmp_path))
    model = tiny_llama(str(tmp_path / "base"), vocab_size=GPTSentencePieceTokenizer(old_sp).vocab_size, hidden=64,
                       layers=2, ffn=128, tokenizer_dir=tok_dir)
    data = tmp_path / "ru.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in language_texts("ru", 6, 11)),
                    encoding="utf-8")
    corpus = tmp_path / "ru_corpus.jsonl"
    focus_corpus(corpus)
    focus = ["--focus-corpus", str(corpus), "--focus-dim", "16", "--focus-epochs", "2", "--focus-temperature", "0.1"]
    argv = ["--model", model, "--new-tokenizer", new_sp, "--input", str(data), "--seq-length", "64",
            "--methods", "mean", "random", "mean/random", "max-char+norm", "focus", *focus,
            "--output-json", str(tmp_path / "reports" / "c.json")]  # a directory not made yet
    proc = subprocess.run([sys.executable, "tools/compare_inits.py", *argv], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "reports" / "c.json").read_text())
    rows = {r["method"]: r for r in out["results"]}
    assert list(rows) == ["original", "mean", "random", "mean/random", "max-char+norm", "focus"]
    assert out["focus"]["focus_rows"] > 0 and "focus: fastText (dim 16" in proc.stdout
    assert "mean/random" in proc.stdout and rows["original"]["fertility"] > rows["mean"]["fertility"]
    for init in ("mean", "random", "focus"):
        save = str(tmp_path / f"adapted_{init}")
        subprocess.run([sys.executable, "tools/adapt_vocab.py", "--model", model, "--new-tokenizer", new_sp, "--init",
                        init, "--save", save, *(focus if init == "focus" else [])], cwd=REPO, env=ENV, check=True,
                       capture_output=True, timeout=300)
        report = tmp_path / f"e_{init}.json"
        subprocess.run([sys.executable, "tools/evaluate.py", "--load", save, "--input", str(data), "--seq-length", "64",
                        "--output-json", str(report)], cwd=REPO, env=ENV, check=True, capture_output=True, timeout=300)
        want = json.loads(report.read_text())["overall"]["bits_per_byte"]
        assert rows[init]["bits_per_byte"] == pytest.approx(want, rel=1e-9), init
    pp2 = run_distributed(_body, 2, args=(argv[:-2] + ["--pipeline-model-parallel-size", "2"],), timeout=300)[0]
    for r in pp2["results"]:
        assert r["bits_per_byte"] == pytest.approx(rows[r["method"]]["bits_per_byte"], rel=1e-6), r["method"]
