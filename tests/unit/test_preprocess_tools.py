"""tools/train_tokenizer.py (BPE/Unigram, held-out symbols per token) and tools/dataset_info.py."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
from megatron_ru.data.tokenizer import build_tokenizer
from tests.fixtures.tokenizers import make_sentencepiece, sample_texts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_train_tokenizer_reports_heldout_symbols_per_token(tmp_path, kind):
    texts = sample_texts(90, seed=9)
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")  # empty texts are neither trained on nor held out
    stats = load_tool("train_tokenizer").main([
        "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "tok"), "--model-type", kind,
        "--vocab-size", "350", "--heldout-every", "10", "--num-threads", "1"])
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "tok.model", "tok.stats.json", "tok.vocab"]
    assert json.load(open(tmp_path / "tok.stats.json")) == stats
    heldout = texts[9::10]
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", str(tmp_path / "tok.model")))
    n_tokens = sum(len(tok.tokenize(t)) for t in heldout)
    assert stats["documents"] == 9 and stats["tokens"] == n_tokens
    assert stats["symbols_per_token"] == pytest.approx(sum(map(len, heldout)) / n_tokens)
    assert all(tok.detokenize(tok.tokenize(t)) == t for t in heldout)  # lossless by default


def test_train_tokenizer_bad_line(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2: no key 'text'"):
        load_tool("train_tokenizer").main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "t")])
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_dataset_info(tmp_path):
    model = make_sentencepiece(tmp_path)
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model))
    paras = ["Первый абзац.\n\n", "Second paragraph."]
    with IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16) as b:
        b.add_item(tok.tokenize(paras[0]))
        b.add_item(tok.tokenize(paras[1]) + [tok.eod])
        b.end_document()
        b.add_item([5, 6, 7])
        b.finalize(str(tmp_path / "d.idx"))
    n0, n1 = len(tok.tokenize(paras[0])), len(tok.tokenize(paras[1])) + 1
    out = load_tool("dataset_info").main(["--data-path", str(tmp_path / "d"), "--num-tokens", "1000",
                                          "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model])
    assert "dtype uint16" in out and f"documents 2, sequences 3, tokens {n0 + n1 + 3}" in out
    assert f"document 0: 2 sequence(s), {n0 + n1} tokens" in out
    assert repr("".join(paras) + tok.detokenize([tok.eod])) in out
    assert "document 1: 1 sequence(s), 3 tokens; first 3: [5, 6, 7]" in out
    with pytest.raises(FileNotFoundError, match="nope.idx not found"):
        load_tool("dataset_info").main(["--data-path", str(tmp_path / "nope")])


def test_train_tokenizer_reads_a_jsonl_with_a_bom_like_one_without(tmp_path):
    from megatron_ru.data.preprocess.encode import iter_texts

    plain = tmp_path / "a.jsonl"
    plain.write_text("\n".join(json.dumps({"text": t}) for t in ("один", "two", "три")) + "\n", encoding="utf-8")
    bom = tmp_path / "b.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert list(iter_texts([str(bom)])) == list(iter_texts([str(plain)])) == ["один", "two", "три"]
    mid = tmp_path / "c.jsonl"
    mid.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + plain.read_bytes())
    with pytest.raises(ValueError, match=r"c\.jsonl:4: "):
        list(iter_texts([str(mid)]))
