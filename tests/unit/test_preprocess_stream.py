"""Huge JSON strings streamed from their line to the tokenizer (commit "a huge JSON string is
decoded, cut and tokenized as a stream"): cuts.cut_stream against cut_document, the C++ span mode
of extract_strings_batch and unescape_span against json.loads, and Encoder's streamed documents
against the whole text's ids for every tokenizer type, blank and invalid huge values included."""
from __future__ import annotations

import functools
import json
import random
import re
import threading

import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.preprocess import encode as encode_module
from megatron_ru.data.preprocess._jsonl import extract_strings, extract_strings_batch, unescape_span
from megatron_ru.data.preprocess.cuts import cut_document, cut_stream
from megatron_ru.data.preprocess.encode import EncodeOptions, Encoder, Span, _split_point
from megatron_ru.data.preprocess.reader import Batch, MappedLines, Segment, read_batches
from megatron_ru.data.tokenizer import NullTokenizer, build_tokenizer
from tests.fixtures.tokenizers import (make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece,
                                      make_tiktoken_file, sample_texts, tricky_text)

# ---------------------------------------------------------------------------------------------
# 1. cut_stream gives cut_document's pieces for any chunking
# ---------------------------------------------------------------------------------------------

_CUT_ATOMS = ["word", "слово", "ab", "x", "日本語", "😀", "é", " ", " ", " ", " ", "  ", "   ", "\n", "\n\n",
              "<EOD>", "<|endoftext|>", "\u00a0", "\t", ".", "ё"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_CUT_ATOMS) for _ in range(rng.randint(0, rng.choice([20, 120, 500]))))


def _random_chunks(rng: random.Random, text):
    """``text`` in random parts: single characters (bytes: single bytes, which split every UTF-8
    character), random sizes, or one part; now and then an empty part."""
    style = rng.randrange(4)
    if style == 0:
        parts = [text[i:i + 1] for i in range(len(text))]
    elif style == 3:
        parts = [text]
    else:
        parts, i = [], 0
        while i < len(text):
            n = rng.randint(0 if rng.random() < 0.1 else 1, 4 if style == 1 else 40)
            parts.append(text[i:i + n])
            i += n
    return parts or [text[:0]]


def test_cut_stream_gives_cut_documents_pieces_for_any_chunking():
    rng = random.Random(20261126)
    multi = 0
    for trial in range(6000):
        text = _random_text(rng)
        if rng.random() < 0.5:
            text = text.encode("utf-8")
        target = rng.choice([1, 2, rng.randint(3, 12), rng.randint(13, 80)])
        mode = rng.choice(["keep", "drop"])
        guards = rng.choice([(), ("<EOD>",), ("<EOD>", "<|endoftext|>")])
        first_cut = rng.choice([0, 0, rng.randint(0, len(text) + 1), len(text) + rng.randint(0, 3)])
        want = cut_document(text, target, mode, guards, first_cut)
        chunks = _random_chunks(rng, text)
        assert text[:0].join(chunks) == text
        got = list(cut_stream(iter(chunks), target, mode, guards, first_cut))
        assert got == want, (trial, text, target, mode, guards, first_cut, [len(c) for c in chunks])
        multi += len(want) > 2
    assert multi > 1500, multi  # the texts were cut, mostly in several places
    # mode None: the whole text, joined
    assert list(cut_stream(iter(["a b", " c d"]), 1, None)) == ["a b c d"]
    assert list(cut_stream(iter([b"\xd0", b"\xb4 \xd0\xb4"]), 1, None)) == ["д д".encode()]


def _boundaries(text: str) -> list[int]:
    return [i for i in range(1, len(text) - 1)
            if text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace()]


def test_cut_document_at_target_one_terminates_and_cuts_at_every_word_boundary():
    """``--tokenize-chunk-chars 1`` used to loop forever (an empty piece at the same boundary)."""
    text = tricky_text(4, 400)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(
        keep=cut_document(text, 1, "keep"), drop=cut_document(text, 1, "drop"),
        raw=cut_document(text.encode("utf-8"), 1, "keep")), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "cut_document(text, 1, ...) does not terminate"
    n = len(_boundaries(text))
    assert n > 100
    assert "".join(out["keep"]) == text and len(out["keep"]) == n + 1
    assert " ".join(out["drop"]) == text and len(out["drop"]) == n + 1
    assert b"".join(out["raw"]) == text.encode("utf-8") and len(out["raw"]) == n + 1
    assert cut_document("a b  c d", 1, "keep") == ["a", " b  c", " d"]


