"""The vocabulary map behind tools/adapt_vocab.py (ADAPTATION.md step 2) and extend mode's merged
tokenizers: each new token's old pieces spell exactly its text; kept rows are the old rows bit for
bit; chosen tokens (a byte token, a word-start piece, a multi-piece word, a special token, a
fallback) get the hand-computed mean; an extended tokenizer keeps every old id and encodes text in
the old language exactly as before."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ru.adapt.extend_tokenizer import extend_tokenizer
from megatron_ru.inference.model_io import load_tokenizer
from megatron_ru.data.token_text import token_texts
from megatron_ru.adapt.vocab_map import build_vocab_map, piece_weights
from megatron_ru.convert.tokenizer_files import TokenizerSource
from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
from tests.fixtures.tokenizers import language_texts, make_hf_tokenizer_dir, make_sentencepiece


texts = language_texts


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("vocab_map"))
    en, ru = texts("en", 150, 1), texts("ru", 150, 2)
    return {
        "en": make_sentencepiece(d, vocab=600, texts=en, name="en"),
        "en_dummy": make_sentencepiece(d, vocab=600, texts=en, name="en_dummy", add_dummy_prefix=True),
        "ru": make_sentencepiece(d, vocab=600, texts=ru, name="ru", user_defined_symbols=["<|im_start|>"]),
        "en_hf": make_hf_tokenizer_dir(os.path.join(d, "hf_en"), vocab=400, texts=en),
        "dir": d, "en_texts": en, "ru_texts": ru,
    }


@pytest.mark.parametrize("old_name", ["en", "en_dummy", "en_hf"])
def test_pieces_spell_the_new_token(toks, old_name):
    """Every new token's old pieces concatenate to its text (with a dummy prefix: the mid-word tokens
    do not get a word-start piece); kept tokens are exactly one old token with the same text."""
    old = load_tokenizer(TokenizerSource("HuggingFaceTokenizer" if old_name == "en_hf" else
                                         "GPTSentencePieceTokenizer", toks[old_name]))
    new = GPTSentencePieceTokenizer(toks["ru"])
    vmap = build_vocab_map(old, new)
    ot, nt = token_texts(old), token_texts(new)
    assert vmap.new_size == new.vocab_size and vmap.old_size == old.vocab_size
    counts = vmap.counts()
    assert counts["kept"] > 0 and counts["pieces"] > 100 and sum(counts.values()) == new.vocab_size
    for i, kind in enumerate(vmap.kind):
        if kind == "kept":
            assert ot.pieces[vmap.pieces[i][0]] == nt.pieces[i]
        elif kind == "pieces":
            assert b"".join(ot.pieces[j] for j in vmap.pieces[i]) == nt.pieces[i], (i, nt.display(i))
            assert sum(vmap.weights[i]) == pytest.approx(1.0)


def test_rows_equal_hand_computed_means(toks):
    old, new = GPTSentencePieceTokenizer(toks["en"]), GPTSentencePieceTokenizer(toks["ru"])
    vmap = build_vocab_map(old, new)
    ot, nt = token_texts(old), token_texts(new)
    torch.manual_seed(0)
    emb = torch.randn(old.vocab_size + 4, 16)          # more rows than the tokenizer (padding, as Qwen)
    out = vmap.convert(emb)
    weighted = vmap.convert(emb, weighted=True)

    def new_id(piece: str) -> int:
        return new.sp.piece_to_id(piece)

    # kept rows: bit-identical (the byte tokens both tokenizers have)
    byte = new_id("<0xD0>")
    assert vmap.kind[byte] == "kept" and torch.equal(out[byte], emb[old.sp.piece_to_id("<0xD0>")])
    kept = [i for i, k in enumerate(vmap.kind) if k == "kept"]
    assert torch.equal(out[kept], emb[[vmap.pieces[i][0] for i in kept]])
    # a word-start piece and a multi-piece word: the mean of the old tokenizer's pieces, hand-computed
    word_start = next(i for i in range(new.vocab_size) if nt.pieces[i] and nt.pieces[i].startswith(b" ")
                      and len(nt.pieces[i]) > 3 and vmap.kind[i] == "pieces")
    multi = next(i for i in range(new.vocab_size) if nt.pieces[i] and not nt.pieces[i].startswith(b" ")
                 and len(nt.pieces[i].decode("utf-8", "replace")) >= 3 and vmap.kind[i] == "pieces")
    for i in (word_start, multi):
        ids = old.tokenize(nt.pieces[i].decode("utf-8"))
        assert len(ids) > 1
        want = emb[ids].double().mean(0).float()
        assert torch.allclose(out[i], want, atol=1e-6, rtol=0), nt.display(i)
        w = piece_weights([ot.pieces[j] for j in ids])
        want_w = (emb[ids].double() * torch.tensor(w, dtype=torch.float64)[:, None]).sum(0).float()
        assert torch.allclose(weighted[i], want_w, atol=1e-6, rtol=0)
    # a special token matched by its string
    eos = new.sp.eos_id()
    assert vmap.kind[eos] == "special" and torch.equal(out[eos], emb[old.sp.eos_id()])
    unk = new.sp.unk_id()                               # both have <unk>: matched as a special
    assert vmap.kind[unk] == "special"
    # a user-defined symbol is spelled by old pieces ("<", "|", ...), not a fallback
    assert vmap.kind[new_id("<|im_start|>")] == "pieces"
    # a fallback: pieces whose rows average to the zero vector get the mean of all old rows
    zeroed = emb.clone()
    zeroed[vmap.pieces[multi]] = 0.0
    got, fallbacks = vmap.convert_with_fallbacks(zeroed)
    mean_all = zeroed[:old.vocab_size].double().mean(0).float()
    assert multi in fallbacks and torch.allclose(got[multi], mean_all, atol=1e-6, rtol=0)
    assert not set(fallbacks) & set(kept)               # kept rows are copied, even zero ones
    _, none = vmap.convert_with_fallbacks(emb)
    assert none == [i for i, k in enumerate(vmap.kind) if k == "fallback"]


def test_weights_rule():
    assert piece_weights([b"a", b"b"]) == pytest.approx([2 / 3, 1 / 3])
    assert piece_weights([b" ", b"ab"]) == pytest.approx([0.1 / 0.6, 0.5 / 0.6])
    assert piece_weights([b" ", b" "]) == pytest.approx([2 / 3, 1 / 3])


@pytest.mark.parametrize("old_name", ["en", "en_hf"])
def test_extend_keeps_old_ids_and_old_text_encoding(toks, old_name, tmp_path):
    kind = "HuggingFaceTokenizer" if old_name == "en_hf" else "GPTSentencePieceTokenizer"
    old_source = TokenizerSource(kind, toks[old_name])
    old, new = load_tokenizer(old_source), GPTSentencePieceTokenizer(toks["ru"])
    ot, nt = token_texts(old), token_texts(new)
    ext = extend_tokenizer(old_source, ot, nt, str(tmp_path / "merged"), pattern="[а-яё]")
    merged = load_tokenizer(ext.tokenizer)
    mt = token_texts(merged)
    assert ext.tokenizer.type == kind                  # saved in the old tokenizer's format
    assert merged.vocab_size == old.vocab_size + len(ext.appended) + ext.intermediates and len(ext.appended) > 50
    assert mt.pieces[:old.vocab_size] == ot.pieces      # every old id unchanged
    # every added token holds (part of) a Cyrillic letter: the new tokens themselves, and the intermediate
    # tokens the splice's merges produce on the way (byte-level: a lead byte 0xD0/0xD1 without its partner)
    assert all(0xD0 in b or 0xD1 in b for b in mt.pieces[old.vocab_size:])
    assert all(any("а" <= c <= "я" or c == "ё" for c in nt.pieces[i].decode().lower()) for i in ext.appended)
    for text in toks["en_texts"][:40] + texts("en", 20, 99):
        assert merged.tokenize(text) == old.tokenize(text)
    ru = texts("ru", 20, 98)
    n_old = sum(len(old.tokenize(t)) for t in ru)
    n_merged = sum(len(merged.tokenize(t)) for t in ru)
    assert n_merged < 0.7 * n_old
    if old_name == "en_hf":   # spliced merges: every appended token is reachable, so extend compresses as the
        n_new = sum(len(new.tokenize(t)) for t in ru)   # new tokenizer alone does (2.49 vs 4.51 before, SmolLM2)
        assert n_merged <= 1.1 * n_new, (n_merged, n_new)
        for i in ext.appended:                          # each appended token's text encodes to that token
            text = nt.pieces[i].decode("utf-8")
            if not text.startswith(" "):
                continue
            assert [mt.pieces[j] for j in merged.tokenize(text)] == [nt.pieces[i]], text
    for t in ru:                                        # still lossless
        assert b"".join(mt.pieces[i] for i in merged.tokenize(t)) == t.encode()
    # the appended tokens come from the tokenizer model, not from added-token matching
    vmap = build_vocab_map(old, merged, ot, mt)
    assert vmap.kind[:old.vocab_size] == ["kept" if ot.pieces[i] is not None else "special"
                                          for i in range(old.vocab_size)]
    assert vmap.pieces[:old.vocab_size] == [[i] for i in range(old.vocab_size)]


def test_extend_refusals(toks, tmp_path):
    old_source = TokenizerSource("GPTSentencePieceTokenizer", toks["en"])
    old, new = load_tokenizer(old_source), GPTSentencePieceTokenizer(toks["ru"])
    with pytest.raises(ValueError, match="--extend-filter 'qqq' .*nothing to add"):
        extend_tokenizer(old_source, token_texts(old), token_texts(new), str(tmp_path / "a"), pattern="qqq")
    with pytest.raises(ValueError, match="--extend-filter .*not a regular expression"):
        extend_tokenizer(old_source, token_texts(old), token_texts(new), str(tmp_path / "b"), pattern="[")
    unigram = make_sentencepiece(toks["dir"], kind="unigram", vocab=600, texts=toks["en_texts"], name="uni")
    with pytest.raises(ValueError, match="UNIGRAM model; only BPE"):
        extend_tokenizer(TokenizerSource("GPTSentencePieceTokenizer", unigram),
                         token_texts(GPTSentencePieceTokenizer(unigram)), token_texts(new), str(tmp_path / "c"))


def test_byte_fallback_pieces_get_the_rows_the_old_tokenizer_produces(toks):
    """A byte-fallback SentencePiece vocabulary holds ``<0x2E>`` and ``.`` with the same text; the
    old tokenizer produces ``.`` for ".", so a new ``.`` gets that row, not the (in real models
    nearly untrained) byte token's. Every new token's row is the mean of the rows of the ids the
    old tokenizer produces for its text; a byte that is no character alone gets the old byte token."""
    old, new = GPTSentencePieceTokenizer(toks["en"]), GPTSentencePieceTokenizer(toks["ru"])
    ot, nt = token_texts(old), token_texts(new)
    assert ot.byte_ids and len(ot.byte_ids) == 256
    vmap = build_vocab_map(old, new, ot, nt)
    torch.manual_seed(0)
    emb = torch.randn(old.vocab_size, 8, dtype=torch.float64)
    out = vmap.convert(emb)
    checked = single = 0
    for i, b in enumerate(nt.pieces):
        if b is None:
            continue
        try:
            ids = old.tokenize(b.decode("utf-8"))
        except UnicodeDecodeError:
            ids = [old.sp.piece_to_id(f"<0x{b[0]:02X}>")] if len(b) == 1 else None
        if ids is None:
            continue
        assert vmap.pieces[i] == ids, (nt.display(i), [ot.display(j) for j in vmap.pieces[i]],
                                       [ot.display(j) for j in ids])
        assert torch.allclose(out[i], emb[ids].mean(0), atol=1e-12, rtol=0), nt.display(i)
        checked += 1
        single += len(b.decode("utf-8", "replace")) == 1 and not set(ids) & ot.byte_ids
    assert checked > 500 and single > 20              # "." "е" "▁" ... each got the old piece, not a byte row
    dot = new.sp.piece_to_id(".")
    assert vmap.pieces[dot] == [old.sp.piece_to_id(".")] != [old.sp.piece_to_id("<0x2E>")]


def _byte_level_without_unk(tmpdir, texts_: list[str]) -> str:
    """A byte-level BPE Hugging Face tokenizer with no ``<unk>`` and only the bytes its text has (as
    SmolLM2's lacks most control bytes): SentencePiece's ``<unk>`` and byte tokens such as ``<0x00>``
    or ``<0xFF>`` have no old pieces."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out = os.path.join(str(tmpdir), "bytelevel_no_unk")
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts_, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        show_progress=False))
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
    return out


