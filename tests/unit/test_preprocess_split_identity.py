"""--split-sentences gives the same sentences and the same .bin/.idx bytes as the splitter before
issue 40 item 4 (which searched for an initial from the start of the document at every candidate
sentence end: quadratic in the document's length). The reference below is that splitter, kept
here verbatim in behaviour; the tool is run with it and with today's, on the same input."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re

import pytest

from megatron_ru.data.preprocess import encode as encode_module
from megatron_ru.data.preprocess.synthetic import document
from megatron_ru.data.preprocess.text import _PARAGRAPH_BREAK, _SENTENCE_END, split_sentences
from tests.fixtures.tokenizers import make_sentencepiece, sample_texts, tricky_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("preprocess_data_tool", os.path.join(REPO, "tools", "preprocess_data.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

_REF_INITIAL = re.compile(r"(?:^|\s)\w\.$")


def reference_split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The splitter as it was: the initial test searches text[0:end] for every candidate."""
    cuts = []
    for m in _SENTENCE_END.finditer(text):
        if _REF_INITIAL.search(text, 0, m.start(1)) and m.start(1) - m.start() == 1:
            continue
        cuts.append((m.start(1), m.end(1)))
    for m in _PARAGRAPH_BREAK.finditer(text):
        if 0 < m.start() and m.end() < len(text):
            cuts.append((m.start(), m.end()))
    cuts.sort()
    merged: list[tuple[int, int]] = []
    for a, b in cuts:
        if merged and a <= merged[-1][1]:
            merged[-1] = (min(merged[-1][0], a), max(merged[-1][1], b))
        else:
            merged.append((a, b))
    out, start = [], 0
    for end, nxt in merged:
        out.append(text[start:nxt] if keep_newlines else text[start:end])
        start = nxt
    if keep_newlines:
        out.append(text[start:])
    else:
        out = [s.strip() for s in out] + [text[start:].strip()]
    return [s for s in out if s]


def initials_text(rng: random.Random, n: int) -> str:
    """Short random texts dense in what the initial rule looks at: one letter, a period, spaces,
    line starts, closing quotes, punctuation runs, upper-case and digit starts."""
    alphabet = ["A", "Я", "b", "ж", "1", "_", ".", ". ", "..", "!", "?", "…", "»", "”", ")", " ", "  ", "\n", "\n\n",
                "\t", "A. ", "x. ", "Ё. ", " Б. ", "«", "(", "\u00a0", "\u3000", "Word. "]
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_same_sentences_as_the_reference():
    rng = random.Random(0)
    texts = [initials_text(rng, rng.randint(0, 60)) for _ in range(3000)]
    texts += sample_texts(100, seed=3) + [tricky_text(s, 800) for s in range(5)]
    texts += [document(random.Random(s)) for s in range(20)]
    texts += ["А. С. Пушкин. Он", "A. B", "A.B. C", " x. Y", "\nx. Y", "x.\u00a0Y", "ab. C", "Ж. Ж. Ж.", "1. 2. 3"]
    for text in texts:
        for keep in (False, True):
            assert split_sentences(text, keep) == reference_split_sentences(text, keep), (text, keep)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return make_sentencepiece(tmp_path_factory.mktemp("tok"))


def _run(corpus: str, prefix: str, model: str, *extra: str) -> tuple[bytes, bytes]:
    tool.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
               "--tokenizer-model", model, "--split-sentences", *extra])
    stem = prefix + "_text_sentence"
    return open(stem + ".bin", "rb").read(), open(stem + ".idx", "rb").read()


@pytest.mark.parametrize("extra", [["--append-eod", "--workers", "2", "--batch-bytes", "4000"],
                                   ["--keep-newlines", "--workers", "1", "--tokenize-chunk-chars", "100"]],
                         ids=["eod-2workers", "keep-newlines-cut-sentences"])
def test_same_bytes_as_the_reference(tmp_path, monkeypatch, sp_model, extra):
    """The .bin/.idx of the tool byte for byte: documents of many sentences (the quadratic case),
    initials, blank and empty texts, sentences longer than --tokenize-chunk-chars (cut pieces)."""
    rng = random.Random(1)
    texts = [document(random.Random(s), paragraphs=(3, 12)) for s in range(12)] + sample_texts(30, seed=5)
    texts += [initials_text(rng, 200) for _ in range(20)] + [tricky_text(9, 1500), "one", "  ", "А. С. Пушкин. Он"]
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    now = _run(str(corpus), str(tmp_path / "now"), sp_model, *extra)
    monkeypatch.setattr(encode_module, "split_sentences", reference_split_sentences)
    ref = _run(str(corpus), str(tmp_path / "ref"), sp_model, *extra)
    assert now[1] == ref[1]
    assert now[0] == ref[0]
    assert len(ref[1]) > 34 + 12 * 1000  # (many sequences: the check is not vacuous)
