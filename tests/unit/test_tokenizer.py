"""Tokenizers: round trips, Megatron id conventions, batch == single, GPT-2 BPE against an
independent implementation (HF ``tokenizers``), configuration errors, no torch import."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.tokenizer import NullTokenizer, build_tokenizer
from megatron_ru.parallel.utils import pad_vocab_size
from megatron_ru.data.tokenizers.train import symbols_per_token, train_sentencepiece
from tests.fixtures.tokenizers import (make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece,
                                      make_tiktoken_file, sample_texts, tricky_text)

TEXTS = sample_texts(40, seed=11) + ["", " ", "a", "  двойной  пробел\n\n\tтаб", "emoji 🙂 ünïcödé 中文", "<EOD> x </s>"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab, merges = make_gpt2_bpe_files(d)
    return {"sp_bpe": make_sentencepiece(d, "bpe"), "sp_uni": make_sentencepiece(d, "unigram"),
            "vocab": vocab, "merges": merges, "hf": make_hf_tokenizer_dir(d), "tiktoken": make_tiktoken_file(d)}


def configs(files):
    return {
        "sp": TokenizerConfig("SentencePieceTokenizer", files["sp_bpe"]),
        "gptsp": TokenizerConfig("GPTSentencePieceTokenizer", files["sp_bpe"]),
        "gptsp_unigram": TokenizerConfig("GPTSentencePieceTokenizer", files["sp_uni"]),
        "gpt2": TokenizerConfig("GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"]),
        "hf": TokenizerConfig("HuggingFaceTokenizer", files["hf"]),
        "tiktoken": TokenizerConfig("TikTokenizer", files["tiktoken"]),
    }


@pytest.mark.parametrize("name", ["sp", "gptsp", "gptsp_unigram", "gpt2", "hf", "tiktoken"])
def test_round_trip_and_batch(files, name):
    tok = build_tokenizer(configs(files)[name])
    for t in TEXTS:
        ids = tok.tokenize(t)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == t, (name, t)
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]
    arrays = tok.tokenize_batch_arrays(TEXTS)
    assert [a.tolist() for a in arrays] == [tok.tokenize(t) for t in TEXTS]
    assert all(np.issubdtype(a.dtype, np.integer) for a in arrays)
    # what a pool thread does with a huge document's pieces (UTF-8 bytes for the tokenizers that take them)
    pieces = [t.encode("utf-8") for t in TEXTS] if tok.accepts_utf8_bytes else TEXTS
    here = tok.tokenize_arrays_here(pieces)
    assert [a.tolist() for a in here] == [tok.tokenize(t) for t in TEXTS]
    assert all(np.issubdtype(a.dtype, np.integer) for a in here)


def test_sentencepiece_megatron_special_ids(files):
    """Megatron's SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> <PAD> after the pieces
    (bos/eos exist in the model) in that order; GPTSentencePiece uses the model's ids."""
    import sentencepiece as spm

    n = spm.SentencePieceProcessor(model_file=files["sp_bpe"]).vocab_size()
    sp = build_tokenizer(configs(files)["sp"])
    assert [sp.special_tokens[t] for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>")] == list(range(n, n + 5))
    assert (sp.eod, sp.bos, sp.pad, sp.vocab_size) == (n + 2, 1, n + 4, n + 5)
    assert sp.tokenize("a<EOD>b") == sp.tokenize("a") + [n + 2] + sp.tokenize("b")
    extra = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", files["sp_bpe"], vocab_extra_ids=3))
    assert extra.vocab_size == n + 8 and extra.tokenize("<extra_id_2>") == [n + 7]
    gpt = build_tokenizer(configs(files)["gptsp"])
    assert (gpt.vocab_size, gpt.eod, gpt.bos, gpt.pad) == (n, 2, 1, None)


def test_gpt2_bpe_matches_independent_implementation(files):
    """GPT2BPETokenizer encodes with the tokenizers library built from vocab.json/merges.txt; its ids
    equal both the pure-Python reference (regex pre-tokenizer + merge loop) and the library loading
    the files itself, on edge cases and on a long-tail corpus (pseudo-words: rare words that a word
    cache would not hold)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.fixtures.tokenizers import language_texts
    ref = Tokenizer(models.BPE.from_file(files["vocab"], files["merges"]))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = decoders.ByteLevel()
    ours = build_tokenizer(configs(files)["gpt2"])
    with open(files["vocab"], encoding="utf-8") as f:
        vocab = json.load(f)
    assert ours.eod == vocab["<|endoftext|>"] and ours.vocab_size == len(vocab)
    extra = ["don't we'll 've 're", "x  \n\n  y", "123456 7.5", "tab\tnew\r\nline   ", "ёжик «в» тумане",
             "emoji 🙂🙂 and <|endoftext|> as text", "  leading and trailing  ", "", "'s'S'LL", "a\u00a0b\u2003c"]
    texts = TEXTS + extra + language_texts("mixed", 150, seed=11)
    fast = ours.tokenize_batch(texts)
    for t, ids in zip(texts, fast):
        assert ids == ours.tokenize(t) == ours.reference_tokenize(t) == ref.encode(t).ids, t
        assert ours.detokenize(ids) == t


def test_gpt2_bpe_long_tail_vocabulary(tmp_path):
    """A larger vocabulary trained on long-tail text: the library's merges equal the reference's on
    held-out documents full of words neither saw."""
    from tests.fixtures.tokenizers import language_texts
    vocab, merges = make_gpt2_bpe_files(tmp_path, vocab=2000, texts=language_texts("mixed", 300, seed=1))
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    held_out = language_texts("mixed", 100, seed=99)
    assert tok.tokenize_batch(held_out) == [tok.reference_tokenize(t) for t in held_out]


def test_hf_tokenizer_special_ids(files):
    tok = build_tokenizer(configs(files)["hf"])
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(files["hf"], "tokenizer.json"))
    assert (tok.bos, tok.eod, tok.pad) == (raw.token_to_id("<s>"), raw.token_to_id("</s>"), raw.token_to_id("<pad>"))
    assert tok.eod not in tok.tokenize("plain text without specials")


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=100))
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize(" 1 2\n 99 ") == [1, 2, 99] and tok.detokenize([1, 2, 99]) == "1 2 99"
    with pytest.raises(ValueError, match="outside .0, 101.*--vocab-size"):
        tok.tokenize("5 101")
    with pytest.raises(ValueError, match="integers"):
        NullTokenizer(10).tokenize("1 x")


def test_tiktoken_equals_the_hugging_face_llama3_tokenizer_of_the_same_file(files):
    """TikTokenizer on a LLaMA-3 style tokenizer.model gives the ids of the Hugging Face tokenizer
    holding the same vocabulary with LLaMA-3's pattern and 256 special tokens; special-token text
    inside a document is ordinary text."""
    tik = build_tokenizer(TokenizerConfig("TikTokenizer", files["tiktoken"]))
    hf_dir = os.path.join(os.path.dirname(files["tiktoken"]), "hf_llama3")
    hf = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", hf_dir))
    assert (tik.vocab_size, tik.eod, tik.bos) == (hf.vocab_size, hf.eod, hf.bos) == (600 + 256, 601, 600)
    texts = [tricky_text(s, 2000) for s in range(3)] + TEXTS
    assert [a.tolist() for a in tik.tokenize_batch_arrays(texts, num_threads=2)] == hf.tokenize_batch(texts)
    assert tik.tokenize_batch(texts) == hf.tokenize_batch(texts)
    special = "a <|end_of_text|> b"
    assert tik.eod not in tik.tokenize(special) and tik.detokenize(tik.tokenize(special)) == special
    assert hf.eod in hf.tokenize(special)  # (Hugging Face matches added tokens in the text)


def test_tiktoken_file_errors(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tokenizer.model, line 2: not '<base64 token> <rank>'"):
        build_tokenizer(TokenizerConfig("TikTokenizer", str(bad)))
    bad.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="ranks are not 0..1 without gaps"):
        build_tokenizer(TokenizerConfig("TikTokenizer", str(bad)))
    with pytest.raises(ValueError, match="nope.model: no such file"):
        build_tokenizer(TokenizerConfig("TikTokenizer", str(tmp_path / "nope.model")))


def test_config_problems_name_flags(tmp_path):
    cases = [
        (TokenizerConfig(), "--tokenizer-type is required"),
        (TokenizerConfig("SentencePieceTokenizer"), "--tokenizer-model is required"),
        (TokenizerConfig("GPTSentencePieceTokenizer", str(tmp_path / "nope.model")), "nope.model: no such file"),
        (TokenizerConfig("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json")), "--merge-file is required"),
        (TokenizerConfig("HuggingFaceTokenizer", str(tmp_path / "none")), "no such directory"),
        (TokenizerConfig("NullTokenizer"), "--vocab-size must be a positive integer"),
        (TokenizerConfig("BertWordPieceCase", vocab_file="x"), "'BertWordPieceCase' is unknown"),
    ]
    for cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build_tokenizer(cfg)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        build_tokenizer(TokenizerConfig("SentencePieceTokenizer", str(bad)))


def test_mismatched_gpt2_files(files, tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> token"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"),
                                        merge_file=files["merges"]))
    (tmp_path / "v2.json").write_text(json.dumps({"<|endoftext|>": 0, "a": 1, "b": 2}))
    (tmp_path / "m2.txt").write_text("#version: 0.2\na c\n")
    with pytest.raises(ValueError, match="--merge-file and --vocab-file do not belong together"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(tmp_path / "v2.json"),
                                        merge_file=str(tmp_path / "m2.txt")))
    (tmp_path / "m.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="line 2: expected two symbols"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=str(tmp_path / "m.txt")))


def test_vocab_padding():  # Megatron's rule, written once (parallel/utils.pad_vocab_size)
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200
    assert pad_vocab_size(1024, 128, 2) == 1024


def test_train_unigram_and_symbols_per_token(tmp_path):
    texts = sample_texts(120, seed=2)
    model = train_sentencepiece(texts[:100], str(tmp_path / "u"), "unigram", 400, hard_vocab_limit=False)
    assert sorted(os.listdir(tmp_path)) == ["u.model", "u.vocab"]  # no temporary files left
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model))
    stats = symbols_per_token(tok, texts[100:])
    ids = [tok.tokenize(t) for t in texts[100:]]
    assert stats["tokens"] == sum(map(len, ids)) and stats["characters"] == sum(map(len, texts[100:]))
    assert stats["symbols_per_token"] == pytest.approx(stats["characters"] / stats["tokens"])
    assert stats["symbols_per_token"] > 1.5  # a trained model compresses; byte fallback alone gives < 1


def test_tokenizer_module_does_not_import_torch(files):
    code = ("import sys; from megatron_ru.data.tokenizer import build_tokenizer; "
            "from megatron_ru.config.tokenizer import TokenizerConfig; "
            "import megatron_ru.data.preprocess.pipeline; "
            f"build_tokenizer(TokenizerConfig('HuggingFaceTokenizer', {files['hf']!r})); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_worker_type_follows_whether_the_tokenizer_releases_the_gil(files):
    import sentencepiece

    from megatron_ru.data.preprocess.pipeline import MAX_AUTO_THREADS, choose_worker_type
    from megatron_ru.data.tokenizer import _version_tuple

    assert _version_tuple("0.2.3") == (0, 2, 3) and _version_tuple("0.2.2rc1") == (0, 2) < (0, 2, 2)
    toks = {name: build_tokenizer(cfg) for name, cfg in configs(files).items()}
    toks["null"] = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=10))
    new_sp = _version_tuple(sentencepiece.__version__) >= (0, 2, 2)
    # sentencepiece 0.2.0 and 0.2.1 hold the GIL in batch encode (two threads took as long as one).
    # the tokenizers library (GPT-2 BPE, tokenizer.json) encodes batches in Rust with the GIL released
    assert [n for n, t in toks.items() if t.releases_gil] == (["sp", "gptsp", "gptsp_unigram"] if new_sp else []) + [
        "gpt2", "hf", "tiktoken"]
    expect_auto = "thread" if new_sp else "process"
    assert choose_worker_type("auto", 2, toks["gptsp"]) == expect_auto
    assert choose_worker_type("auto", MAX_AUTO_THREADS, toks["sp"]) == expect_auto
    assert choose_worker_type("auto", MAX_AUTO_THREADS + 1, toks["sp"]) == "process"
    assert choose_worker_type("auto", 2, toks["gpt2"]) == "thread"
    assert choose_worker_type("auto", 2, toks["hf"]) == "thread"
    assert choose_worker_type("process", 2, toks["gptsp"]) == "process"
    # a tokenizer that holds the GIL: threads fall back to processes (the warning: test_preprocess_cli)
    assert choose_worker_type("thread", 2, toks["null"]) == "process"
    assert choose_worker_type("auto", 2, toks["null"]) == "process"