# ---------------------------------------------------------------------------------------------
# 2. extract_strings_batch(..., span_min): spans of long values, checked; unescape_span
# ---------------------------------------------------------------------------------------------

KEYS = ["text", "domain"]
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
_VALUE_ATOMS = ["abc", "word ", " ", "  ", "   ", "слово ", "é", "😀", "\U0010ffff", "日本", "\n", '"', "\\", "/",
                "\t", "\r", "\x00", "\x01", "\x1f", "\x7f", "\u2028", "\u00a0", "\u3000", "\ufeff", "ё"]


def _u_escape(ch: str, rng: random.Random) -> str:
    fmt = rng.choice(["\\u%04x", "\\u%04X"])
    cp = ord(ch)
    if cp < 0x10000:
        return fmt % cp
    cp -= 0x10000
    return fmt % (0xD800 + (cp >> 10)) + fmt % (0xDC00 + (cp & 0x3FF))


def json_literal(s: str, rng: random.Random, ensure_ascii: bool) -> str:
    """``s`` as a JSON string literal, each character written one of the ways JSON allows: raw,
    a short escape, ``\\/``, a ``\\u`` escape (surrogate pairs above U+FFFF), chosen at random;
    ``ensure_ascii`` as json.dumps (every non-ASCII character escaped)."""
    out = []
    for ch in s:
        if ch in _SHORT_ESCAPES and (ch in '"\\' or rng.random() < 0.8):
            out.append(_SHORT_ESCAPES[ch])
        elif ord(ch) < 0x20 or ch in '"\\':
            out.append(_u_escape(ch, rng))
        elif ch == "/":
            out.append(rng.choice(["/", "\\/"]))
        elif ord(ch) > 0x7F and (ensure_ascii or rng.random() < 0.2):
            out.append(_u_escape(ch, rng))
        elif rng.random() < 0.03:  # e.g. a space as \u0020
            out.append(_u_escape(ch, rng))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _random_json_line(rng: random.Random, long: int) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A JSON object line (keys maybe repeated, values of every type) and, per key, the (start, end)
    byte offsets of the contents of the last occurrence's string value (absent: not a string)."""
    ensure_ascii = rng.random() < 0.3
    line = rng.choice(["", " ", "\t"]) + "{"
    where: dict[str, tuple[int, int]] = {}
    for i in range(rng.randint(0, 5)):
        key = rng.choice(KEYS + KEYS + ["meta", "id", "текст"])
        if i:
            line += rng.choice([",", ", ", " ,\t"])
        line += json_literal(key, rng, ensure_ascii) + rng.choice([":", ": ", " : "])
        kind = rng.random()
        if kind < 0.75:
            value = "".join(rng.choice(_VALUE_ATOMS) for _ in range(rng.randint(0, rng.choice([3, long]))))
            lit = json_literal(value, rng, ensure_ascii) if rng.random() < 0.7 else \
                json.dumps(value, ensure_ascii=ensure_ascii)
            start = len(line.encode("utf-8")) + 1
            line += lit
            where[key] = (start, len(line.encode("utf-8")) - 1)
        else:
            line += json.dumps(rng.choice([0, -1.5e3, True, None, [1, "x", {"text": "in"}], {"text": "nested"}]))
            where.pop(key, None)
    line += "}" + rng.choice(["", " ", "\r"])
    return line.encode("utf-8"), where


def test_span_mode_gives_exact_spans_for_long_values_and_bytes_for_short_ones():
    rng = random.Random(20261127)
    lines = []
    n_spans = n_short_in_span_lines = 0
    for _ in range(1500):
        line, where = _random_json_line(rng, rng.choice([10, 60, 200]))
        span_min = rng.choice([1, 8, 40, 100, 300])
        obj = json.loads(line)  # a valid line by construction
        got = extract_strings_batch([line], KEYS, span_min)[0]
        assert got is not None, line
        assert extract_strings_batch([line], KEYS, 0)[0] == extract_strings(line, KEYS)
        for k, v in zip(KEYS, got):
            if not isinstance(obj.get(k), str):
                assert v is None, (line, k)
                continue
            start, end = where[k]
            want = obj[k].encode("utf-8")
            if len(line) >= span_min and end - start >= span_min:
                assert v == (start, end), (line, k, span_min)
                assert unescape_span(line, start, end) == want
                n_spans += 1
            else:
                assert v == want, (line, k, span_min)
                n_short_in_span_lines += len(line) >= span_min
        lines.append(line)
    assert n_spans > 300 and n_short_in_span_lines > 300
    # the batch call gives every line's answer; span_min 0 never gives a span
    for span_min in (1, 100):
        per_line = [extract_strings_batch([line], KEYS, span_min)[0] for line in lines]
        assert extract_strings_batch(lines, KEYS, span_min) == per_line
    assert extract_strings_batch(lines, KEYS) == [extract_strings(line, KEYS) for line in lines]


