"""A damaged dataset index cache is one error naming the file and the fix (issue 31, item 8): a truncated
``.npy`` used to say only ``mmap length is greater than file size``, an overwritten one ended in an
IndexError mid-training."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpt_dataset import write_corpus  # noqa: E402
from test_gpt_dataset_cache import _make, _samples  # noqa: E402


def _entry(tmp_path, name):
    (path,) = [os.path.join(tmp_path / "cache", f) for f in os.listdir(tmp_path / "cache") if f.endswith(name)]
    return path


@pytest.fixture
def cached(tmp_path):
    write_corpus(str(tmp_path / "c"), [[9, 4, 7]] * 8)
    first = _make(tmp_path)
    return tmp_path, _samples(first)


def test_an_intact_cache_passes_the_checks(cached):
    tmp_path, samples = cached
    np.testing.assert_array_equal(_samples(_make(tmp_path)), samples)


def test_a_truncated_array_file_is_named(cached):
    tmp_path, _ = cached
    path = _entry(tmp_path, "-sample_idx.npy")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 16])
    with pytest.raises(ValueError, match=f"dataset index cache file {path} is damaged .*delete the files"):
        _make(tmp_path)


@pytest.mark.parametrize("name", ["shuffle_idx", "doc_idx", "sample_idx"])
def test_an_overwritten_array_is_named_before_training(cached, name):
    tmp_path, _ = cached
    path = _entry(tmp_path, f"-{name}.npy")
    arr = np.load(path)
    np.save(path, np.full_like(arr, 10 ** 6))  # same size, values no index can hold
    with pytest.raises(ValueError, match=f"dataset index cache file {path} is damaged \\(values outside"):
        _make(tmp_path)


def test_a_damaged_marker_is_named(cached):
    tmp_path, _ = cached
    path = _entry(tmp_path, ".done")
    open(path, "w").write(json.dumps({"arrays": 3})[:-3])
    with pytest.raises(ValueError, match=f"dataset index cache file {path} is damaged"):
        _make(tmp_path)
