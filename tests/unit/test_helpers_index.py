"""C++ dataset-index helpers (csrc/helpers.cpp) against the numpy reference and hand-worked cases."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ru.data import helpers as cpp
from megatron_ru.data import helpers_ref as ref

SEEDS = range(40)


def _random_corpus(rng: np.random.Generator, n_docs: int, with_empty: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-document sizes plus paragraph CSR (boundary_ptr, boundary_off) from random paragraph lengths."""
    paragraphs = rng.integers(0 if with_empty else 1, 4, size=n_docs) if n_docs else np.zeros(0, np.int64)
    lengths = rng.integers(0 if with_empty else 1, 12, size=int(paragraphs.sum()))
    ptr = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(paragraphs, out=ptr[1:])
    ends = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    sizes = ends[ptr[1:]] - ends[ptr[:-1]]
    off = np.zeros(lengths.size, dtype=np.int64)
    for d in range(n_docs):  # paragraph start offsets inside each document
        seg = lengths[ptr[d]:ptr[d + 1]]
        off[ptr[d]:ptr[d + 1]] = np.concatenate([[0], np.cumsum(seg)[:-1]]) if seg.size else seg
    return sizes, ptr, off


def _stream(rng: np.random.Generator, n_docs: int, epochs: int) -> np.ndarray:
    return np.concatenate([rng.permutation(n_docs) for _ in range(epochs)]) if n_docs else np.zeros(0, np.int64)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sample_idx_matches_reference_on_random_inputs(dtype):
    checked = 0
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        n_docs = [1, 2, 3, 17, 120][seed % 5]
        sizes, _, _ = _random_corpus(rng, n_docs, with_empty=seed % 2 == 0)
        tokens = int(sizes.sum())
        if tokens == 0:
            continue
        epochs = int(rng.integers(1, 4))
        seq = int(rng.integers(1, 40))
        doc_idx = _stream(rng, n_docs, epochs)
        got = cpp.build_sample_idx(sizes, doc_idx, seq, epochs, tokens, index_dtype=dtype)
        want = ref.build_sample_idx(sizes, doc_idx, seq, epochs, tokens, index_dtype=dtype)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(got, want)
        assert got.shape == ((epochs * tokens - 1) // seq + 1, 2)
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("paragraphs", [False, True])
def test_boundary_sample_idx_matches_reference_on_random_inputs(dtype, paragraphs):
    for seed in SEEDS:
        rng = np.random.default_rng(1000 + seed)
        n_docs = [0, 1, 2, 5, 60][seed % 5]
        sizes, ptr, off = _random_corpus(rng, n_docs, with_empty=seed % 3 == 0)
        if not paragraphs:  # document mode: one boundary per document, at its start
            ptr, off = np.arange(n_docs + 1, dtype=np.int64), np.zeros(n_docs, np.int64)
        doc_idx = _stream(rng, n_docs, int(rng.integers(1, 4)))
        seq = int(rng.integers(1, 30))
        got = cpp.build_boundary_sample_idx(sizes, doc_idx, seq, ptr, off, index_dtype=dtype)
        want = ref.build_boundary_sample_idx(sizes, doc_idx, seq, ptr, off, index_dtype=dtype)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(got, want)


def test_sample_idx_hand_worked():
    # stream: doc0 (5 tokens) doc1 (3) doc2 (7) | doc2 doc1 doc0; S = 4 → samples start at
    # global tokens 0, 4, 8, ... and row k is the document position/offset of token 4k.
    sizes, doc_idx = np.array([5, 3, 7]), np.array([0, 1, 2, 2, 1, 0])
    want = [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1], [3, 5], [4, 2], [5, 3]]
    for impl in (cpp, ref):
        assert impl.build_sample_idx(sizes, doc_idx, 4, 2, 15).tolist() == want


def test_sample_idx_skips_empty_documents_like_megatron():
    # an empty document between two others is never a sample position except row 0
    sizes, doc_idx = np.array([0, 4, 0, 4]), np.array([0, 1, 2, 3])
    for impl in (cpp, ref):
        assert impl.build_sample_idx(sizes, doc_idx, 2, 1, 8).tolist() == [[0, 0], [1, 2], [3, 0], [3, 2]]