def test_span_min_threshold_is_inclusive():
    value = "x\\n" * 30  # 90 bytes of JSON for 60 characters
    line = b'{"text": "' + value.encode() + b'", "domain": "d"}'
    start = len(b'{"text": "')
    assert extract_strings_batch([line], KEYS, 90) == [[(start, start + 90), b"d"]]
    assert extract_strings_batch([line], KEYS, 91) == [[b"x\n" * 30, b"d"]]
    assert extract_strings_batch([line], KEYS, 1) == [[(start, start + 90), (line.rindex(b"d"), line.rindex(b"d") + 1)]]
    # a line shorter than span_min: bytes, whatever its values
    assert extract_strings_batch([line], KEYS, len(line) + 1) == [[b"x\n" * 30, b"d"]]


def _split_points(line: bytes, start: int, end: int) -> list[int]:
    """Every place in the contents ``line[start:end]`` after a literal space or at a UTF-8 lead byte."""
    return [p for p in range(start + 1, end) if line[p - 1] == 0x20 or line[p] >= 0xC0]


def test_span_decodes_in_parts_split_at_spaces_and_lead_bytes():
    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        line, where = _random_json_line(rng, 200)
        got = extract_strings_batch([line], KEYS, 30)[0]
        obj = json.loads(line)
        for k, v in zip(KEYS, got):
            if not isinstance(v, tuple):
                continue
            start, end = v
            want = obj[k].encode("utf-8")
            points = [start] + _split_points(line, start, end) + [end]
            assert b"".join(unescape_span(line, a, b) for a, b in zip(points, points[1:])) == want
            for size in (1, 3, 16, 64):
                assert b"".join(Span(line, start, end).chunks(size)) == want
            for want_at in range(start + 1, end):
                p = _split_point(line, start, want_at, end)
                assert start < p <= end and (p == end or line[p - 1] == 0x20 or line[p] >= 0xC0), (line, want_at, p)
            assert Span(line, start, end).decode() == want
            checked += 1
    assert checked > 100


_LONG = "word слово " * 20


@pytest.mark.parametrize("bad", [
    b'{"text": "' + _LONG.encode() + b'\\x", "domain": "d"}',  # unknown escape
    b'{"text": "' + _LONG.encode() + b'\\u12", "domain": "d"}',  # short \u escape
    b'{"text": "' + _LONG.encode() + b'\\ud800 x", "domain": "d"}',  # lone high surrogate
    b'{"text": "' + _LONG.encode() + b'\\ud800\\u0041", "domain": "d"}',  # high surrogate without its low one
    b'{"text": "' + _LONG.encode() + b'\\udc00", "domain": "d"}',  # lone low surrogate
    b'{"text": "' + _LONG.encode() + b'\xff", "domain": "d"}',  # invalid UTF-8
    b'{"text": "' + _LONG.encode() + b'\xc0\xaf", "domain": "d"}',  # overlong
    b'{"text": "' + _LONG.encode() + b'\xed\xa0\x80", "domain": "d"}',  # a UTF-8 encoded surrogate
    b'{"text": "' + _LONG.encode() + b'\xe2\x82", "domain": "d"}',  # a cut character
    b'{"text": "' + _LONG.encode() + b'\n", "domain": "d"}',  # a raw control character
    b'{"text": "' + _LONG.encode() + b'", "domain": "d"} x',  # trailing garbage
    b'{"text": "' + _LONG.encode() + b'", "domain": "d"}}',
    b'{"text": "' + _LONG.encode() + b'", "domain": "\\q"}',  # the short value of a span line
    b'{"text": "' + _LONG.encode() + b'", "domain": "\\ud800"}',
    b'{"text": "' + _LONG.encode() + b'", "meta": "\\udfff", "domain": "d"}',  # a value nobody asked for
    b'{"text": "' + _LONG.encode() + b'", "domain": "d"',  # unterminated object
    b'{"text": "' + _LONG.encode(),  # unterminated string
], ids=["escape", "short_u", "lone_high", "high_no_low", "lone_low", "ff", "overlong", "utf8_surrogate", "cut_char",
        "raw_newline", "trailing", "extra_brace", "short_bad_escape", "short_surrogate", "other_key", "no_brace",
        "unterminated"])
