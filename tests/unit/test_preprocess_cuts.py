"""Cutting huge documents (megatron_ru/data/preprocess/cuts.py): where, and the proof per
tokenizer type that the pieces' ids are exactly the whole text's."""
from __future__ import annotations

import json
import random

import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.preprocess.cuts import cut_document
from megatron_ru.data.tokenizer import build_tokenizer
from tests.fixtures.tokenizers import (make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece,
                                      make_tiktoken_file, sample_texts, tricky_text)

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
def boundary_ok(text: str, i: int) -> bool:
    return text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace()


def test_cuts_are_word_boundaries_and_exact():
    text = tricky_text(1)
    for target in (7, 50, 333, 2000):
        pieces = cut_document(text, target, "keep")
        assert "".join(pieces) == text and len(pieces) > 1
        pos = 0
        for p in pieces[:-1]:
            pos += len(p)
            assert boundary_ok(text, pos), (target, text[pos - 5:pos + 5])
        # drop: cut at word boundaries too, the space left out
        dropped = cut_document(text, target, "drop")
        assert " ".join(dropped) == text and len(dropped) > 1
        pos = -1
        for p in dropped[:-1]:
            pos += len(p) + 1
            assert boundary_ok(text, pos)
        # a piece outgrows the target only where its window holds no word boundary (rare here)
        assert sum(len(p) <= target for p in pieces) >= 0.9 * len(pieces) or target < 50
        # bytes: cut at word boundaries too (sizes count bytes) and decode to an exact partition
        raw = text.encode("utf-8")
        bpieces = cut_document(raw, target, "keep")
        assert b"".join(bpieces) == raw and len(bpieces) > 1
        pos = 0
        for p in bpieces[:-1]:
            pos += len(p.decode("utf-8"))  # every piece is whole characters
            assert boundary_ok(text, pos)
    assert cut_document("short", 10, "keep") == ["short"]
    assert cut_document("a b" * 100, 10, None) == ["a b" * 100]
    assert cut_document("x" * 100 + " y", 10, "keep") == ["x" * 100, " y"]  # no boundary: a long piece
    assert cut_document("x" * 100, 10, "keep") == ["x" * 100]
    assert cut_document("a\n\nb c\n\nd e f g", 12, "keep") == ["a\n\nb c\n\nd", " e f g"]  # after the paragraph
    with pytest.raises(ValueError, match="unknown cut mode"):
        cut_document("a b c", 2, "middle")


def _sp_plain(d, **opts):
    """A SentencePiece model trained with sentencepiece's own defaults (NFKC, whitespace collapsed,
    dummy prefix) and the given changes."""
    import sentencepiece as spm

    prefix = str(d / f"plain_{abs(hash(tuple(sorted(opts.items()))))}")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sample_texts(200)), model_prefix=prefix, vocab_size=400,
                                   hard_vocab_limit=False, minloglevel=2, byte_fallback=True, **opts)
    return prefix + ".model"


