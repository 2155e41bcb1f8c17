"""FOCUS (megatron_ru/adapt/focus.py, token_vectors.py): sparsemax against a brute-force projection onto
the simplex, and FOCUS on the small adaptation vocabularies: overlapping rows copied, every other row a
sparse convex combination of overlapping tokens' old rows that an independent computation from the
fastText vectors reproduces, the same on a second run."""
from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
import torch

from megatron_ru.adapt.focus import FocusOptions, build_focus, build_focus_map, focus_options, sparsemax
from megatron_ru.adapt.inits import init_rows
from megatron_ru.data.token_text import token_texts
from megatron_ru.adapt.token_vectors import VectorOptions, corpus_texts, token_words, train_token_vectors
from megatron_ru.adapt.vocab_map import build_vocab_map
from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
from tests.fixtures.tokenizers import adaptation_tokenizers, focus_corpus

#: the vectors of a small synthetic corpus are close to each other: a low temperature keeps few neighbours
TEMPERATURE = 0.01


def _projection(z: np.ndarray) -> np.ndarray:
    """The point of the simplex nearest to ``z``, by trying every support: on support S the solution is
    z - tau with tau = (sum z_S - 1) / |S|; it is the projection when it is positive on S and z <= tau
    off S (the KKT conditions)."""
    n = len(z)
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            s = list(support)
            tau = (z[s].sum() - 1) / k
            p = np.zeros(n)
            p[s] = z[s] - tau
            off = [i for i in range(n) if i not in support]
            if (p[s] > 0).all() and (z[off] <= tau + 1e-12).all():
                return p
    raise AssertionError("no support satisfies the KKT conditions")


def _sparsemax_ref(z: np.ndarray) -> np.ndarray:
    """Sparsemax by sorting (Martins & Astudillo 2016, Algorithm 1), rows of a matrix."""
    zs = -np.sort(-z, axis=1)
    k = np.arange(1, z.shape[1] + 1)
    cums = np.cumsum(zs, axis=1)
    support = 1 + k * zs > cums
    kz = support.sum(axis=1)
    tau = (cums[np.arange(len(z)), kz - 1] - 1) / kz
    return np.maximum(z - tau[:, None], 0)


def test_sparsemax_is_the_projection_onto_the_simplex():
    rng = np.random.default_rng(0)
    for n in range(1, 8):
        for scale in (0.1, 1.0, 5.0):
            z = rng.normal(size=(6, n)) * scale
            got = sparsemax(torch.from_numpy(z)).numpy()
            for row, want in zip(z, got):
                np.testing.assert_allclose(want, _projection(row), atol=1e-12)
            np.testing.assert_allclose(got, _sparsemax_ref(z), atol=1e-12)
            assert (got >= 0).all()
            np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)