def test_invalid_lines_give_none_in_span_mode(bad):
    good = b'{"text": "' + _LONG.encode() + b'", "domain": "d"}'
    assert isinstance(extract_strings_batch([good], KEYS, 40)[0][0], tuple)
    for span_min in (0, 1, 40):
        assert extract_strings_batch([bad, good], KEYS, span_min)[0] is None, span_min
    try:  # (and they are invalid for the tool: json.loads rejects them or keeps a lone surrogate)
        obj = json.loads(bad.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    with pytest.raises(UnicodeEncodeError):
        "".join(v for v in obj.values()).encode("utf-8")


def test_unescape_span_rejects_cut_escapes_and_spans_outside_the_line():
    line = b'{"text": "ab\\ncd \\u00e9 \\ud83d\\ude00 \\\\ end"}'
    [[(s, e)]] = extract_strings_batch([line], ["text"], 1)
    assert unescape_span(line, s, e) == "ab\ncd é 😀 \\ end".encode()
    bs = line.index(b"\\n")
    assert unescape_span(line, s, bs) == b"ab"
    with pytest.raises(ValueError, match="escape"):
        unescape_span(line, s, bs + 1)  # ends just after a backslash
    u = line.index(b"\\u00e9")
    for cut in range(u + 1, u + 6):
        with pytest.raises(ValueError, match="escape"):
            unescape_span(line, s, cut)  # inside \u00e9
    hi = line.index(b"\\ud83d")
    with pytest.raises(ValueError, match="escape"):
        unescape_span(line, s, hi + 6)  # a high surrogate cut from its low one
    with pytest.raises(ValueError, match="escape"):
        unescape_span(line, hi + 6, e)  # a lone low surrogate
    assert unescape_span(line, hi, hi + 12) == "😀".encode()
    b2 = line.index(b"\\\\")
    with pytest.raises(ValueError, match="escape"):
        unescape_span(line, s, b2 + 1)  # half of an escaped backslash
    assert unescape_span(line, b2, e) == b"\\ end"
    with pytest.raises(ValueError, match="outside"):
        unescape_span(line, s, len(line) + 1)
    with pytest.raises(ValueError, match="outside"):
        unescape_span(line, e, s)
    assert unescape_span(line, len(line), len(line)) == b""


def test_duplicate_keys_the_last_one_wins_in_span_mode_too():
    long1, long2 = "first " * 20, "second " * 20
    cases = [(f'{{"text": "{long1}", "text": "short"}}', b"short"),
             (f'{{"text": "short", "text": "{long2}"}}', "long2"),
             (f'{{"text": "{long1}", "text": "{long2}"}}', "long2"),
             (f'{{"text": "{long1}", "text": 5}}', None),
             (f'{{"text": 5, "text": "{long1}"}}', "long1"),
             (f'{{"text": "{long1}", "text": ["{long2}"]}}', None),
             (f'{{"te\\u0078t": "{long1}", "text": "{long2}", "domain": "{long1}"}}', "long2")]
    for text, want in cases:
        line = text.encode()
        [[got]] = extract_strings_batch([line], ["text"], 50)
        value = json.loads(line).get("text")
        if want is None:
            assert got is None and not isinstance(value, str)
        elif isinstance(want, bytes):
            assert got == want == value.encode()
        else:
            s = line.rindex({"long1": long1, "long2": long2}[want].encode())
            assert got == (s, s + len(value)), text
            assert unescape_span(line, *got) == value.encode()
        assert extract_strings_batch([line], ["text"], 0) == [[value.encode() if isinstance(value, str) else None]]


# ---------------------------------------------------------------------------------------------
# 3. Encoder: a streamed huge document gets the whole text's ids, for every tokenizer type
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tokenizer types of tests/integration/test_preprocess_cli.py (tok_files, tokenizer_of)."""
    d = tmp_path_factory.mktemp("tok")
    vocab, merges = make_gpt2_bpe_files(d)
    cfg = {"sp": TokenizerConfig("SentencePieceTokenizer", make_sentencepiece(d)),
           "gptsp": TokenizerConfig("GPTSentencePieceTokenizer", make_sentencepiece(d)),
           "unigram": TokenizerConfig("GPTSentencePieceTokenizer", make_sentencepiece(d, "unigram")),
           "gpt2": TokenizerConfig("GPT2BPETokenizer", None, vocab, merges),
           "hf": TokenizerConfig("HuggingFaceTokenizer", make_hf_tokenizer_dir(d)),
           "tiktoken": TokenizerConfig("TikTokenizer", make_tiktoken_file(d))}
    toks = {k: build_tokenizer(c) for k, c in cfg.items()}
    for name, tok in toks.items():  # (or nothing below is streamed)
        assert tok.cut_mode is not None and tok.has_tie_runs == (name == "unigram"), name
    return toks


# a run of 3+ spaces (as Tokenizer.cut_start finds them): Unigram holds every cut back until after the last
_TIE_RUN = re.compile("[ \u00a0\u2000-\u200a\u202f\u205f\u3000]{3,}")
_EXTRAS = ['"quoted"', "back\\slash", "a/b", "\t", "\r\n", "\x7f", "e\u0301", "😀", "ё", "<EOD>", "</s>", "<s>",
           "\u2003", "Ünïcödé"]


@functools.lru_cache(maxsize=None)
def big_text(size: int, seed: int = 0, tie_runs: bool = True, u_escaped: bool = True) -> str:
    """About ``size`` UTF-8 bytes of sample paragraphs and tricky_text (scripts, emoji, specials,
    odd spacing), with quotes, backslashes, slashes, tabs and CR that JSON escapes; ``tie_runs``:
    keep the runs of 3+ spaces; ``u_escaped``: add control characters that json.dumps writes as
    ``\\u00XX`` even with ensure_ascii=False."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < size:
        p = "\n\n".join(sample_texts(25, seed=rng.randrange(10**6))) if rng.random() < 0.5 else \
            tricky_text(rng.randrange(10**6), 1500)
        words = p.split(" ")
        for _ in range(len(words) // 15):
            i = rng.randrange(len(words))
            words[i] += rng.choice(_EXTRAS) if not u_escaped or rng.random() < 0.9 else "\x01\x1f"
        parts.append(" ".join(words))
        n += len(parts[-1].encode("utf-8")) + 2
    text = "\n\n".join(parts)
    return text if tie_runs else _TIE_RUN.sub("  ", text)


def jsonl_line(text: str, style: str, **extra) -> bytes:
    """One JSONL line holding ``text``: ``raw`` (json.dumps, ensure_ascii=False, slashes written
    ``\\/``) or ``ascii`` (every non-ASCII character a ``\\u`` escape, emoji as surrogate pairs)."""
    obj = {"text": text, **extra}
    line = json.dumps(obj, ensure_ascii=style == "ascii")
    return line.replace("/", "\\/").encode("utf-8")  # ("/" occurs only inside the strings)


def encode_lines(tok, lines: list[bytes], **opts):
    """(BatchResult, indices of the lines whose 'text' was left as a span by Encoder.parse)."""
    enc = Encoder(tok, EncodeOptions(**opts))
    batch = Batch("in.jsonl", 1, b"\n".join(lines) + b"\n")
    enc.parse(batch)
    spans = [i for i, v in enumerate(batch.values or []) if v is not None and isinstance(v[0], tuple)]
    return enc.encode(batch), spans


def output_ids(out) -> list[int]:
    """The ids of an Output (one array, or the arrays of a huge document's pieces)."""
    tokens = out.tokens
    return [i for a in tokens for i in a.tolist()] if isinstance(tokens, list) else tokens.tolist()


def expected_output(tok, texts: list[str]) -> tuple[list[int], list[int]]:
    ids = [tok.tokenize(t) + [tok.eod] for t in texts]
    return [i for d in ids for i in d], [len(d) for d in ids]


@pytest.fixture
def spy(monkeypatch):
    """Counts Encoder._encode_stream calls and records what cuts.cut_stream was given and gave
    (the real functions run; nothing is replaced)."""
    record = {"streams": 0, "cuts": []}
    real_stream, real_cut = Encoder._encode_stream, encode_module.cut_stream

    def encode_stream(self, span, res):
        record["streams"] += 1
        return real_stream(self, span, res)

    def cut(chunks, target, mode, guards=(), first_cut=0):
        call = {"first_cut": first_cut, "chunks": 0, "pieces": []}
        record["cuts"].append(call)

        def counted():
            for c in chunks:
                call["chunks"] += 1
                yield c
        for piece in real_cut(counted(), target, mode, guards, first_cut):
            call["pieces"].append(piece)
            yield piece
    monkeypatch.setattr(Encoder, "_encode_stream", encode_stream)
    monkeypatch.setattr(encode_module, "cut_stream", cut)
    return record


@pytest.mark.parametrize("style", ["raw", "ascii"])
@pytest.mark.parametrize("name", ["sp", "gptsp", "unigram", "gpt2", "hf", "tiktoken"])
def test_streamed_documents_get_the_whole_texts_ids(tokenizers, spy, name, style):
    tok = tokenizers[name]
    # (Unigram: no tie run, so that it is cut; no \u escape in the raw line, so that cut_start is
    # found in the line)
    uni = name == "unigram"
    huge = big_text(1_200_000, seed=1, tie_runs=not uni, u_escaped=not uni)
    medium = big_text(20_000, seed=2, tie_runs=not uni, u_escaped=not uni)
    texts = ["Short one.  Двойной пробел.", huge, "«Ещё» короткий \"текст\" \\ /", medium, "last <EOD> line"]
    lines = [jsonl_line(t, style) for t in texts]
    assert len(lines[1]) > (1 << 20) + 100_000  # more than one STREAM_CHUNK_BYTES of JSON
    tokens, lengths = expected_output(tok, texts)
    for threads in (2, 1):
        spy["streams"], spy["cuts"] = 0, []
        res, spans = encode_lines(tok, lines, chunk_chars=2000, stream_bytes=5000, spread_threads=threads,
                                  append_eod=True)
        assert res.error is None and res.documents == 5 and res.uncut == 0
        out = res.outputs[(None, "text")]
        assert output_ids(out) == tokens, (name, style, threads)
        assert out.sequence_lengths.tolist() == lengths and out.sequences_per_document.tolist() == [1] * 5
        assert spans == [1, 3] and spy["streams"] == 2  # the streaming path was taken
        if name == "unigram" and style == "ascii":
            continue  # (a \u escape may make a space: Unigram decodes such a span whole, then cuts it)
        huge_cut = spy["cuts"][0]
        assert huge_cut["chunks"] >= 2 and huge_cut["first_cut"] == 0
        # the pieces cut_document gives for the whole text (str or UTF-8, as it was cut)
        src = huge if isinstance(huge_cut["pieces"][0], str) else huge.encode("utf-8")
        assert huge_cut["pieces"] == cut_document(src, 2000, tok.cut_mode, tok.cut_guards)
        assert len(huge_cut["pieces"]) > 300


def _with_runs(text: str, lo: float, hi: float, seed: int, end: bool = False) -> str:
    """``text`` with 150 runs of 3-6 spaces after words between fractions ``lo`` and ``hi`` of it
    (and one at its very end)."""
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(150):
        i = rng.randrange(int(lo * len(words)), int(hi * len(words)))
        words[i] += " " * rng.randint(2, 5)
    return " ".join(words) + ("   " if end else "")


@pytest.mark.parametrize("escaped", [False, True])
@pytest.mark.parametrize("where", ["early", "middle", "end"])
def test_unigram_tie_runs_in_a_streamed_document(tokenizers, spy, where, escaped):
    """A SentencePiece Unigram model segments a run of 3+ spaces by the score accumulated since the
    start of its input, so no cut may come before the last run (Tokenizer.cut_start): found in the
    line when no escape can make a space, else by decoding the text. Runs early, across the 1 MB
    chunks of the JSON string, and up to the very end; once as literal spaces (the escapes \\n \\"
    \\\\ before them shift the line's offsets from the text's), once partly written ``\\u0020``."""
    tok = tokenizers["unigram"]
    base = big_text(1_200_000, seed=3, tie_runs=False, u_escaped=False)
    lo, hi = {"early": (0.0, 0.03), "middle": (0.4, 0.95), "end": (0.9, 1.0)}[where]
    text = _with_runs(base, lo, hi, seed=len(where), end=where == "end")
    line = jsonl_line(text, "raw")
    if escaped:  # every other space of a run as \u0020: the run is there only once the string is decoded
        line = re.sub(rb"  +", lambda m: b" \\u0020" * (len(m[0]) // 2) + b" " * (len(m[0]) % 2), line)
        assert json.loads(line)["text"] == text and b"  " not in line
    whole = tok.tokenize(text)
    assert tok.cut_start(text) > {"early": 0, "middle": len(text) // 3, "end": len(text)}[where]
    target = 101
    naive = cut_document(text, target, "keep")  # cuts before the runs: other ids (what the test guards against)
    assert [i for p in tok.tokenize_batch_arrays(naive) for i in p.tolist()] != whole
    res, spans = encode_lines(tok, [line], chunk_chars=target, stream_bytes=5000, spread_threads=2, append_eod=True)
    assert spans == [0] and spy["streams"] == 1 and res.error is None
    assert output_ids(res.outputs[(None, "text")]) == whole + [tok.eod]
    assert res.uncut == (where == "end")  # a run at the very end: no cut at all
    if not escaped:  # the cuts came from the line, as they would from the whole text
        [call] = spy["cuts"]
        src = text if isinstance(call["pieces"][0], str) else text.encode("utf-8")
        assert call["first_cut"] == tok.cut_start(src)
        assert call["pieces"] == cut_document(src, target, "keep", (), tok.cut_start(src))


@pytest.mark.parametrize("name", ["unigram", "tiktoken", "hf"])
def test_a_huge_line_left_in_the_mapped_file_is_streamed(tokenizers, spy, tmp_path, monkeypatch, name):
    """A line longer than a batch stays in the mapped file (read_batches(mapped=True), what the
    tool does with worker threads): it is parsed there and its text streamed — for Unigram
    with the last tie run found in the mapped line (a mapping is neither bytes nor str: this once
    fell back to tokenizing the whole text on one thread) — and every line gets its own ids."""
    tok = tokenizers[name]
    text = _with_runs(big_text(1_200_000, seed=5, tie_runs=False, u_escaped=False), 0.0, 0.03, seed=9)
    texts = ["A short line  before.", text, "after"]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(jsonl_line(t, "raw") + b"\n" for t in texts))
    monkeypatch.setattr(Encoder, "_tokenize_one_by_one", lambda *a: pytest.fail("fell back to one by one"))
    enc = Encoder(tok, EncodeOptions(chunk_chars=2000, spread_threads=2, append_eod=True))
    batches = list(read_batches([Segment(str(path))], 64 << 10, mapped=True))
    assert [type(b.data) for b in batches] == [MappedLines] * 3
    assert len(batches[1].data) == len(jsonl_line(text, "raw")) and batches[1].trailing == 1
    ids = []
    for b in batches:
        res = enc.encode(b)
        assert res.error is None and res.documents == 1
        ids += output_ids(res.outputs[(None, "text")])
    assert ids == expected_output(tok, texts)[0]
    assert spy["streams"] == 1
    if name == "unigram":
        assert spy["cuts"][0]["first_cut"] == tok.cut_start(text.encode("utf-8")) > 0


def test_piece_threads_last_the_run_and_each_keeps_its_own_tiktoken_encoding(tokenizers, monkeypatch):
    """tiktoken's regex caches are fast only for the first thread that used them, so every thread
    encodes with its own Encoding; the threads that tokenize pieces live for the whole run, so those
    Encodings are built once per thread, not once per huge document, and the first of them takes the
    tokenizer's own instead of building one (the thread that loaded it does not encode) — and the ids
    stay the whole texts'."""
    import tiktoken

    texts = [big_text(300_000, seed=s) for s in (11, 12, 13)]
    reference = build_tokenizer(TokenizerConfig("TikTokenizer", tokenizers["tiktoken"].path))
    expected = [expected_output(reference, [t])[0] for t in texts]
    tok = build_tokenizer(TokenizerConfig("TikTokenizer", tokenizers["tiktoken"].path))
    built, used = [], {}
    real_init, real_here = tiktoken.Encoding.__init__, type(tok)._encoding_here

    def init(self, *a, **k):
        built.append(threading.get_ident())
        real_init(self, *a, **k)

    def here(self):
        enc = real_here(self)
        used.setdefault(threading.get_ident(), set()).add(id(enc))
        return enc
    monkeypatch.setattr(tiktoken.Encoding, "__init__", init)
    monkeypatch.setattr(type(tok), "_encoding_here", here)
    enc = Encoder(tok, EncodeOptions(chunk_chars=2000, stream_bytes=5000, spread_threads=2, append_eod=True))
    threads_per_document = []
    for t, want in zip(texts, expected):
        used.clear()
        batch = Batch("in.jsonl", 1, jsonl_line(t, "raw") + b"\n")
        res = enc.encode(batch)
        assert res.error is None and output_ids(res.outputs[(None, "text")]) == want
        threads_per_document.append(set(used))
        assert all(len(e) == 1 for e in used.values())  # one Encoding per thread ...
        assert len({e for ids in used.values() for e in ids}) == len(used)  # ... and not another thread's
        assert id(tok.encoding) in {e for ids in used.values() for e in ids}  # the tokenizer's own is one
    assert threading.get_ident() not in threads_per_document[0]  # (the pieces went to the pool)
    assert len(threads_per_document[0]) == 2
    assert threads_per_document[0] == threads_per_document[1] == threads_per_document[2]
    # built once, for the second thread, for all three documents
    assert len(built) == 1 and set(built) < threads_per_document[0]


# ---------------------------------------------------------------------------------------------
# 4. blank and invalid huge values: the same outcome streamed as not
# ---------------------------------------------------------------------------------------------

NO_STREAM = 1 << 40  # stream_bytes no JSON string reaches


def _outcome(res):
    return (res.error, res.documents, res.tokens, res.lines, dict(res.skipped), res.first_skipped,
            {k: output_ids(o) for k, o in res.outputs.items()})


def test_a_blank_huge_value_is_skipped_like_a_short_blank_one(tokenizers):
    tok = tokenizers["tiktoken"]
    blank = "   \n\n  " * 4000 + "\u2003\t\u3000\u00a0\r\n" * 500 + " \u2028 "
    assert not blank.strip()
    lines = [jsonl_line(blank, "ascii"),  # \n, \t, \r and \u2003 ... escaped
             jsonl_line(blank, "raw"),
             b'{"text": " \\n\\u2003 "}',
             jsonl_line("a real text", "raw"),
             jsonl_line(blank + "x", "raw"),  # blank until its last character: not skipped
             jsonl_line("x" + blank, "ascii")]
    streamed, spans = encode_lines(tok, lines, chunk_chars=2000, stream_bytes=5000, append_eod=True)
    assert spans == [0, 1, 4, 5]
    whole, no_spans = encode_lines(tok, lines, chunk_chars=2000, stream_bytes=NO_STREAM, append_eod=True)
    assert no_spans == []
    assert _outcome(streamed) == _outcome(whole)
    assert dict(streamed.skipped) == {"empty 'text'": 3} and streamed.first_skipped == {"empty 'text'": "in.jsonl:1"}
    assert streamed.documents == 3
    want, _ = expected_output(tok, ["a real text", blank + "x", "x" + blank])
    assert output_ids(streamed.outputs[(None, "text")]) == want


_WORDS = "word слово " * 1000


@pytest.mark.parametrize("bad", [
    b'{"text": "' + _WORDS.encode() + b'\\x ' + _WORDS.encode() + b'"}',  # invalid escape
    b'{"text": "' + _WORDS.encode() + b'\\ud800 ' + _WORDS.encode() + b'"}',  # lone surrogate
    b'{"text": "' + _WORDS.encode() + b'\xff ' + _WORDS.encode() + b'"}',  # invalid UTF-8
    b'{"text": "' + _WORDS.encode() + b'\t' + _WORDS.encode() + b'"}',  # raw control character
    b'{"text": "' + _WORDS.encode() + b'"} trailing',
    b'{"text": "' + _WORDS.encode() + b'", "text": 1}',  # (the last duplicate is no string)
], ids=["escape", "lone_surrogate", "utf8", "raw_tab", "trailing", "duplicate"])
@pytest.mark.parametrize("skip_invalid", [False, True])
def test_an_invalid_huge_value_gives_the_non_streamed_error(tokenizers, bad, skip_invalid):
    tok = tokenizers["gpt2"]
    lines = [jsonl_line("first line", "raw"), bad, jsonl_line(_WORDS, "raw")]
    kw = dict(chunk_chars=2000, append_eod=True, skip_invalid=skip_invalid)
    streamed, spans = encode_lines(tok, lines, stream_bytes=5000, **kw)
    assert 2 in spans  # (the good huge line is streamed)
    whole, _ = encode_lines(tok, lines, stream_bytes=NO_STREAM, **kw)
    assert _outcome(streamed) == _outcome(whole)
    if skip_invalid:
        assert streamed.documents == 2 and sum(streamed.skipped.values()) == 1
        assert list(streamed.first_skipped.values()) == ["in.jsonl:2"]
    else:
        assert streamed.error.startswith("in.jsonl:2: ") and "--skip-invalid" in streamed.error


def test_a_tokenizer_error_in_a_streamed_document_is_reported_as_when_not_streamed():
    tok = NullTokenizer(1000)
    text = " ".join(str(i % 1000) for i in range(5000)) + " oops " + " ".join("7" for _ in range(5000))
    lines = [jsonl_line("1 2 3", "raw"), jsonl_line(text, "raw"), jsonl_line(text.replace("oops", "8"), "raw")]
    for skip_invalid in (False, True):
        kw = dict(chunk_chars=500, append_eod=True, skip_invalid=skip_invalid)
        streamed, spans = encode_lines(tok, lines, stream_bytes=5000, **kw)
        assert spans == [1, 2]
        whole, _ = encode_lines(tok, lines, stream_bytes=NO_STREAM, **kw)
        assert _outcome(streamed) == _outcome(whole)
        if skip_invalid:
            assert dict(streamed.skipped) == {"tokenizer error": 1} and streamed.documents == 2
        else:
            assert streamed.error.startswith("in.jsonl:2: the tokenizer failed on key 'text'") and "oops" in streamed.error