def _hf_dir(d, name, normalizer=None, pre_tokenizer=None, vocab=600):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    pre = {"gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False),
           "llama3": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
           "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
           "metaspace": pre_tokenizers.Metaspace(),
           "bytes_only": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
           "odd_split": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\n\n"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
           }[pre_tokenizer]
    tok = Tokenizer(models.BPE(byte_fallback=pre_tokenizer == "metaspace", unk_token=None))
    tok.pre_tokenizer = pre
    if normalizer == "nfc":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.Metaspace() if pre_tokenizer == "metaspace" else decoders.ByteLevel()
    alphabet = [] if pre_tokenizer == "metaspace" else pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(sample_texts(200) + [tricky_text(9, 400)], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet, show_progress=False))
    out = d / name
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return str(out)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from megatron_ru.convert.tokenizer_files import sentencepiece_to_llama_fast

    d = tmp_path_factory.mktemp("cuts")
    vocab, merges = make_gpt2_bpe_files(d)
    sp = make_sentencepiece(d)
    llama2_sp = make_sentencepiece(d, add_dummy_prefix=True, name="dummy")
    (d / "llama2_hf").mkdir()
    sentencepiece_to_llama_fast(llama2_sp, str(d / "llama2_hf"))
    cfg = {
        "sp_bpe": TokenizerConfig("GPTSentencePieceTokenizer", sp),
        "sp_megatron": TokenizerConfig("SentencePieceTokenizer", sp),
        "sp_unigram": TokenizerConfig("GPTSentencePieceTokenizer", make_sentencepiece(d, "unigram")),
        "sp_dummy_prefix": TokenizerConfig("GPTSentencePieceTokenizer", llama2_sp),
        "sp_nfkc_collapse": TokenizerConfig("GPTSentencePieceTokenizer", _sp_plain(d)),
        "sp_nfkc_unigram": TokenizerConfig("GPTSentencePieceTokenizer", _sp_plain(d, model_type="unigram")),
        "gpt2": TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        "hf_gpt2": TokenizerConfig("HuggingFaceTokenizer", make_hf_tokenizer_dir(d)),
        "hf_llama3": TokenizerConfig("HuggingFaceTokenizer", _hf_dir(d, "l3", pre_tokenizer="llama3")),
        "hf_qwen2": TokenizerConfig("HuggingFaceTokenizer", _hf_dir(d, "q2", "nfc", "qwen2")),
        "hf_metaspace": TokenizerConfig("HuggingFaceTokenizer", _hf_dir(d, "ms", pre_tokenizer="metaspace")),
        "hf_llama2": TokenizerConfig("HuggingFaceTokenizer", str(d / "llama2_hf")),
        # no proof of a safe cut: never cut
        "hf_no_regex": TokenizerConfig("HuggingFaceTokenizer", _hf_dir(d, "nr", pre_tokenizer="bytes_only")),
        "hf_unknown_split": TokenizerConfig("HuggingFaceTokenizer", _hf_dir(d, "us", pre_tokenizer="odd_split")),
        "sp_collapse_no_prefix": TokenizerConfig("GPTSentencePieceTokenizer", _sp_plain(d, add_dummy_prefix=False)),
        "tiktoken_llama3": TokenizerConfig("TikTokenizer", make_tiktoken_file(d)),
        "null": TokenizerConfig("NullTokenizer", vocab_size=100000),
    }
    return {k: build_tokenizer(c) for k, c in cfg.items()}


EXPECTED_MODE = {"sp_bpe": "keep", "sp_megatron": "keep", "sp_unigram": "keep", "sp_dummy_prefix": "drop",
                 "sp_nfkc_collapse": "keep", "sp_nfkc_unigram": "keep", "gpt2": "keep", "hf_gpt2": "keep",
                 "hf_llama3": "keep", "hf_qwen2": "keep", "hf_metaspace": "keep", "hf_llama2": "drop",
                 "hf_no_regex": None, "hf_unknown_split": None, "sp_collapse_no_prefix": None, "null": "keep",
                 "tiktoken_llama3": "keep"}


@pytest.mark.parametrize("name", sorted(EXPECTED_MODE))
def test_cut_mode_per_tokenizer_and_pieces_equal_whole(tokenizers, name):
    tok = tokenizers[name]
    assert tok.cut_mode == EXPECTED_MODE[name], tok.cut_reason
    assert (tok._tie_runs is not None) == (name == "sp_unigram")  # the only model with "▁▁" and no collapsing
    if name == "null":
        text = " ".join(str(random.Random(0).randrange(100000)) for _ in range(3000))
        texts = [text, text.replace(" ", "\n", 50)]
    else:
        texts = [tricky_text(s) for s in range(3)] + ["\n\n".join(sample_texts(60, seed=3))]
    for text in texts:
        whole = tok.tokenize(text)
        for raw in ((False, True) if tok.accepts_utf8_bytes else (False,)):
            for target in (16, 101, 997):
                src = text.encode("utf-8") if raw else text
                pieces = cut_document(src, target, tok.cut_mode, tok.cut_guards, tok.cut_start(src))
                if tok.cut_mode is None:
                    assert pieces == [src]
                    continue
                first_cut = tok.cut_start(src)
                if first_cut:  # Unigram with whitespace-only pieces: every run of 3+ spaces in the first piece
                    assert len(pieces[0]) >= first_cut - 1 and name == "sp_unigram"
                else:
                    assert len(pieces) > 10
                got = [i for a in tok.tokenize_batch_arrays(pieces, num_threads=2) for i in a.tolist()]
                assert got == whole, (name, raw, target)


