"""csrc/jsonl.cpp (the JSONL fast path of preprocess_data.py) against Python's json module.

The contract: a list only for lines json.loads accepts, and then exactly the UTF-8 of the string
values json.loads gives; None (parse it in Python) for everything else. Checked on hand-written
edge cases and on thousands of random valid and corrupted lines.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys

import pytest

from megatron_ru.data.preprocess import encode as encode_module
from megatron_ru.data.preprocess._jsonl import (count_newlines, extract_strings, extract_strings_batch,
                                                extract_strings_lines, read_range)
from megatron_ru.data.preprocess.encode import EncodeOptions, Encoder, is_blank
from megatron_ru.data.preprocess.reader import Batch
from megatron_ru.data.tokenizer import NullTokenizer

KEYS = ["text", "domain"]


def reference(line: bytes, keys: list[str]):
    """What the fast path must return when it returns a list; "reject" when json.loads fails or
    the line is not an object."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "reject"
    if not isinstance(obj, dict):
        return "reject"
    out = []
    for k in keys:
        v = obj.get(k)
        if not isinstance(v, str):
            out.append(None)
            continue
        try:
            out.append(v.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate escape: the fast path must decline the line
            return "surrogate"
    return out


def check(line: bytes, keys=KEYS) -> object:
    """A list must be exactly json.loads' values; None is always allowed (the caller then runs
    json.loads); test_random_lines_agree_with_json_loads checks that valid lines do get a list."""
    got = extract_strings(line, keys)
    if got is not None:
        want = reference(line, keys)
        assert want == got, (line[:200], got, want)
    return got


def _python_only(line: bytes) -> bool:
    """Valid for json.loads but not strict JSON: NaN/Infinity (Python's extension)."""
    return any(w in line for w in (b"NaN", b"Infinity"))


CASES = {
    b'{"text": "a\\nb", "domain": "x"}': [b"a\nb", b"x"],
    b'{"text": "\\u00e9\\ud83d\\ude00\\/\\b\\f\\r\\t\\"\\\\"}': ["\u00e9\U0001F600/\b\f\r\t\"\\".encode(), None],
    b'{"text": "\xd0\x9f\xd1\x80\xd0\xb8 \xe4\xb8\xad \xf0\x9f\x98\x80"}': ["При 中 😀".encode(), None],
    b'{"text": 1, "domain": null}': [None, None],
    b'{"text": "a", "text": "b"}': [b"b", None],  # the last duplicate wins, as in json.loads
    b'{"text": "a", "text": 2}': [None, None],
    b' \t{"text":"x"} \r': [b"x", None],
    b'{"te\\u0078t": "y"}': [b"y", None],  # keys are compared after unescaping
    b'{"a": [1, {"text": "no"}, -0.5e+3, true, false, null, [], {}], "text": ""}': [b"", None],
    b'{}': [None, None],
    b'{"text": "\\u0000"}': [b"\x00", None],
    b'{"text": "\x7f"}': [b"\x7f", None],
}
DECLINED = [
    b'{"text": "\\ud800"}', b'{"text": "\\udc00x"}', b'{"text": "\\ud800\\u0041"}',  # lone surrogates
    b'{"text":"x"} x', b'{"text": "x",}', b'{"text": 01}', b'{"text": "\\x"}', b'{"text": 1.}', b'{"text": -}',
    b'["text"]', b'"text"', b'', b'{', b'{"text": "unterminated', b'{"text" "x"}', b'{text: "x"}',
    b'{"text": "caf\xe9"}', b'{"text": "\xed\xa0\x80"}', b'{"text": "\xc0\xaf"}', b'{"text": "\xf4\x90\x80\x80"}',
    b'{"text": "\xe2\x82"}', b'{"text": "a\tb"}', b'{"text": "a\nb"}', b'\xef\xbb\xbf{"text": "bom"}',
    b'{"text": NaN}', b'{"text": "x", "n": Infinity}', b'{"text": tru}', b'{"text": "x"}}',
    b'[' * 300 + b']' * 300, b'{"a":' * 300 + b'1' + b'}' * 300,
]


def test_hand_written_cases():
    for line, want in CASES.items():
        assert extract_strings(line, KEYS) == want, line
        check(line)
    for line in DECLINED:
        assert extract_strings(line, KEYS) is None, line
        check(line)


def _random_string(rng: random.Random) -> str:
    pools = ["abc xyz", "Привет мир", "中文字", "😀🙂", "\n\t\"\\/\b\f\r", "\x00\x01\x1f\x7f", "\u2028\u00a0\u3000",
             "\ufeff\ufffe\U0010ffff"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 40)))


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return _random_string(rng)
    if kind == 1:
        return rng.choice([0, -1, 7, 12345678901234567890, 0.5, -2.5e-10, 1e300])
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind == 4:
        return _random_string(rng)
    if kind in (5, 6):
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(KEYS + ["x", "", "тема"]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_line(rng: random.Random) -> bytes:
    obj = {}
    for _ in range(rng.randint(0, 5)):
        obj[rng.choice(KEYS + ["id", "meta", "текст"])] = _random_value(rng)
    s = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 0]),
                   separators=rng.choice([None, (",", ":"), (" , ", " : ")])).replace("\n", " ")
    if rng.random() < 0.2:  # a duplicate key, raw (json.dumps never writes one)
        s = s[:-1] + ("," if len(obj) else "") + f'"text": {json.dumps(_random_string(rng))}' + "}"
    return (rng.choice(["", " ", "\t"]) + s + rng.choice(["", " ", "\r"])).encode("utf-8")


