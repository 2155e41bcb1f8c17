"""GPTDataset: exact sample content against a brute-force construction from the tokens."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_ru.data.gpt_dataset import DocumentLayout, GPTDataset, build_gpt_indices, num_epochs_needed
from megatron_ru.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

STRIDE = 1000  # token value = document id * STRIDE + offset inside the document


def write_corpus(prefix: str, paragraphs: list[list[int]], base: int = 0) -> list[np.ndarray]:
    """Write documents made of paragraphs of the given lengths; returns each document's tokens.

    Token values encode (document, offset) so a sample shows exactly where it came from.
    """
    docs = []
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        for d, lengths in enumerate(paragraphs):
            tokens = base + d * STRIDE + np.arange(sum(lengths), dtype=np.int64)
            builder.add_document(tokens, lengths)
            docs.append(tokens)
        builder.finalize(prefix + ".idx")
    return docs


def random_paragraphs(rng: np.random.Generator, n_docs: int, max_par: int = 4, max_len: int = 20) -> list[list[int]]:
    return [list(rng.integers(1, max_len, size=int(rng.integers(1, max_par + 1)))) for _ in range(n_docs)]


def megatron_doc_idx(documents: np.ndarray, epochs: int, seed: int, separate: bool) -> np.ndarray:
    """Megatron's doc_idx, written out independently (one joint shuffle, or E-1 then 1)."""
    rng = np.random.RandomState(seed)
    if not separate:
        out = np.tile(documents, epochs).astype(np.int32)
        rng.shuffle(out)
        return out
    first = np.tile(documents, epochs - 1).astype(np.int32)
    rng.shuffle(first)
    last = documents.astype(np.int32).copy()
    rng.shuffle(last)
    return np.concatenate([first, last])


def brute_force_boundary_starts(stream_docs: list[int], docs: list[np.ndarray], paragraphs: list[list[int]],
                                seq: int, mode: str) -> list[int]:
    """Sample starts by the rule, on global token positions: first boundary, then repeatedly
    the first boundary at or after start + seq, while seq + 1 tokens remain."""
    bounds, pos = [], 0
    for d in stream_docs:
        offsets = np.cumsum([0] + paragraphs[d][:-1]) if mode == "paragraph" else [0]
        bounds.extend(pos + int(o) for o in offsets)
        pos += len(docs[d])
    starts, total = [], pos
    g = bounds[0]
    while g + seq + 1 <= total:
        starts.append(g)
        later = [b for b in bounds if b >= g + seq]
        if not later:
            break
        g = later[0]
    return starts


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_spanning_samples_equal_brute_force(tmp_path, seed):
    rng = np.random.default_rng(seed)
    paragraphs = random_paragraphs(rng, int(rng.integers(1, 12)))
    docs = write_corpus(str(tmp_path / "c"), paragraphs)
    ds_in = IndexedDataset(str(tmp_path / "c"))
    seq = int(rng.integers(2, 25))
    num_samples = int(rng.integers(1, 60))
    ds = GPTDataset(ds_in, (0, len(docs)), num_samples, seq, seed=seed + 5, cache_dir=str(tmp_path / "cache"))
    tokens_per_epoch = sum(len(d) for d in docs)
    # Megatron's epoch loop, literally
    epochs, total = 0, 0
    while True:
        epochs, total = epochs + 1, total + tokens_per_epoch
        if (total - 1) // seq >= num_samples:
            break
    assert ds.num_epochs == epochs
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq >= num_samples
    np.testing.assert_array_equal(np.sort(ds.shuffle_idx), np.arange(len(ds)))
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for i in range(len(ds)):
        k = int(ds.shuffle_idx[i])
        sample = ds[i]["tokens"]
        assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
        np.testing.assert_array_equal(sample, stream[k * seq:k * seq + seq + 1])


