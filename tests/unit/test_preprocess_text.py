"""Document splitting (exact partitions), chunking for huge texts, group-name sanitizing, and
the batch reader / partition planner (every line exactly once, with its true line number)."""
from __future__ import annotations

import gzip
import itertools
import random
import re

import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.preprocess.reader import (MIN_TAIL_BATCH, MappedLines, Segment, expand_inputs, plan_partitions,
                                                read_batches)
from megatron_ru.data.preprocess.text import sanitize_name, split_paragraphs, split_sentences
from megatron_ru.data.tokenizer import build_tokenizer
from tests.fixtures.tokenizers import make_gpt2_bpe_files, make_sentencepiece, sample_texts


def random_text(rng: random.Random, n: int) -> str:
    alphabet = ["a", "b", "Я", "ж", " ", " ", "\n", "\n\n", ".", "!", "?", "«", "»", "\t", "1", "A. ", ". B"]
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_paragraphs_are_an_exact_partition():
    t = "  Intro line\nsame paragraph.\n\n \n Second.\n\n\nThird\n\n"
    assert split_paragraphs(t) == ["  Intro line\nsame paragraph.\n\n \n ", "Second.\n\n\n", "Third\n\n"]
    assert split_paragraphs("one") == ["one"] and split_paragraphs("") == [""]
    rng = random.Random(0)
    for _ in range(300):
        text = random_text(rng, rng.randint(0, 80))
        parts = split_paragraphs(text)
        assert "".join(parts) == text
        assert all(re.search(r"\n[^\S\n]*\n", p.rstrip()) is None for p in parts)  # no break inside


def test_sentences():
    t = "Первое предложение. Второе!\nТретье? «Цитата» здесь. А. С. Пушкин писал. 2024 год\n\nАбзац"
    assert split_sentences(t) == ["Первое предложение.", "Второе!", "Третье?", "«Цитата» здесь.",
                                  "А. С. Пушкин писал.", "2024 год", "Абзац"]
    kept = split_sentences(t, keep_newlines=True)
    assert kept[1] == "Второе!\n" and "".join(kept) == t
    assert split_sentences("e.g. lower case goes on. Next") == ["e.g. lower case goes on.", "Next"]
    rng = random.Random(1)
    for _ in range(300):
        text = random_text(rng, rng.randint(0, 80))
        assert "".join(split_sentences(text, keep_newlines=True)) == text
        # without --keep-newlines only the whitespace between sentences is dropped
        assert re.sub(r"\s", "", "".join(split_sentences(text))) == re.sub(r"\s", "", text)


def test_sanitize_name():
    assert sanitize_name("ru/news wiki") == "ru_news_wiki"
    assert sanitize_name("новости-2024.v1") == "новости-2024.v1"
    assert sanitize_name("../etc") == "_._etc"
    assert sanitize_name("") == "_"
    long = sanitize_name("x" * 300)
    assert len(long) == 89 and long != sanitize_name("x" * 301)


def test_reader_and_partitions_cover_every_line_once(tmp_path):
    rng = random.Random(3)
    lines = [("x" * rng.randint(0, 300)).encode() for _ in range(400)]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines[:150]) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n".join(lines[150:300]))  # no final newline
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(b"\n".join(lines[300:]) + b"\n")
    files = expand_inputs([str(tmp_path / "*.jsonl"), str(tmp_path / "c.jsonl.gz"), str(tmp_path / "a.jsonl")])
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.jsonl", "b.jsonl", "c.jsonl.gz"]
    expected = ([("a.jsonl", i + 1, lines[i]) for i in range(150)] + [("b.jsonl", i + 1, lines[150 + i]) for i in range(150)]
                + [("c.jsonl.gz", i + 1, lines[300 + i]) for i in range(100)])
    for n, batch_bytes, mapped in itertools.product((1, 2, 3, 7, 1000), (1, 500, 1 << 20), (False, True)):
        if True:
            got = []
            for part in plan_partitions(files, n):
                for b in read_batches(part, batch_bytes, mapped):
                    # (mapped: a range of the mapping, but for a last line without newline longer than a batch)
                    assert isinstance(b.data, MappedLines) == (mapped and not b.path.endswith(".gz")) or \
                        (mapped and b.trailing == 0 and len(b.data) > batch_bytes)
                    ls = bytes(b.data).split(b"\n")
                    if ls[-1] == b"":
                        ls.pop()
                    got += [(b.path.rsplit("/", 1)[1], b.first_line + i, l) for i, l in enumerate(ls)]
            assert got == expected, (n, batch_bytes, mapped)
    with pytest.raises(FileNotFoundError, match="--input .*nothing\\*.jsonl: the pattern matches no file"):
        expand_inputs([str(tmp_path / "nothing*.jsonl")])
    with pytest.raises(FileNotFoundError, match="--input .*missing.jsonl: no such file"):
        expand_inputs([str(tmp_path / "missing.jsonl")])