def _corrupt(rng: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            del b[min(i, len(b) - 1)]
        elif op == 1:
            b.insert(i, rng.choice(b'"\\{}[],:\x00\x1f\x80\xbf\xc0\xe2\xed\xf0\xf4\xffe.-+0u'))
        elif op == 2 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        else:
            b[i:i] = rng.choice([b"\\ud800", b"\\udfff", b"\\u12", b"NaN", b"-Infinity", b"\xed\xa0\x80", b"\xef\xbb\xbf"])
    return bytes(b)


def test_random_lines_agree_with_json_loads():
    rng = random.Random(20261122)
    taken = 0
    lines = []
    for _ in range(4000):
        line = _random_line(rng)
        got = check(line)
        # A line json.dumps wrote without NaN/Infinity or lone surrogates must take the fast path.
        if not _python_only(line) and reference(line, KEYS) != "surrogate":
            assert got is not None, line[:200]
            taken += 1
        bad = _corrupt(rng, line)
        check(bad)
        lines += [line, bad]
    assert taken > 3000
    assert extract_strings_batch(lines, KEYS) == [extract_strings(line, KEYS) for line in lines]
    with pytest.raises(TypeError, match="lines must be bytes"):
        extract_strings_batch([b"{}", "{}"], KEYS)


def test_lines_of_a_buffer_are_parsed_as_line_by_line(tmp_path):
    """extract_strings_lines (the batch parsed where it lies: its bytes or the mapped file) gives
    every line's values exactly as extract_strings does for the line alone — spans shifted to the
    buffer — and, for a line left to Python (refused, a key absent or not a string, or with no
    newline or bytes end after it to stop the scans), the line's place in the buffer."""
    import mmap

    rng = random.Random(26112026)
    lines = []
    for _ in range(1500):
        line = _random_line(rng)
        lines += [line, _corrupt(rng, line), rng.choice([b"", b"  ", b"\r", b'{"text": "x"}'])]
    for trial in range(300):
        batch = rng.sample(lines, rng.randint(0, 12))
        data = b"\n".join(batch) + rng.choice([b"", b"\n"])
        pre, post = rng.choice([b"", b'{"text": "before"}\n']), rng.choice([b"", b'{"text": "after"}\n'])
        path = tmp_path / "buf.jsonl"
        path.write_bytes(pre + data + post)
        span_min = rng.choice([0, 1, 40])
        want_lines = data.split(b"\n")
        if want_lines[-1] == b"":
            want_lines.pop()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if (pre + data + post) else \
                open(path, "rb") as mm:
            buffers = [pre + data + post] + ([mm] if isinstance(mm, mmap.mmap) else [])
            for buf in buffers:
                got = extract_strings_lines(buf, len(pre), len(pre) + len(data), KEYS, span_min)
                assert len(got) == len(want_lines)
                at = len(pre)
                for line, entry in zip(want_lines, got):
                    alone = extract_strings_batch([line], KEYS, span_min)[0]
                    after = at + len(line)
                    sentinel = buf[after] == ord("\n") if after < len(buf) else isinstance(buf, bytes)
                    if alone is None or None in alone or not sentinel:
                        assert entry == (at, after), (line, entry)
                    else:
                        assert entry == [(v[0] + at, v[1] + at) if isinstance(v, tuple) else v for v in alone]
                    at += len(line) + 1
                assert count_newlines(buf, len(pre), len(pre) + len(data)) == data.count(b"\n")
    with pytest.raises(ValueError, match="outside the buffer"):
        extract_strings_lines(b"{}", 0, 3, KEYS)


_VALID_ATOMS = [b"a", b"Z", b" ", b"~", "д".encode(), "я".encode(), b"\xc2\x80", b"\xdf\xbf", "—".encode(),
                "😀".encode(), b"\\n", b'\\"', b"\\u0430", b"\x7f"]
_INVALID_ATOMS = [b"\xc0\x80", b"\xc1\xbf", b"\x80", b"\xbf", b"\xd0", b"\xd0a", b"\xd0\xd0\xb0", b"\x1f", b"\x00", b"\t",
                  b'"', b"\\", b"\xe0\x80\x80", b"\xff", b"\xdf"]


def test_runs_of_ascii_and_two_byte_characters_agree_with_json_loads():
    """The fast path checks 32 bytes (SSE2) and eight bytes at a time when they are plain ASCII
    and whole 2-byte characters: every kind of byte at every offset of such a block — a character
    cut by a block boundary, an overlong C0/C1 lead, a lone lead or continuation, a control
    character, a quote or backslash next to Cyrillic — must give json.loads' value or be declined."""
    rng = random.Random(20261125)
    taken = declined = 0
    for _ in range(8000):
        atoms = [rng.choice(_VALID_ATOMS) for _ in range(rng.randint(1, 120))]
        broken = rng.random() < 0.5
        if broken:
            atoms.insert(rng.randrange(len(atoms) + 1), rng.choice(_INVALID_ATOMS))
        text = b"".join(atoms)
        line = b'{"text": "' + b"a" * rng.randrange(32) + text + b'"}' + b" " * rng.randrange(3)
        got = check(line, ["text"])
        if not broken:
            assert got is not None, line
        taken += got is not None
        declined += got is None
    assert taken > 3500 and declined > 2000


def test_blank_detection_on_bytes_matches_the_str_regex():
    ws = re.compile(r"\s")
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        assert is_blank(ch.encode("utf-8")) == (ws.match(ch) is not None), hex(cp)
    for text in ["", " \n\t", "\u3000\u00a0 ", " x ", "\u3000я", "\x1c\x1f", "\u2028\u2029\u202f", "中"]:
        assert is_blank(text.encode("utf-8")) == is_blank(text) == (re.fullmatch(r"\s*", text) is not None), text


@pytest.mark.parametrize("opts", [EncodeOptions(append_eod=True, skip_invalid=True),
                                  EncodeOptions(json_keys=("text", "t2"), skip_invalid=True),
                                  EncodeOptions(group_by_key="domain", skip_invalid=True),
                                  EncodeOptions(split_paragraphs=True, skip_invalid=True),
                                  EncodeOptions(append_eod=True)])
def test_encoder_gives_the_same_result_with_and_without_the_fast_path(monkeypatch, opts):
    """Whole batches of valid, odd and invalid lines: identical arrays, counts and first errors."""
    tok = NullTokenizer(1000)
    rng = random.Random(7)
    lines = []
    for i in range(300):
        ids = " ".join(str(rng.randrange(1000)) for _ in range(rng.randint(0, 30)))
        obj = {"text": ids + ("\n\n" + ids if i % 3 == 0 else ""), "t2": str(i), "domain": rng.choice(["a", "b", 3])}
        line = json.dumps(obj, ensure_ascii=bool(i % 2)).encode()
        if i % 17 == 0:
            line = _corrupt(rng, line)
        if i % 23 == 0:
            line = b'{"text": " \\u3000 ", "t2": "x", "domain": "a"}'
        lines.append(line)
    data = b"\n".join(lines) + b"\n"
    fast = Encoder(tok, opts).encode(Batch("in.jsonl", 1, data))
    monkeypatch.setattr(encode_module, "extract_strings_lines", None)
    batch = Batch("in.jsonl", 1, data)
    slow = Encoder(tok, opts).encode(batch)
    assert batch.data == b""  # released once split (a 100 MB line is not held twice)
    assert (fast.documents, fast.tokens, fast.lines, dict(fast.skipped), fast.first_skipped, fast.error) == \
           (slow.documents, slow.tokens, slow.lines, dict(slow.skipped), slow.first_skipped, slow.error)
    assert fast.outputs.keys() == slow.outputs.keys()
    for k in fast.outputs:
        for name in ("tokens", "sequence_lengths", "sequences_per_document"):
            assert getattr(fast.outputs[k], name).tolist() == getattr(slow.outputs[k], name).tolist(), (k, name)
    if opts.skip_invalid:
        assert fast.documents > 100 and sum(fast.skipped.values()) > 10
    else:
        assert fast.error is not None and "in.jsonl:1" in fast.error


def test_read_range_reads_the_bytes_at_an_offset(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 40000  # 10 MB: large enough for the huge-page advice
    path.write_bytes(data)
    with open(path, "rb") as f:
        assert read_range(f.fileno(), 0, len(data)) == data
        assert read_range(f.fileno(), 12345, 1000) == data[12345:13345]
        assert read_range(f.fileno(), len(data) - 10, 100) == data[-10:]  # short at the end of the file
        assert read_range(f.fileno(), len(data), 5) == b""
        with pytest.raises(ValueError, match="negative"):
            read_range(f.fileno(), -1, 5)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        read_range(fd, 0, 5)