def test_doc_idx_and_separate_last_epoch_follow_megatron(tmp_path):
    paragraphs = [[10]] * 10  # 100 tokens per epoch
    docs = write_corpus(str(tmp_path / "c"), paragraphs)
    ds_in = IndexedDataset(str(tmp_path / "c"))
    documents = np.arange(10)
    # seq 10: 9 samples per epoch; 20 samples need 3 epochs, the last used for 1 sample (< 80 %)
    ds = GPTDataset(ds_in, (0, 10), 20, 10, seed=3, cache_dir=str(tmp_path / "cache"))
    assert ds.num_epochs == 3
    np.testing.assert_array_equal(ds.doc_idx, megatron_doc_idx(documents, 3, 3, separate=True))
    from_full = (2 * 100 - 1) // 10  # 19 samples come from the first two epochs
    assert sorted(ds.shuffle_idx[:from_full]) == list(range(from_full))
    assert sorted(ds.shuffle_idx[from_full:]) == list(range(from_full, len(ds)))
    # 26 samples: last epoch used for 7 of 9 samples (>= 80 % of 9 → int(7.2) = 7) → joint shuffle
    ds = GPTDataset(ds_in, (0, 10), 26, 10, seed=3, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(ds.doc_idx, megatron_doc_idx(documents, 3, 3, separate=False))
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    k = int(ds.shuffle_idx[5])
    np.testing.assert_array_equal(ds[5]["tokens"], stream[k * 10:k * 10 + 11])


@pytest.mark.parametrize("mode", ["document", "paragraph"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_boundary_start_samples_equal_brute_force(tmp_path, mode, seed):
    rng = np.random.default_rng(100 + seed)
    paragraphs = random_paragraphs(rng, int(rng.integers(1, 15)), max_par=5, max_len=12)
    docs = write_corpus(str(tmp_path / "c"), paragraphs)
    ds_in = IndexedDataset(str(tmp_path / "c"))
    seq = int(rng.integers(2, 30))
    num_samples = int(rng.integers(1, 40))
    ds = GPTDataset(ds_in, (0, len(docs)), num_samples, seq, seed=seed, sample_start=mode,
                    cache_dir=str(tmp_path / "cache"))
    assert len(ds) >= num_samples
    assert sorted(ds.doc_idx.tolist()) == sorted(list(range(len(docs))) * ds.num_epochs)
    starts = brute_force_boundary_starts([int(d) for d in ds.doc_idx], docs, paragraphs, seq, mode)
    assert len(ds) == len(starts)
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for i in range(len(ds)):
        g = starts[int(ds.shuffle_idx[i])]
        np.testing.assert_array_equal(ds[i]["tokens"], stream[g:g + seq + 1])
    # skipped share: tokens between samples that are never an input
    if len(starts) >= 2:
        span = starts[-1] - starts[0] + seq
        assert ds.skipped_share == pytest.approx((span - len(starts) * seq) / span)
    else:
        assert ds.skipped_share == 0.0


def test_document_mode_starts_every_sample_at_a_document_start(tmp_path):
    paragraphs = [[7, 5], [10, 20], [3, 3, 3], [12], [25, 1]]
    write_corpus(str(tmp_path / "c"), paragraphs)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "c")), (0, 5), 40, 8, seed=0, sample_start="document",
                    cache_dir=str(tmp_path / "cache"))
    firsts = [int(ds[i]["tokens"][0]) % STRIDE for i in range(len(ds))]
    assert firsts == [0] * len(ds)
    assert 0 < ds.skipped_share < 1
    para = GPTDataset(IndexedDataset(str(tmp_path / "c")), (0, 5), 40, 8, seed=0, sample_start="paragraph",
                      cache_dir=str(tmp_path / "cache"))
    starts = {0, 7, 10, 3, 6, 25}  # paragraph start offsets inside the documents above
    assert all(int(para[i]["tokens"][0]) % STRIDE in starts for i in range(len(para)))
    assert para.skipped_share < ds.skipped_share  # more boundaries → fewer skipped tokens


def test_split_range_uses_only_its_documents(tmp_path):
    docs = write_corpus(str(tmp_path / "c"), [[10]] * 8)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "c")), (3, 6), 10, 4, seed=0, cache_dir=str(tmp_path / "cache"))
    seen = {int(t) // STRIDE for i in range(len(ds)) for t in ds[i]["tokens"]}
    assert seen == {3, 4, 5}
    assert len(docs) == 8


def test_negative_index_and_out_of_range(tmp_path):
    write_corpus(str(tmp_path / "c"), [[10]] * 3)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "c")), (0, 3), 5, 4, seed=0, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(ds[-1]["tokens"], ds[len(ds) - 1]["tokens"])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_bad_arguments_have_clear_errors(tmp_path):
    """Checked once, with the configuration (resolve_data / parse_arguments), not by GPTDataset."""
    from megatron_ru.config.data import DataConfig
    from megatron_ru.data.builder import resolve_data
    write_corpus(str(tmp_path / "c"), [[10]] * 3)
    cfg = DataConfig(data_path=[str(tmp_path / "c")], sample_start="sentence", split="2,1,0")
    with pytest.raises(ValueError, match="--sample-start must be one of any, document, paragraph"):
        resolve_data(cfg, (5, 0, 0))
    cfg = DataConfig(data_path=[str(tmp_path / "c")], split="98,1,1")
    with pytest.raises(ValueError, match=r"--split 98,1,1: the valid split of .* receives no documents.*3 documents"):
        resolve_data(cfg, (5, 5, 0))