def test_a_line_longer_than_a_batch_is_read_whole_without_a_copy(tmp_path):
    """A line longer than a batch is one batch, read in one piece without its newline (counted in
    ``trailing``), so that splitting it into lines returns the same object (no copy of a 100 MB
    line); a BOM, a last line without newline, segment ends and .gz files keep every byte."""
    rng = random.Random(9)
    lines = [bytes(rng.choice(b"abc ") for _ in range(n)) for n in (10, 5000, 20, 7000, 3, 4000)]
    data = b"\n".join(lines)  # no final newline
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + data)
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(b"\xef\xbb\xbf" + data)
    for name, mapped in itertools.product(("a.jsonl", "a.jsonl.gz"), (False, True)):
        for n_parts in (1, 2, 3):
            got, total = [], 0
            for part in plan_partitions([str(tmp_path / name)], n_parts):
                for b in read_batches(part, 1000, mapped):
                    total += len(b.data) + b.trailing
                    ls = bytes(b.data).split(b"\n")
                    if len(b.data) > 1000 and not name.endswith(".gz"):
                        assert len(ls) == 1 and b.trailing == (bytes(b.data) != lines[-1])
                        # left in the mapping (a last line without newline is copied: see _mapped_batches)
                        assert isinstance(b.data, MappedLines) == (mapped and b.trailing == 1)
                        assert mapped or ls[0] is b.data
                    if ls[-1] == b"":
                        ls.pop()
                    got += [(b.first_line + i, l) for i, l in enumerate(ls)]
            assert got == list(enumerate(lines, 1)), (name, n_parts, mapped)
            if not name.endswith(".gz"):
                assert total == len(data)


def test_batches_shrink_towards_the_end_of_a_plain_file_only(tmp_path):
    """The last batches get small (parallel workers finish together); .gz (size unknown) keeps
    full batches; either way every line arrives once, in order, with its line number."""
    rng = random.Random(5)
    lines = [bytes(rng.choice(b"abcdefgh ") for _ in range(rng.randint(500, 1500))) for _ in range(3000)]
    data = b"\n".join(lines) + b"\n"  # ~3 MB
    (tmp_path / "a.jsonl").write_bytes(data)
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(data)
    batch = 1 << 20
    for name in ("a.jsonl", "a.jsonl.gz"):
        batches = list(read_batches([Segment(str(tmp_path / name))], batch))
        assert b"".join(b.data for b in batches) == data
        assert [b.first_line for b in batches] == [1] + [1 + sum(b.data.count(b"\n") for b in batches[:i])
                                                        for i in range(1, len(batches))]
        sizes = [len(b.data) for b in batches]
        assert max(sizes) < batch + 1600
        if name.endswith(".gz"):
            assert all(s > batch - 1600 for s in sizes[:-1]), sizes
        else:
            # 3 MB < 8 × 1 MB: each read takes an eighth of what is left, down to MIN_TAIL_BATCH; a batch
            # is the whole lines of it plus the end of a line the previous read cut (± one line).
            left = len(data)
            for s in sizes:
                want = min(batch, max(MIN_TAIL_BATCH, left // 8))
                assert abs(s - want) < 1600 or s == left, (s, want, left)
                left -= s
            assert sizes[-1] <= MIN_TAIL_BATCH and len(sizes) > 8
