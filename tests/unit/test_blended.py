"""Blending, splits and the train/valid/test builder (with DataConfig parsing)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_ru.config.data import DataConfig, parse_data_path, parse_split
from megatron_ru.data.blended import BlendedDataset, samples_per_dataset
from megatron_ru.data.builder import build_train_valid_test_datasets as _build, resolve_data, split_document_ranges
from megatron_ru.data.gpt_dataset import GPTDataset
from megatron_ru.data.indexed_dataset import IndexedDataset
from test_gpt_dataset import STRIDE, write_corpus

RU_BASE, EN_BASE = 0, 10_000_000  # token values tell which corpus a sample came from


def build_train_valid_test_datasets(cfg, nums, **kw):
    """Resolve (validate) the configuration once, then build: what parse_arguments does for training."""
    blend, split = resolve_data(cfg, nums)
    return _build(cfg, blend, split, nums, **kw)


def _cfg(tmp_path, data_path, **kw) -> DataConfig:
    return DataConfig(data_path=data_path, data_cache_path=str(tmp_path / "cache"), **kw)


def _corpora(tmp_path, n_ru=40, n_en=40, len_ru=30, len_en=30):
    write_corpus(str(tmp_path / "ru"), [[len_ru]] * n_ru, base=RU_BASE)
    write_corpus(str(tmp_path / "en"), [[len_en]] * n_en, base=EN_BASE)
    return str(tmp_path / "ru"), str(tmp_path / "en")


def test_blend_follows_weights_and_returns_the_component_samples(tmp_path):
    ru, en = _corpora(tmp_path)
    cfg = _cfg(tmp_path, ["0.7", ru, "0.3", en], seq_length=16, split="1,0,0")
    train, valid, test = build_train_valid_test_datasets(cfg, (500, 0, 0), seed=3, is_builder_rank=True, barrier=None)
    assert valid is None and test is None
    assert isinstance(train, BlendedDataset) and len(train) == 500
    from_en = np.array([int(train[i]["tokens"][0]) >= EN_BASE for i in range(len(train))])
    for prefix in (1, 10, 99, 500):  # every prefix of the blend tracks the weights
        assert abs(from_en[:prefix].sum() - 0.3 * prefix) <= 1.0
    for i in (0, 1, 7, 499):  # the blend returns exactly the component dataset's sample
        d, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train[i]["tokens"], train.datasets[d][k]["tokens"])
    # components were asked for Megatron's 0.5 % more than their share
    assert [len(c) >= n for c, n in zip(train.datasets, samples_per_dataset([0.7, 0.3], 500))] == [True, True]


def test_prefixes_alone_are_weighted_by_token_count(tmp_path):
    ru, en = _corpora(tmp_path, len_ru=30, len_en=10)  # 1200 vs 400 tokens → 0.75 / 0.25
    cfg = _cfg(tmp_path, [ru, en], seq_length=8, split="1,0,0")
    train, _, _ = build_train_valid_test_datasets(cfg, (400, 0, 0), seed=0, is_builder_rank=True, barrier=None)
    np.testing.assert_allclose(train.weights, [0.75, 0.25])
    assert np.bincount(train.dataset_index).tolist() == [300, 100]


def test_samples_per_dataset_has_megatrons_margin():
    assert samples_per_dataset([0.7, 0.3], 1000) == [math.ceil(700 * 1.005), math.ceil(300 * 1.005)] == [704, 302]
    assert samples_per_dataset([3, 1], 0) == [0, 0]


def test_zero_weight_dataset_is_left_out(tmp_path):
    ru, en = _corpora(tmp_path)
    cfg = _cfg(tmp_path, ["1", ru, "0", en], seq_length=8, split="1,0,0")
    train, _, _ = build_train_valid_test_datasets(cfg, (50, 0, 0), seed=0, is_builder_rank=True, barrier=None)
    assert len(train.datasets) == 1 and all(int(train[i]["tokens"][0]) < EN_BASE for i in range(50))


def test_blend_refuses_a_too_small_component(tmp_path):
    ru, en = _corpora(tmp_path)
    small = GPTDataset(IndexedDataset(en), (0, 40), 1, 8, 0, cache_dir=str(tmp_path / "cache"))
    big = GPTDataset(IndexedDataset(ru), (0, 40), 1, 8, 0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"has \d+ samples but the blend needs"):
        BlendedDataset([big, small], [0.5, 0.5], 2 * len(small) + 10)


def test_split_ranges_follow_megatron_rounding():
    assert split_document_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(20, parse_split("969,30,1")) == [(0, 19), (19, 20), (20, 20)]
    assert split_document_ranges(10, parse_split("8,2")) == [(0, 8), (8, 10), (10, 10)]
    # 7/3 rounds to 2 three times (6 documents): Megatron shifts every bound by the missing 1
    assert split_document_ranges(7, parse_split("1/1/1")) == [(0, 3), (3, 5), (5, 7)]
    for n in range(0, 30):  # always a partition of [0, n)
        r = split_document_ranges(n, parse_split("5,3,1"))
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(r, r[1:]))


def test_single_dataset_splits_are_disjoint_documents(tmp_path):
    write_corpus(str(tmp_path / "c"), [[12]] * 100)
    cfg = _cfg(tmp_path, [str(tmp_path / "c")], seq_length=8, split="80,15,5")
    train, valid, test = build_train_valid_test_datasets(cfg, (100, 20, 5), seed=1, is_builder_rank=True, barrier=None)
    for ds, (lo, hi), n in ((train, (0, 80), 100), (valid, (80, 95), 20), (test, (95, 100), 5)):
        assert len(ds) >= n
        docs = {int(t) // STRIDE for i in range(len(ds)) for t in ds[i]["tokens"]}
        assert docs <= set(range(lo, hi))


def test_empty_split_message_names_split_and_corpus_size(tmp_path):
    write_corpus(str(tmp_path / "c"), [[12]] * 20)
    cfg = _cfg(tmp_path, [str(tmp_path / "c")], seq_length=8)  # default 969,30,1: test split gets 0 of 20
    with pytest.raises(ValueError, match=r"--split 969,30,1: the test split of .* receives no documents \(its share "
                                         r"of the 20 documents rounds to zero\), but 3 samples are asked of it"):
        build_train_valid_test_datasets(cfg, (10, 2, 3), seed=0, is_builder_rank=True, barrier=None)
    train, valid, test = build_train_valid_test_datasets(cfg, (10, 2, 0), seed=0, is_builder_rank=True, barrier=None)
    assert test is None and len(train) >= 10 and len(valid) >= 2


def test_builder_passes_sample_start_and_validates_config(tmp_path):
    write_corpus(str(tmp_path / "c"), [[5, 6], [9, 2]] * 10)
    cfg = _cfg(tmp_path, [str(tmp_path / "c")], seq_length=8, split="1", sample_start="paragraph")
    train, valid, test = build_train_valid_test_datasets(cfg, (30, 0, 0), seed=0, is_builder_rank=True, barrier=None)
    assert valid is None and test is None
    assert all(int(train[i]["tokens"][0]) % STRIDE in (0, 5, 9) for i in range(len(train)))
    bad = _cfg(tmp_path, [str(tmp_path / "nope")], seq_length=0, split="a,b")
    with pytest.raises(ValueError) as err:
        build_train_valid_test_datasets(bad, (1, 0, 0), seed=0, is_builder_rank=True, barrier=None)
    msg = str(err.value)
    assert "--data-path: dataset" in msg and "--split 'a,b'" in msg and "--seq-length must be >= 1" in msg


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.7", "ru", "0.3", "en"]) == (["ru", "en"], [0.7, 0.3])
    for bad, match in ((["0.7", "ru", "en"], "mix of weights and prefixes"), (["0.5", "0.5"], "mix"),
                       (["-1", "a"], "non-negative"), (["0", "a"], "not all zero"), ([], "--data-path is required")):
        with pytest.raises(ValueError, match=match):
            parse_data_path(bad)


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("", "1,2,3,4", "1,-1", "0,0", "x"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_data_config_flags():
    from megatron_ru.config.base import parse_configs
    cfg = parse_configs([DataConfig], ["--data-path", "0.7", "ru", "0.3", "en", "--split", "98,2,0",
                                       "--seq-length", "2048", "--sample-start", "document",
                                       "--data-cache-path", "/x", "--mmap-warmup"])[DataConfig]
    assert cfg.data_path == ["0.7", "ru", "0.3", "en"] and cfg.split == "98,2,0" and cfg.seq_length == 2048
    assert cfg.sample_start == "document" and cfg.data_cache_path == "/x" and cfg.mmap_warmup
    assert DataConfig().sample_start == "any" and DataConfig().split == "969,30,1"
    with pytest.raises(SystemExit):
        parse_configs([DataConfig], ["--sample-start", "sentence"])


def test_builder_cli_describes_and_caches(tmp_path, capsys):
    from megatron_ru.data.builder import main
    ru, en = _corpora(tmp_path)
    lines = main(["--data-path", "0.7", ru, "0.3", en, "--seq-length", "16", "--split", "90,10,0",
                  "--data-cache-path", str(tmp_path / "cache"), "--train-samples", "100", "--valid-samples", "10",
                  "--sample-start", "document"])
    assert lines[0].startswith("train: 100 samples of 17 tokens (") and "skipped" in lines[0]
    assert lines[1].startswith("valid: 10 samples") and lines[2] == "test: none"
    assert capsys.readouterr().out.splitlines() == lines
    assert len([f for f in (tmp_path / "cache").iterdir() if f.name.endswith(".done")]) == 4
