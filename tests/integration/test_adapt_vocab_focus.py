"""tools/adapt_vocab.py --init focus end to end on the tiny adaptation models: the rows it writes are
the ones FOCUS computes in process from the same corpus (overlapping rows copied, the others convex
combinations of overlapping tokens' old rows), a second run writes the same bytes, --output-init focus
and --mode extend work, and a missing or unused --focus-corpus is an error naming the flag (exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from megatron_ru.adapt.focus import FocusOptions, build_focus
from megatron_ru.adapt.inits import init_rows
from megatron_ru.inference.model_io import open_model
from megatron_ru.data.token_text import token_texts
from megatron_ru.adapt.token_vectors import VectorOptions
from megatron_ru.adapt.vocab_map import build_vocab_map
from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
from megatron_ru.model.spec import OUTPUT_WEIGHT, WORD_EMBEDDING_WEIGHT
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import adaptation_tokenizers, focus_corpus

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "adapt_vocab.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FOCUS_FLAGS = ["--focus-dim", "16", "--focus-epochs", "20", "--focus-min-count", "2", "--focus-temperature", "0.05"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("focus_cli")
    old_sp, new_sp, tok_dir = adaptation_tokenizers(str(d))
    old, new = GPTSentencePieceTokenizer(old_sp), GPTSentencePieceTokenizer(new_sp)
    model = tiny_llama(str(d / "base"), vocab_size=old.vocab_size, tokenizer_dir=tok_dir)
    corpus = d / "ru.jsonl"
    focus_corpus(corpus)
    return types.SimpleNamespace(dir=d, old=old, new=new, new_sp=new_sp, model=model, corpus=str(corpus))


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *argv], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def test_focus_rows_written_by_the_tool(case):
    outs = []
    for k in range(2):
        outs.append(str(case.dir / f"focus_{k}"))
        proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--init", "focus", "--focus-corpus",
                    case.corpus, *FOCUS_FLAGS, "--save", outs[-1])
        assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    f = report["focus"]
    assert report["init"] == report["output_init"] == "focus" and f["focus_rows"] > 100 and f["no_vector_rows"] > 0
    assert f["focus_rows"] + f["no_vector_rows"] == report["new_vocab_size"] - report["kept"]
    assert "FOCUS:" in proc.stderr and "fastText" in proc.stderr

    ot, nt = token_texts(case.old), token_texts(case.new)
    vmap = build_vocab_map(case.old, case.new, ot, nt)
    fmap = build_focus(vmap, case.new, nt, FocusOptions(VectorOptions(case.corpus, dim=16, epochs=20, min_count=2),
                                                        temperature=0.05))
    src, first, second = open_model(case.model), open_model(outs[0]), open_model(outs[1])
    exact = [i for i, k in enumerate(vmap.kind) if k in ("kept", "special")]
    for name in (WORD_EMBEDDING_WEIGHT, OUTPUT_WEIGHT):
        want = init_rows(src.get(name), vmap, "focus", ot.pieces, focus=fmap)[0]
        assert torch.equal(first.get(name), want), name                    # what FOCUS computes in process
        assert torch.equal(second.get(name), first.get(name)), name        # and the same on a second run
        assert torch.equal(first.get(name)[exact], src.get(name)[[vmap.pieces[i][0] for i in exact]])
        old_rows = src.get(name).double()
        for i in fmap.focus_ids[:50]:                                       # convex combinations of old rows
            w = torch.tensor(fmap.vmap.weights[i], dtype=torch.float64)
            assert (w > 0).all() and float(w.sum()) == pytest.approx(1.0)
            assert torch.allclose(first.get(name)[i].double(), (old_rows[fmap.vmap.pieces[i]] * w[:, None]).sum(0),
                                  atol=1e-6)


def test_output_init_focus_and_extend(case):
    out = str(case.dir / "mean_focus")
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--init", "mean", "--output-init", "focus",
                "--focus-corpus", case.corpus, *FOCUS_FLAGS, "--save", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ot, nt = token_texts(case.old), token_texts(case.new)
    vmap = build_vocab_map(case.old, case.new, ot, nt)
    src, got = open_model(case.model), open_model(out)
    assert torch.equal(got.get(WORD_EMBEDDING_WEIGHT), vmap.convert(src.get(WORD_EMBEDDING_WEIGHT)))
    assert not torch.equal(got.get(OUTPUT_WEIGHT), vmap.convert(src.get(OUTPUT_WEIGHT)))

    ext = str(case.dir / "extend_focus")
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--mode", "extend", "--init", "focus",
                "--focus-corpus", case.corpus, *FOCUS_FLAGS, "--save", ext)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    adapted, v_old = open_model(ext), src.vocab_size
    assert report["focus"]["focus_rows"] > 0 and adapted.vocab_size > v_old
    for name in (WORD_EMBEDDING_WEIGHT, OUTPUT_WEIGHT):
        assert torch.equal(adapted.get(name)[:v_old], src.get(name))     # every old row, bit for bit


def test_focus_corpus_errors_name_the_flag(case, tmp_path):
    save = str(tmp_path / "o")
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--init", "focus", "--save", save)
    assert proc.returncode == 2 and "error: --init focus needs --focus-corpus" in proc.stderr, proc.stderr[-2000:]
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--output-init", "focus", "--save", save)
    assert proc.returncode == 2 and "--output-init focus needs --focus-corpus" in proc.stderr
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--init", "focus", "--focus-corpus",
                str(tmp_path / "none.jsonl"), "--save", save)
    assert proc.returncode == 2 and "--focus-corpus" in proc.stderr and "no such file" in proc.stderr
    proc = _run("--model", case.model, "--new-tokenizer", case.new_sp, "--focus-corpus", case.corpus, "--save", save)
    assert proc.returncode == 2 and "--focus-corpus applies to --init focus" in proc.stderr
    assert not os.path.exists(save)