@pytest.mark.parametrize("init", ["mean", "weighted-mean", "random"])
def test_replace_with_a_byte_level_old_tokenizer_without_unk(toks, tmp_path, init):
    """``adapt_vocab --mode replace`` used to raise ZeroDivisionError here: new tokens without any old
    piece (the new ``<unk>``; byte tokens for bytes the old vocabulary cannot spell) get the mean of
    all old rows, counted in the report."""
    import argparse

    from megatron_ru.adapt.adapt_vocab import add_arguments, adapt_vocab
    from megatron_ru.inference.model_io import open_model
    from tests.fixtures.models import tiny_llama

    old_dir = _byte_level_without_unk(tmp_path, toks["en_texts"] + toks["ru_texts"])
    old = load_tokenizer(TokenizerSource("HuggingFaceTokenizer", old_dir))
    new = GPTSentencePieceTokenizer(toks["ru"])
    vmap = build_vocab_map(old, new)
    no_pieces = [i for i, k in enumerate(vmap.kind) if k == "fallback"]
    unk = new.sp.unk_id()
    assert unk in no_pieces and new.sp.piece_to_id("<0x00>") in no_pieces and new.sp.piece_to_id("<0xFF>") in no_pieces
    model = tiny_llama(str(tmp_path / "model"), vocab_size=old.vocab_size, tokenizer_dir=old_dir,
                       eos_token_id=old.eod)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", model, "--new-tokenizer", toks["ru"], "--mode", "replace", "--init", init,
                         "--save", str(tmp_path / "out"), "--output-format", "hf"])
    report = adapt_vocab(args)
    assert report["fallback"] == len(no_pieces) and report["fallback_no_pieces"] == len(no_pieces)
    src, out = open_model(model), open_model(str(tmp_path / "out"))
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name not in src.names():
            continue
        mean_all = src.get(name)[:old.vocab_size].double().mean(0).float()
        got = out.get(name)
        for i in no_pieces:
            if init == "random":
                assert torch.isfinite(got[i]).all()
            else:
                assert torch.allclose(got[i], mean_all, atol=1e-6, rtol=0), (name, i)