def test_python_reference_builds_identical_indices():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 50, size=400).astype(np.int32)
    doc_first = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 400), 150, replace=False)), [400]])
    for mode in ("any", "document", "paragraph"):
        layout = DocumentLayout.from_lengths(lengths, doc_first, mode)
        a = build_gpt_indices(layout, np.arange(20, 140), 700, 64, 11, mode, use_cpp=True)
        b = build_gpt_indices(layout, np.arange(20, 140), 700, 64, 11, mode, use_cpp=False)
        for name in ("doc_idx", "sample_idx", "shuffle_idx"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.num_epochs == b.num_epochs and a.skipped_share == b.skipped_share


def test_num_epochs_closed_form_matches_megatron_loop():
    for tokens in (1, 7, 100):
        for seq in (1, 3, 64):
            for n in (0, 1, 5, 99):
                epochs, total = 0, 0
                while True:
                    epochs, total = epochs + 1, total + tokens
                    if (total - 1) // seq >= n:
                        break
                assert num_epochs_needed(tokens, seq, n) == epochs


def test_skipped_share_is_logged_when_built(tmp_path):
    import logging
    write_corpus(str(tmp_path / "c"), [[7, 5], [10, 20], [3, 3, 3]])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron_ru.data.gpt_dataset")
    logger.addHandler(handler)
    try:
        ds = GPTDataset(IndexedDataset(str(tmp_path / "c")), (0, 3), 10, 8, seed=0, sample_start="document",
                        cache_dir=str(tmp_path / "cache"))
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert any(f"--sample-start document skips {100 * ds.skipped_share:.2f}% of the tokens" in m for m in lines)
    assert any(m.startswith("built train indices") for m in lines)


def test_split_without_tokens_is_a_clear_error(tmp_path):
    from megatron_ru.config.data import DataConfig
    from megatron_ru.data.builder import resolve_data
    write_corpus(str(tmp_path / "c"), [[5], [0], [0], [4]])
    cfg = DataConfig(data_path=[str(tmp_path / "c")], split="1,2,1")
    with pytest.raises(ValueError, match=r"the valid split of .* \(documents \[1, 3\)\) holds no tokens; adjust --split"):
        resolve_data(cfg, (5, 5, 0))


def test_boundary_mode_separates_a_little_used_last_epoch(tmp_path):
    # 10 documents of 12 tokens, S = 8, document starts: exactly one sample per document
    write_corpus(str(tmp_path / "c"), [[12]] * 10)
    ds_in = IndexedDataset(str(tmp_path / "c"))
    ds = GPTDataset(ds_in, (0, 10), 21, 8, seed=4, sample_start="document", cache_dir=str(tmp_path / "cache"))
    assert ds.num_epochs == 3 and len(ds) == 30
    assert sorted(ds.doc_idx[:20].tolist()) == sorted(list(range(10)) * 2)
    assert sorted(ds.doc_idx[20:].tolist()) == list(range(10))
    # 1 of the last epoch's 10 samples needed (< 80 %): the first 20 shuffled samples are epochs 1-2
    assert sorted(ds.shuffle_idx[:20].tolist()) == list(range(20))
    joint = GPTDataset(ds_in, (0, 10), 28, 8, seed=4, sample_start="document", cache_dir=str(tmp_path / "cache"))
    assert joint.num_epochs == 3 and len(joint) == 30
    assert sorted(joint.shuffle_idx[:20].tolist()) != list(range(20))  # 8 of 10 needed: one shuffle
    np.testing.assert_array_equal(joint.doc_idx, ds.doc_idx)


def test_document_sizes_with_empty_documents():
    from megatron_ru.data.gpt_dataset import document_sizes
    lengths = np.array([3, 0, 4, 5, 2], dtype=np.int32)
    # documents: [3] | [] | [0, 4] | [5, 2] | []
    first = np.array([0, 1, 1, 3, 5, 5])
    assert document_sizes(lengths, first).tolist() == [3, 0, 4, 7, 0]
    assert document_sizes(np.zeros(0, np.int32), np.array([0, 0, 0])).tolist() == [0, 0]
    assert document_sizes(lengths, np.array([0])).tolist() == []
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 9, size=int(rng.integers(0, 30))).astype(np.int32)
        cuts = np.sort(rng.integers(0, len(lengths) + 1, size=int(rng.integers(0, 12))))
        first = np.concatenate([[0], cuts, [len(lengths)]])
        ends = np.concatenate([[0], np.cumsum(lengths)])
        np.testing.assert_array_equal(document_sizes(lengths, first), ends[first[1:]] - ends[first[:-1]])
