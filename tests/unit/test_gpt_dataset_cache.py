"""Index cache: built once, keyed by everything that affects it, never stale, never partial."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from megatron_ru.data import cache as cache_mod
from megatron_ru.data import gpt_dataset
from megatron_ru.data.gpt_dataset import GPTDataset
from megatron_ru.data.indexed_dataset import IndexedDataset
from test_gpt_dataset import write_corpus


class CountingBuild:
    """Wraps build_gpt_indices to count calls (per thread name) and optionally fail."""

    def __init__(self, monkeypatch, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail
        real = gpt_dataset.build_gpt_indices

        def wrapped(*args, **kwargs):
            self.calls.append(threading.current_thread().name)
            if self.fail:
                raise RuntimeError("build failed on purpose")
            return real(*args, **kwargs)
        monkeypatch.setattr(gpt_dataset, "build_gpt_indices", wrapped)


def _make(tmp_path, cache="cache", **kw):
    args = dict(document_range=(0, 6), num_samples=30, seq_length=7, seed=1)
    args.update(kw)
    return GPTDataset(IndexedDataset(str(tmp_path / "c")), args.pop("document_range"), args.pop("num_samples"),
                      args.pop("seq_length"), args.pop("seed"), cache_dir=str(tmp_path / cache), **args)


def _samples(ds) -> np.ndarray:
    return np.stack([ds[i]["tokens"] for i in range(len(ds))])


def test_second_build_loads_the_cache(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    first = _make(tmp_path)
    counter = CountingBuild(monkeypatch, fail=True)  # any rebuild would raise
    second = _make(tmp_path)
    assert counter.calls == []
    assert isinstance(second.sample_idx, np.memmap)
    np.testing.assert_array_equal(_samples(first), _samples(second))
    files = sorted(os.listdir(tmp_path / "cache"))
    assert not [f for f in files if ".tmp-" in f]
    assert len([f for f in files if f.endswith(".done")]) == 1 and len([f for f in files if f.endswith(".npy")]) == 3


@pytest.mark.parametrize("change", [dict(seed=2), dict(seq_length=8), dict(num_samples=31),
                                    dict(document_range=(1, 6)), dict(sample_start="document"),
                                    dict(name="valid")])
def test_every_parameter_changes_the_key(tmp_path, change):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    base = _make(tmp_path)
    other = _make(tmp_path, **change)
    assert other.cache_stem != base.cache_stem


def test_regenerated_dataset_at_same_path_never_reuses_stale_indices(tmp_path):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    old = _make(tmp_path)
    # same path, same number of documents, different lengths (and contents)
    docs = write_corpus(str(tmp_path / "c"), [[3], [20, 2], [5], [11], [1, 1, 1], [8]], base=500_000)
    new = _make(tmp_path)
    assert new.cache_stem != old.cache_stem
    stream = np.concatenate([docs[d] for d in new.doc_idx])
    for i in range(len(new)):
        k = int(new.shuffle_idx[i])
        np.testing.assert_array_equal(new[i]["tokens"], stream[k * 7:k * 7 + 8])


def test_partial_cache_is_rebuilt_not_read(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    good = _samples(_make(tmp_path))
    stem = _make(tmp_path).cache_stem
    os.remove(stem + ".done")  # as if the writer died before the marker
    with open(stem + "-sample_idx.npy", "wb") as f:
        f.write(b"garbage")
    counter = CountingBuild(monkeypatch)
    again = _make(tmp_path)
    assert len(counter.calls) == 1
    np.testing.assert_array_equal(_samples(again), good)
    # marker present but an array missing: also incomplete
    os.remove(stem + "-doc_idx.npy")
    _make(tmp_path)
    assert len(counter.calls) == 2


def test_marker_is_written_last_under_temp_names(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    renames = []
    real = os.replace

    def spy(src, dst):
        renames.append((src, dst))
        return real(src, dst)
    monkeypatch.setattr(cache_mod.os, "replace", spy)
    _make(tmp_path)
    names = [d.rsplit("-", 1)[-1] for _, d in renames]
    assert names[:3] == ["doc_idx.npy", "sample_idx.npy", "shuffle_idx.npy"] and len(names) == 4
    assert renames[-1][1].endswith(".done")
    assert all(".tmp-" in s and s.startswith(d) for s, d in renames)


def test_default_cache_dir_is_next_to_the_data(tmp_path):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "c")), (0, 6), 5, 7, 1)
    assert os.path.dirname(ds.cache_stem) == str(tmp_path / "index-cache")


def _ranks(tmp_path, monkeypatch, builder_fails=False, shared=True):
    """Two 'ranks' as threads with a real barrier; rank 0 builds."""
    counter = CountingBuild(monkeypatch, fail=builder_fails)
    barrier = threading.Barrier(2, timeout=30)
    waits = []
    results, errors = {}, {}

    def rank(r):
        def wait():
            waits.append(r)
            barrier.wait()
        try:
            results[r] = _make(tmp_path, cache="cache" if shared or r == 0 else f"cache{r}",
                               is_builder_rank=(r == 0), barrier=wait)
        except Exception as exc:  # noqa: BLE001 - collected for the assertions
            errors[r] = exc
    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return counter, results, errors, waits


def test_only_the_builder_rank_builds(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    counter, results, errors, waits = _ranks(tmp_path, monkeypatch)
    assert errors == {}
    assert counter.calls == ["rank0"]
    assert sorted(waits) == [0, 1]
    np.testing.assert_array_equal(_samples(results[0]), _samples(results[1]))


def test_unshared_cache_dir_rebuilds_locally(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    counter, results, errors, _ = _ranks(tmp_path, monkeypatch, shared=False)
    assert errors == {}
    assert sorted(counter.calls) == ["rank0", "rank1"]
    np.testing.assert_array_equal(_samples(results[0]), _samples(results[1]))


def test_builder_failure_releases_the_barrier(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "c"), [[9, 4]] * 6)
    counter, results, errors, waits = _ranks(tmp_path, monkeypatch, builder_fails=True)
    assert sorted(waits) == [0, 1]  # nobody hangs
    assert set(errors) == {0, 1} and all("build failed on purpose" in str(e) for e in errors.values())