def test_boundary_sample_idx_hand_worked():
    # documents 5, 3, 7 tokens; S = 4. Starts: (0,0); token 4 is inside doc0 → next boundary is
    # doc1 at global 5; 5+4=9 lies in doc2 → next doc2 (2nd copy) at 15; 19 → doc1 at 22;
    # 26 → doc0 at 25+... past the stream's end at 30, so no sample there.
    sizes, doc_idx = np.array([5, 3, 7]), np.array([0, 1, 2, 2, 1, 0])
    ptr, off = np.arange(4), np.zeros(3, np.int64)
    for impl in (cpp, ref):
        assert impl.build_boundary_sample_idx(sizes, doc_idx, 4, ptr, off).tolist() == [[0, 0], [1, 0], [3, 0], [4, 0], [6, 0]]
    # paragraphs: doc2 = paragraphs of 2 and 5 tokens, so boundaries at global 0 5 8 10 15 17
    # 22 25: starts 0 → (≥4) 5 → (≥9) 10 = doc2 offset 2 → (≥14) 15 → (≥19) 22 → (≥26) none
    ptr, off = np.array([0, 1, 2, 4]), np.array([0, 0, 0, 2])
    for impl in (cpp, ref):
        assert impl.build_boundary_sample_idx(sizes, doc_idx, 4, ptr, off).tolist() == [
            [0, 0], [1, 0], [2, 2], [3, 0], [4, 0], [6, 0]]


def test_boundary_sample_idx_equals_spanning_when_every_token_is_a_boundary():
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 9, size=30)
    doc_idx = _stream(rng, 30, 2)
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    off = np.concatenate([np.arange(s) for s in sizes])
    for seq in (1, 3, 8):
        span = cpp.build_sample_idx(sizes, doc_idx, seq, 2, int(sizes.sum()))
        bound = cpp.build_boundary_sample_idx(sizes, doc_idx, seq, ptr, off)
        # same starts; boundary mode makes a sample only when S + 1 tokens remain
        np.testing.assert_array_equal(bound[:-1], span[:len(bound) - 1])
        assert len(bound) - 1 == (2 * int(sizes.sum()) - 1) // seq


def test_zero_documents():
    empty = np.zeros(0, np.int64)
    for impl in (cpp, ref):
        with pytest.raises(ValueError, match="fewer than"):
            impl.build_sample_idx(empty, empty, 4, 1, 1)
        out = impl.build_boundary_sample_idx(empty, empty, 4, np.zeros(1, np.int64), empty)
        assert out.tolist() == [[0, 0]]


def test_bad_document_id_is_an_error_in_both():
    for impl in (cpp, ref):
        with pytest.raises(ValueError, match=r"doc_idx\[1\] = 5 is not a document id"):
            impl.build_sample_idx(np.array([3, 3]), np.array([0, 5]), 2, 1, 6)


def test_index_dtype_choice():
    assert cpp.index_dtype_for(10, 100) == np.int32
    assert cpp.index_dtype_for(2**31, 100) == np.int64
    assert cpp.index_dtype_for(10, 2**31) == np.int64
    assert cpp.build_sample_idx(np.array([4, 4]), np.array([0, 1]), 2, 1, 8).dtype == np.int32


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_blending_indices_match_reference(n):
    for seed in range(10):
        rng = np.random.default_rng(seed)
        weights = rng.random(n)
        weights[rng.random(n) < 0.2] = 0.0
        if weights.sum() == 0:
            weights[0] = 1.0
        weights /= weights.sum()
        size = int(rng.integers(0, 3000))
        got = cpp.build_blending_indices(weights, size)
        want = ref.build_blending_indices(weights, size)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        # every dataset's sample indices count up from 0, and proportions follow the weights
        for d in range(n):
            picked = got[1][got[0] == d]
            np.testing.assert_array_equal(picked, np.arange(picked.size))
            assert abs(picked.size - weights[d] * size) <= 2


def test_blending_hand_worked():
    # Megatron's error weight*max(i,1) - taken: i=0,1 → x=1; 0.7 vs 0.3 → 0 then 0.7-1 < 0.3 → 1
    idx, sample = cpp.build_blending_indices(np.array([0.7, 0.3]), 10)
    assert idx.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


def test_blending_rejects_bad_weights():
    for impl in (cpp, ref):
        with pytest.raises(ValueError, match="1 to 255 datasets"):
            impl.build_blending_indices(np.ones(256) / 256, 5)
        with pytest.raises(ValueError):
            impl.build_blending_indices(np.array([0.5, -0.5]), 5)


def test_missing_extension_says_how_to_build_it(monkeypatch):
    import sys

    import megatron_ru.data
    monkeypatch.setattr(cpp, "_ext", None)
    monkeypatch.delattr(megatron_ru.data, "_helpers", raising=False)
    monkeypatch.setitem(sys.modules, "megatron_ru.data._helpers", None)
    with pytest.raises(ImportError, match=r"not built .*python setup.py build_ext --inplace"):
        cpp.build_blending_indices(np.array([1.0]), 3)