def test_sparsemax_limits():
    z = torch.tensor([[0.9, 0.5, 0.45, -0.2]], dtype=torch.float64)
    assert torch.equal(sparsemax(torch.tensor([[3.0, 1.0, 0.0]], dtype=torch.float64)),
                       torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))     # a gap of 1 or more: one-hot
    assert torch.equal(sparsemax(z / 0.01), torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    wide = sparsemax(z / 100.0)                                                   # a high temperature: near uniform
    assert (wide > 0).all() and torch.allclose(wide, torch.full_like(wide, 0.25), atol=0.01)
    flat = sparsemax(torch.zeros(1, 5, dtype=torch.float64))                     # ties: uniform
    assert torch.allclose(flat, torch.full((1, 5), 0.2, dtype=torch.float64))
    assert torch.allclose(sparsemax(z + 7.0), sparsemax(z))                      # shift invariant, like softmax
    mid = sparsemax(z)
    assert int((mid > 0).sum()) == 3 and mid[0, 3] == 0                          # in between: sparse, not one-hot


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("focus")
    old_sp, new_sp, _ = adaptation_tokenizers(str(d))
    old, new = GPTSentencePieceTokenizer(old_sp), GPTSentencePieceTokenizer(new_sp)
    ot, nt = token_texts(old), token_texts(new)
    vmap = build_vocab_map(old, new, ot, nt)
    corpus = d / "ru.jsonl"
    focus_corpus(corpus)
    vopts = VectorOptions(corpus=str(corpus), dim=16, epochs=20, min_count=2)   # a small corpus wants many epochs
    vectors = train_token_vectors(new, nt, vopts)
    torch.manual_seed(0)
    emb = torch.randn(old.vocab_size, 12, dtype=torch.float64)
    return types.SimpleNamespace(old=old, new=new, ot=ot, nt=nt, vmap=vmap, vopts=vopts, vectors=vectors, emb=emb,
                                 dir=d)


def test_token_words_are_distinct_single_fasttext_words(case):
    words = token_words(case.nt)
    assert len(set(words)) == len(words) == case.new.vocab_size
    assert not any(c in w for w in words for c in " \t\n\r\v\f\0") and "</s>" not in words
    assert not any(w.startswith("__label__") for w in words)
    space_words = [w for i, w in enumerate(words) if case.nt.pieces[i] and case.nt.pieces[i].startswith(b" ")]
    assert space_words and all(w.startswith("▁") for w in space_words)


def test_focus_rows(case):
    vmap, vectors, emb = case.vmap, case.vectors, case.emb
    fmap = build_focus_map(vmap, vectors, FocusOptions(case.vopts, temperature=TEMPERATURE))
    rows, fallbacks = init_rows(emb, vmap, "focus", case.ot.pieces, focus=fmap)
    exact = [i for i, k in enumerate(vmap.kind) if k in ("kept", "special")]
    assert torch.equal(rows[exact], emb[[vmap.pieces[i][0] for i in exact]])     # overlapping rows: copied
    has = set(vectors.ids)
    overlap = [i for i in exact if i in has]
    assert fmap.basis == len(overlap) > 10
    assert set(fmap.focus_ids) == {i for i in vmap.new_ids() if i in has} and len(fmap.focus_ids) > 100
    assert fmap.no_vector == [i for i in vmap.new_ids() if i not in has] and fmap.no_vector

    # an independent computation: cosine similarities of the fastText vectors, sparsemax by sorting
    row = {i: k for k, i in enumerate(vectors.ids)}
    v = vectors.vectors.astype(np.float64)
    v = v / np.linalg.norm(v, axis=1, keepdims=True)
    q, b = v[[row[i] for i in fmap.focus_ids]], v[[row[i] for i in overlap]]
    w = _sparsemax_ref(q @ b.T / TEMPERATURE)
    old_rows = emb.numpy()[[vmap.pieces[i][0] for i in overlap]]
    np.testing.assert_allclose(rows[fmap.focus_ids].numpy(), w @ old_rows, rtol=1e-9, atol=1e-12)
    assert (w >= 0).all() and np.allclose(w.sum(axis=1), 1.0)
    support = (w > 0).sum(axis=1)
    assert support.max() < len(overlap) and np.median(support) < len(overlap) / 2   # sparse
    for k, i in enumerate(fmap.focus_ids):                                           # the map says the same
        assert sorted(fmap.vmap.pieces[i]) == sorted(vmap.pieces[overlap[j]][0] for j in np.flatnonzero(w[k]))
        assert sum(fmap.vmap.weights[i]) == pytest.approx(1.0)

    # no vector: the mean of the old pieces (--focus-fallback mean), or N(mean, std) per dimension (random)
    mean_rows, _ = init_rows(emb, vmap, "mean", case.ot.pieces)
    assert torch.allclose(rows[fmap.no_vector], mean_rows[fmap.no_vector])
    rnd = build_focus_map(vmap, vectors, FocusOptions(case.vopts, temperature=TEMPERATURE, fallback="random"))
    drawn, drawn_fb = init_rows(emb, vmap, "focus", case.ot.pieces, focus=rnd, seed=5)
    assert torch.equal(drawn[fmap.focus_ids], rows[fmap.focus_ids]) and not drawn_fb
    assert torch.equal(drawn, init_rows(emb, vmap, "focus", case.ot.pieces, focus=rnd, seed=5)[0])
    assert not torch.allclose(drawn[fmap.no_vector], mean_rows[fmap.no_vector])
    assert fallbacks == [i for i in fmap.no_vector if not vmap.pieces[i]]


def test_focus_is_deterministic_and_a_lower_temperature_keeps_fewer_neighbours(case):
    first = build_focus(case.vmap, case.new, case.nt, FocusOptions(case.vopts))
    assert first.vectors.ids == case.vectors.ids and np.array_equal(first.vectors.vectors, case.vectors.vectors)
    second = build_focus_map(case.vmap, case.vectors, FocusOptions(case.vopts))
    assert torch.equal(init_rows(case.emb, case.vmap, "focus", case.ot.pieces, focus=first)[0],
                       init_rows(case.emb, case.vmap, "focus", case.ot.pieces, focus=second)[0])
    sharp = build_focus_map(case.vmap, case.vectors, FocusOptions(case.vopts, temperature=0.02))
    assert sharp.summary()["mean_neighbours"] < first.summary()["mean_neighbours"]
    assert first.summary()["fasttext_seconds"] >= 0 and first.summary()["corpus_tokens"] > 1000


def test_focus_needs_its_corpus(case, tmp_path):
    with pytest.raises(ValueError, match="needs --focus-corpus"):
        init_rows(case.emb, case.vmap, "focus", case.ot.pieces)
    args = types.SimpleNamespace(focus_corpus=None, focus_json_keys=["text"], focus_dim=0, focus_epochs=3,
                                 focus_min_count=1, focus_temperature=0.0, focus_fallback="mean")
    assert focus_options(args, False, "--init focus") is None
    with pytest.raises(ValueError) as e:
        focus_options(args, True, "--init focus")
    assert all(s in str(e.value) for s in ("--init focus needs --focus-corpus", "--focus-dim 0",
                                            "--focus-temperature 0.0"))
    args.focus_corpus, args.focus_dim, args.focus_temperature = str(tmp_path / "missing.txt"), 8, 0.1
    with pytest.raises(ValueError, match="--focus-corpus .*missing.txt: no such file"):
        focus_options(args, True, "--init focus")


def test_corpus_texts(tmp_path):
    text = tmp_path / "ru.txt"
    text.write_text("первая строка\n\n  \nвторая\n", encoding="utf-8")
    assert list(corpus_texts(str(text))) == ["первая строка", "вторая"]
    jsonl = tmp_path / "ru.jsonl"
    jsonl.write_text('{"text": "раз", "title": "t"}\n{"text": ""}\n', encoding="utf-8")
    assert list(corpus_texts(str(jsonl))) == ["раз"]
    with pytest.raises(ValueError, match="--focus-json-keys body: line 1"):
        list(corpus_texts(str(jsonl), ["body"]))
    with pytest.raises(FileNotFoundError, match="--focus-corpus"):
        list(corpus_texts(str(tmp_path / "none.jsonl")))