def test_random_inits_say_which_rows_they_draw(toks, tmp_path):
    """``--init random`` draws only the rows adaptation computes (kept and matched special tokens keep
    their old rows, and the report says how many were drawn); ``--init random-all`` draws every row."""
    import argparse

    from megatron_ru.adapt.adapt_vocab import add_arguments, adapt_vocab
    from megatron_ru.inference.model_io import open_model
    from megatron_ru.model.spec import WORD_EMBEDDING_WEIGHT
    from tests.fixtures.models import tiny_llama

    old, new = GPTSentencePieceTokenizer(toks["en"]), GPTSentencePieceTokenizer(toks["ru"])
    vmap = build_vocab_map(old, new)
    exact = [i for i, k in enumerate(vmap.kind) if k in ("kept", "special")]
    assert exact
    model = tiny_llama(str(tmp_path / "model"), vocab_size=old.vocab_size)
    p = argparse.ArgumentParser()
    add_arguments(p)
    src = open_model(model).get(WORD_EMBEDDING_WEIGHT)
    for init in ("random", "random-all"):
        out_dir = str(tmp_path / init)
        report = adapt_vocab(p.parse_args(["--model", model, "--old-tokenizer", toks["en"], "--new-tokenizer",
                                           toks["ru"], "--init", init, "--save", out_dir]))
        got = open_model(out_dir).get(WORD_EMBEDDING_WEIGHT)
        same = [i for i in exact if torch.equal(got[i], src[vmap.pieces[i][0]])]
        if init == "random":
            assert report["random_rows"] == new.vocab_size - len(exact) and same == exact
        else:
            assert report["random_rows"] == new.vocab_size and same == []
            with open(os.path.join(out_dir, "vocab_adaptation.json")) as f:
                assert json.load(f)["new_rows"] == [[0, new.vocab_size]]