def test_unproven_cuts_do_change_ids(tokenizers):
    """Why those tokenizers are never cut: the same word-boundary cuts change their ids."""
    text = tricky_text(0)
    for name in ("hf_no_regex", "hf_unknown_split", "sp_collapse_no_prefix"):
        tok = tokenizers[name]
        pieces = cut_document(text, 101, "keep")
        assert [i for p in pieces for i in tok.tokenize(p)] != tok.tokenize(text), name
    # Unigram: a run of 3+ spaces after a cut may take another of its equal-score segmentations
    tok = tokenizers["sp_unigram"]
    text = tricky_text(0)
    assert tok.cut_start(text) > len(text) // 2
    pieces = cut_document(text, 101, "keep")
    assert [i for p in pieces for i in tok.tokenize(p)] != tok.tokenize(text)
    # and a paragraph break is no safe cut for LLaMA-3's pattern (a run of blank lines is one token)
    tok = tokenizers["hf_llama3"]
    assert tok.tokenize("model\n") + tok.tokenize("\ntext") != tok.tokenize("model\n\ntext")


def test_cut_start_fast_path_equals_the_regex(tokenizers):
    """cut_start finds the last run of 3+ spaces with rfind when the text has no other space
    characters; it must give the regex's answer on any text, str and UTF-8 alike."""
    from megatron_ru.data.tokenizer import _SPACE_RUNS

    tok = tokenizers["sp_unigram"]
    rng = random.Random(0)
    alphabet = ["a", " ", "  ", "   ", "    ", "\u00a0", "\u3000", "\u2009", "\u202f", "\u205f", "\u200a",
                "\u200b", "ж", "—", "…", "\n"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for x in (text, text.encode("utf-8")):
            ends = [m.end() for m in _SPACE_RUNS[isinstance(x, bytes)].finditer(x)]
            assert tok.cut_start(x) == (ends[-1] + 1 if ends else 0), repr(x)


def _cut_mode_from_protobuf(sp) -> tuple:
    """The reference for sentencepiece_cut_mode: the settings read from the model's protobuf."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    if any("\u2581" in p.piece.lstrip("\u2581") for p in proto.pieces):
        return None, False
    spec = proto.normalizer_spec
    ties = (proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM and not spec.remove_extra_whitespaces
            and any(len(p.piece) > 1 and not p.piece.strip("\u2581") for p in proto.pieces))
    if spec.add_dummy_prefix:
        return ("keep" if spec.remove_extra_whitespaces else "drop"), ties
    return (None if spec.remove_extra_whitespaces else "keep"), ties


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_cut_mode_asks_the_normalizer_what_the_protobuf_says(tmp_path, kind):
    """The cut mode is worked out from the normalizer's behaviour and the pieces (no protobuf import
    at start-up); it must agree with the protobuf's settings for every combination of them."""
    import itertools

    seen = set()
    for dummy, collapse, suffix, norm in itertools.product([True, False], [True, False], [False, True],
                                                           ["identity", "nmt_nfkc"]):
        model = _sp_plain(tmp_path, model_type=kind, add_dummy_prefix=dummy, remove_extra_whitespaces=collapse,
                          treat_whitespace_as_suffix=suffix, normalization_rule_name=norm,
                          allow_whitespace_only_pieces=True)
        tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model))
        got = (tok.cut_mode, tok._tie_runs is not None)
        assert got == _cut_mode_from_protobuf(tok.sp), (dummy, collapse, suffix, norm, tok.cut_reason)
        seen.add(got)
    # every outcome the settings can give is among the cases (Unigram: ties wherever spaces are kept)
    if kind == "unigram":
        assert seen == {("keep", True), ("keep", False), ("drop", True), (None, False)}, seen
    else:
        assert seen == {("keep", False), ("drop", False), (None, False)}, seen
