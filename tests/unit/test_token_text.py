"""Every tokenizer's ids map to the exact bytes of the text they encode (adaptation and bits per byte
rest on this): concatenating the pieces of ``tokenize(text)`` gives the text back byte for byte."""
from __future__ import annotations

import os

import pytest

from megatron_ru.data.token_text import byte_and_char_counts, token_texts
from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer, NullTokenizer, SentencePieceTokenizer
from tests.fixtures.tokenizers import make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece, sample_texts


def _tokenizers(tmp):
    from megatron_ru.convert.tokenizer_files import sentencepiece_to_llama_fast
    from megatron_ru.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
    from megatron_ru.data.tokenizers.huggingface import HuggingFaceTokenizer
    sp = make_sentencepiece(tmp)
    sp_dummy = make_sentencepiece(tmp, name="sp_dummy", add_dummy_prefix=True)
    llama = os.path.join(tmp, "llama_fast")
    sentencepiece_to_llama_fast(sp_dummy, llama)
    yield "sentencepiece", GPTSentencePieceTokenizer(sp)
    yield "megatron-sentencepiece", SentencePieceTokenizer(sp)
    yield "sentencepiece-dummy-prefix", GPTSentencePieceTokenizer(sp_dummy)
    yield "hf-byte-level", HuggingFaceTokenizer(make_hf_tokenizer_dir(tmp))
    yield "hf-metaspace-byte-fallback", HuggingFaceTokenizer(llama)
    yield "gpt2-bpe", GPT2BPETokenizer(*make_gpt2_bpe_files(tmp))


def test_pieces_concatenate_to_the_text(tmp_path):
    # byte tokens (emoji, rare letters fall back to <0xNN>), word starts, double spaces, newlines
    texts = sample_texts(20, seed=5) + ["Щука 🦜 ёж  — «цитата»\n\nend", " leading space"]
    for name, tok in _tokenizers(str(tmp_path)):
        tt = token_texts(tok)
        nbytes, nchars = byte_and_char_counts(tt)
        assert len(tt) == tok.vocab_size, name
        assert tok.eod in tt.specials.values() and tt.is_special(tok.eod), name
        for text in texts:
            ids = tok.tokenize(text)
            got = b"".join(tt.pieces[i] for i in ids)
            want = ((" " if tt.dummy_prefix else "") + text).encode("utf-8")
            assert got == want, (name, text)
            assert int(nbytes[ids].sum()) == len(want) and int(nchars[ids].sum()) == len(want.decode()), name
    assert tt.dummy_prefix is False


def test_megatron_sentencepiece_extra_tokens_are_special(tmp_path):
    tok = SentencePieceTokenizer(make_sentencepiece(str(tmp_path)))
    tt = token_texts(tok)
    assert {"<EOD>", "<CLS>", "<SEP>", "<MASK>", "</s>"} <= set(tt.specials)
    assert tt.specials["<EOD>"] == tok.eod and tt.pieces[tok.eod] is None
    nbytes, _ = byte_and_char_counts(tt)
    assert nbytes[tok.eod] == 0


def test_null_tokenizer_has_no_text():
    with pytest.raises(ValueError, match="NullTokenizer"):
        token_texts(NullTokenizer(10))
