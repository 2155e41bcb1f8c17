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
