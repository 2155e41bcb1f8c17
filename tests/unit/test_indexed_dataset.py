"""MMIDIDX reader/writer: exact bytes of the documented layout, merging, bulk add, and the
errors for a wrong magic, a truncated index, a .bin that disagrees with its index."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron_ru.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype


def build(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sequences (lists of ints)."""
    with IndexedDatasetBuilder(str(prefix) + ".bin", dtype) as b:
        for doc in docs:
            for seq in doc:
                b.add_item(seq)
            b.end_document()
        b.finalize(str(prefix) + ".idx")
    return str(prefix)


DOCS = [[[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9], [10, 11, 12, 13]]]


def test_exact_bytes_of_the_layout(tmp_path):
    prefix = build(tmp_path / "d", DOCS, np.int32)
    lengths = [3, 1, 2, 1, 2, 4]
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 6)
                + struct.pack("<Q", 4) + struct.pack("<6i", *lengths)
                + struct.pack("<6q", *np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 4)
                + struct.pack("<4q", 0, 2, 3, 6))
    assert open(prefix + ".idx", "rb").read() == expected
    assert open(prefix + ".bin", "rb").read() == struct.pack("<13i", *range(1, 14))


def test_reader_views(tmp_path):
    ds = IndexedDataset(build(tmp_path / "d", DOCS))
    assert (len(ds), ds.num_documents, ds.num_tokens, ds.dtype) == (6, 3, 13, np.dtype(np.uint16))
    assert [s.tolist() for s in ds.document(2)] == DOCS[2]
    assert ds.get(5, 1, 2).tolist() == [11, 12]
    assert ds[0].base is not None  # a view of the memory map, not a copy


def test_add_documents_equals_item_by_item_and_merge(tmp_path):
    a = build(tmp_path / "a", DOCS)
    with IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16) as b:
        flat = [t for doc in DOCS for seq in doc for t in seq]
        b.add_documents(np.array(flat), [len(s) for doc in DOCS for s in doc], [len(doc) for doc in DOCS])
        b.finalize(str(tmp_path / "b.idx"))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()
    with pytest.raises(ValueError, match="sequences_per_document sums to 1"):
        IndexedDatasetBuilder(str(tmp_path / "c.bin")).add_documents(np.arange(3), [1, 2], [1])
    merged = build(tmp_path / "m", DOCS + DOCS)
    with IndexedDatasetBuilder(str(tmp_path / "n.bin"), np.uint16) as b:
        b.add_index(a)
        b.add_index(a)
        b.finalize(str(tmp_path / "n.idx"))
    for ext in (".bin", ".idx"):
        assert open(merged + ext, "rb").read() == open(str(tmp_path / "n") + ext, "rb").read()


def test_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16) as b:
            b.add_item([1, 2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_wrong_magic(tmp_path):
    prefix = build(tmp_path / "d", DOCS)
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[:9] = b"TNTIDX\x00\x00\x00"
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"d\.idx: not a Megatron MMIDIDX index.*Rebuild"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("keep", [10, 40, 60])
def test_truncated_index(tmp_path, keep):
    prefix = build(tmp_path / "d", DOCS)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:keep])
    with pytest.raises(ValueError, match=r"d\.idx: truncated index"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("delta", [-2, 2])
def test_bin_size_mismatch(tmp_path, delta):
    prefix = build(tmp_path / "d", DOCS)
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:delta] if delta < 0 else data + b"\0" * delta)
    with pytest.raises(ValueError, match=r"d\.bin: size (24|28) bytes disagrees with its index .*needs 26 bytes"):
        IndexedDataset(prefix)


def test_unknown_dtype_code_and_missing_file(tmp_path):
    prefix = build(tmp_path / "d", DOCS)
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[17] = 99
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(ValueError, match="unknown dtype code 99"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        IndexedDataset(str(tmp_path / "missing"))


def test_best_fitting_dtype():
    assert best_fitting_dtype(65499) is np.uint16
    assert best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(None) is np.int32


# ---- one flipped field in a real .idx: refused from the index alone --------------------------

def _real_dataset(tmp_path, num_docs=1056):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 2000, size=int(rng.integers(1, 30))).tolist()] for _ in range(num_docs)]
    return build(tmp_path / "real", docs)


def _patch(path, offset, fmt, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        old = struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
        f.seek(offset)
        f.write(struct.pack(fmt, value(old)))


def test_flipped_bit_in_the_document_count_is_refused(tmp_path):
    prefix = _real_dataset(tmp_path)
    assert IndexedDataset(prefix).num_documents == 1056
    _patch(prefix + ".idx", 26, "<Q", lambda n: n ^ (1 << 10))  # 1057 -> 33 entries: 32 documents
    with pytest.raises(ValueError, match=r"real\.idx: inconsistent index: header announces 1056 sequences and 33 "
                                         r"document-index entries .* rebuild it"):
        IndexedDataset(prefix)


def test_changed_sequence_length_is_refused(tmp_path):
    prefix = _real_dataset(tmp_path)
    _patch(prefix + ".idx", 34 + 4 * 500, "<i", lambda n: n + 1)
    with pytest.raises(ValueError, match=r"real\.idx: corrupt index: sequence 501 starts at byte \d+, but sequence "
                                         r"500 starts at byte \d+ and holds \d+ tokens of 2 bytes.*tools/preprocess_data"):
        IndexedDataset(prefix)


def test_dtype_code_of_another_width_is_refused(tmp_path):
    prefix = _real_dataset(tmp_path)
    _patch(prefix + ".idx", 17, "<B", lambda code: 4)  # uint16 -> int32: pointers no longer agree
    with pytest.raises(ValueError, match=r"sequence 1 starts at byte \d+, but .* tokens of 4 bytes"):
        IndexedDataset(prefix)


def test_document_index_out_of_order_or_short_is_refused(tmp_path):
    prefix = _real_dataset(tmp_path)
    doc_off = 34 + 12 * 1056
    _patch(prefix + ".idx", doc_off + 8 * 10, "<q", lambda v: v + 5)
    with pytest.raises(ValueError, match=r"the document index decreases at document 10 \(15 -> 11\)"):
        IndexedDataset(prefix)
    prefix = _real_dataset(tmp_path)
    _patch(prefix + ".idx", doc_off + 8 * 1056, "<q", lambda v: v - 1)
    with pytest.raises(ValueError, match=r"document index runs from 0 to 1055, expected 0 to the sequence count 1056"):
        IndexedDataset(prefix)
