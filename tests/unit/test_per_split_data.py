"""Separate data per split (Megatron's --train-data-path / --valid-data-path / --test-data-path, the blend in a
file with --data-args-path / --per-split-data-args-path): each split reads all the documents of its own
datasets. Checked sample by sample against the --data-path path that gives one split every document (--split
100,0,0 / 0,100,0), and the blend files against the same flags on the command line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.data.builder import build_train_valid_test_datasets
from megatron_ru.data.checks import DataBlend
from megatron_ru.training.data import build_datasets
from tests.fixtures.datasets import write_dataset


def _argv(*data):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "5", "--eval-interval", "5", "--eval-iters", "2", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--num-workers", "0", *data]


def _samples(ds):
    return None if ds is None else np.stack([ds[i]["tokens"] for i in range(len(ds))])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("per_split")
    a, b, c = (write_dataset(str(d / n), num_docs=60, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    return d, a, b, c


def _build(tmp_path, *data):
    args = parse_arguments(_argv("--data-cache-path", str(tmp_path / "cache"), *data), world_size=1,
                           device_type="cpu")
    return args, build_datasets(args, True, None)


def test_each_split_reads_all_documents_of_its_own_datasets(data, tmp_path):
    _, a, b, c = data
    args, (train, valid, test) = _build(tmp_path, "--train-data-path", "0.3", a, "0.7", c, "--valid-data-path", b)
    assert args.blend is None and args.data.per_split
    assert test is None  # training asks no test samples
    # the same blend by --data-path with every document in the train split; the valid one likewise
    _, (ref_train, _, _) = _build(tmp_path, "--data-path", "0.3", a, "0.7", c, "--split", "100,0,0",
                                  "--eval-iters", "0")
    ref_valid = build_train_valid_test_datasets(args.data, DataBlend((b,), None), (0.0, 1.0, 0.0), (0, len(valid), 0),
                                                args.training.seed, is_builder_rank=True, barrier=None)[1]
    np.testing.assert_array_equal(_samples(train), _samples(ref_train))
    np.testing.assert_array_equal(_samples(valid), _samples(ref_valid))
    assert len(train) >= 5 * 4 and len(valid) >= 2 * 2 * 4


def test_blends_read_from_files_equal_the_flags(data, tmp_path):
    d, a, b, c = data
    (d / "blend.txt").write_text(f"0.3 {a}\n0.7 {c}\n")
    _, by_flag = _build(tmp_path, "--data-path", "0.3", a, "0.7", c)
    _, by_file = _build(tmp_path, "--data-args-path", str(d / "blend.txt"))
    for x, y in zip(by_flag, by_file):
        np.testing.assert_array_equal(_samples(x), _samples(y))
    (d / "splits.json").write_text(json.dumps({"train": ["0.3", a, "0.7", c], "valid": f"1 {b}", "test": None}))
    _, flags = _build(tmp_path, "--train-data-path", "0.3", a, "0.7", c, "--valid-data-path", "1", b)
    _, from_json = _build(tmp_path, "--per-split-data-args-path", str(d / "splits.json"))
    for x, y in zip(flags, from_json):
        np.testing.assert_array_equal(_samples(x), _samples(y))


def test_no_validation_data_means_no_evaluation_and_split_is_named_unused(data, tmp_path):
    _, a, _, _ = data
    args, (train, valid, _) = _build(tmp_path, "--train-data-path", a, "--split", "90,10,0")
    assert valid is None and args.training.eval_iters == 0
    assert any("no validation datasets (--valid-data-path): no evaluation" in n for n in args.notices)
    assert any("--split 90,10,0 is not used" in n for n in args.notices)


@pytest.mark.parametrize("data_flags, message", [
    (lambda a, d: ["--data-path", a, "--train-data-path", a],
     "--data-path and --train/valid/test-data-path each name the training data: give one of them"),
    (lambda a, d: ["--data-path", a, "--data-args-path", str(d / "x")],
     "--data-path and --data-args-path each name the training data"),
    (lambda a, d: ["--valid-data-path", a],
     "--valid-data-path or --test-data-path without --train-data-path: training needs --train-data-path"),
    (lambda a, d: ["--train-data-path", a + "_missing"], "--train-data-path: dataset"),
    (lambda a, d: ["--data-args-path", str(d / "nothing.txt")], "nothing.txt: cannot be read"),
    (lambda a, d: ["--per-split-data-args-path", str(d / "bad.json")],
     "expected a JSON object with the keys train, valid, test"),
])
def test_bad_data_sources_are_named(data, tmp_path, data_flags, message):
    d, a, _, _ = data
    (d / "bad.json").write_text(json.dumps({"train": [a]}))
    with pytest.raises(ValueError) as e:
        parse_arguments(_argv(*data_flags(a, d)), world_size=1, device_type="cpu")
    assert message in str(e.value)
