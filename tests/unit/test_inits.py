"""Every initialisation of new rows the anchors offer (megatron_ru/adapt/inits.py), hand-checked on a
small vocabulary map, and adapt_vocab's --output-init / --input-norm-correction."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron_ru.adapt.inits import CORPUS_METHODS, METHODS, correct_input_norms, init_rows, target_rows
from megatron_ru.data.token_text import token_texts
from megatron_ru.adapt.vocab_map import build_vocab_map
from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
from tests.fixtures.tokenizers import adaptation_tokenizers


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("inits"))
    old_sp, new_sp, old_hf = adaptation_tokenizers(d)
    old, new = GPTSentencePieceTokenizer(old_sp), GPTSentencePieceTokenizer(new_sp)
    ot = token_texts(old)
    vmap = build_vocab_map(old, new, ot, token_texts(new))
    torch.manual_seed(0)
    emb = torch.randn(old.vocab_size, 12, dtype=torch.float64)
    return {"vmap": vmap, "ot": ot, "emb": emb, "old_sp": old_sp, "new_sp": new_sp, "old_hf": old_hf, "dir": d}


def test_each_method_by_hand(case):
    vmap, ot, emb = case["vmap"], case["ot"], case["emb"]
    multi = [i for i, k in enumerate(vmap.kind) if k == "pieces" and len(vmap.pieces[i]) >= 2]
    exact = [i for i, k in enumerate(vmap.kind) if k in ("kept", "special")]
    new = vmap.new_ids()
    assert len(multi) > 50 and exact and new
    methods = [m for m in METHODS if m not in CORPUS_METHODS]          # focus: tests/unit/test_focus.py
    out = {m: init_rows(emb, vmap, m, ot.pieces, seed=3)[0] for m in methods}
    for m in methods:
        assert out[m].shape == (vmap.new_size, 12)
        if m != "random-all":                                   # kept and special rows stay, bit for bit
            assert torch.equal(out[m][exact], emb[[vmap.pieces[i][0] for i in exact]]), m
    chars = [[sum(1 for x in ot.pieces[j] if not 0x80 <= x <= 0xBF) or 1 for j in vmap.pieces[i]] for i in multi]
    for i, n in zip(multi, chars):
        rows = emb[vmap.pieces[i]]
        assert torch.allclose(out["mean"][i], rows.mean(0))
        w = torch.tensor(n, dtype=torch.float64) / sum(n)
        assert torch.allclose(out["char-weighted"][i], (rows * w[:, None]).sum(0))
        assert torch.equal(out["max-char"][i], rows[n.index(max(n))])
    assert torch.allclose(out["mean-all"][new], emb.mean(0).expand(len(new), -1))
    target = target_rows(ot.pieces)
    assert target and torch.allclose(out["mean-target"][new], emb[target].mean(0).expand(len(new), -1))
    spread = (out["hf-default"][new] - emb.mean(0)).abs().max()   # N(mean, 1e-9 cov): the mean, barely moved
    assert 0 < spread < 1e-3
    assert not torch.equal(out["random-all"][exact], emb[[vmap.pieces[i][0] for i in exact]])
    assert float(out["random"][new].std()) == pytest.approx(float(emb.std()), rel=0.1)
    with pytest.raises(ValueError, match="unknown initialisation 'fokus'"):
        init_rows(emb, vmap, "fokus", ot.pieces)


def test_input_norm_correction(case):
    vmap, ot, emb = case["vmap"], case["ot"], case["emb"]
    mean = init_rows(emb, vmap, "mean", ot.pieces)[0]
    fixed = correct_input_norms(mean, emb, vmap.new_ids(), vmap.old_size)
    median = emb.norm(dim=1).median()
    assert torch.allclose(fixed[vmap.new_ids()].norm(dim=1), median.expand(len(vmap.new_ids())))
    others = [i for i in range(vmap.new_size) if i not in set(vmap.new_ids())]
    assert torch.equal(fixed[others], mean[others])
    # mean rows are shorter than the old rows (averages of dissimilar vectors): the correction lengthens them
    assert float(mean[vmap.new_ids()].norm(dim=1).median()) < float(median)


def test_adapt_vocab_output_init_and_norm_correction(case, tmp_path):
    from megatron_ru.adapt.adapt_vocab import add_arguments, adapt_vocab
    from megatron_ru.inference.model_io import open_model
    from megatron_ru.model.spec import OUTPUT_WEIGHT, WORD_EMBEDDING_WEIGHT
    from tests.fixtures.models import tiny_llama
    vmap = case["vmap"]
    p = argparse.ArgumentParser()
    add_arguments(p)
    untied = tiny_llama(str(tmp_path / "untied"), vocab_size=vmap.old_size, tokenizer_dir=case["old_hf"])
    out = str(tmp_path / "out")
    report = adapt_vocab(p.parse_args(["--model", untied, "--new-tokenizer", case["new_sp"], "--init", "mean",
                                       "--output-init", "mean-all", "--input-norm-correction", "--save", out]))
    assert report["output_init"] == "mean-all" and report["input_norm_correction"]
    src, got = open_model(untied), open_model(out)
    new = vmap.new_ids()
    old_out = src.get(OUTPUT_WEIGHT)[:vmap.old_size].double()
    assert torch.allclose(got.get(OUTPUT_WEIGHT)[new].double(), old_out.mean(0).expand(len(new), -1), atol=1e-6)
    norms = got.get(WORD_EMBEDDING_WEIGHT)[new].double().norm(dim=1)
    assert torch.allclose(norms, src.get(WORD_EMBEDDING_WEIGHT).double().norm(dim=1).median().expand(len(new)),
                          rtol=1e-5)
    tied = tiny_llama(str(tmp_path / "tied"), vocab_size=vmap.old_size, tied=True, tokenizer_dir=case["old_hf"])
    with pytest.raises(ValueError, match="--output-init mean-all differs from --init mean.*one matrix"):
        adapt_vocab(p.parse_args(["--model", tied, "--new-tokenizer", case["new_sp"], "--output-init", "mean-all",
                                  "--save", str(tmp_path / "tied_out")]))
