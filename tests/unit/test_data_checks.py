"""Data problems found by the configuration validation, before any process group exists:
token ids beyond the tokenizer's vocabulary, a corrupt dtype code, an empty validation split, a
tokenizer file that is not a SentencePiece model; and the per-batch token-id check."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.data.blended import BlendedDataset
from megatron_ru.data.gpt_dataset import GPTDataset
from megatron_ru.data.indexed_dataset import IndexedDataset
from megatron_ru.training.data import VocabCheckedDataset, micro_batches
from tests.fixtures.datasets import write_dataset
from tests.fixtures.tokenizers import make_sentencepiece


def argv(prefix, *extra, vocab="100"):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-position-embeddings", "64", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab, "--data-path", prefix, *extra]


def error(args):
    with pytest.raises(ValueError) as e:
        parse_arguments(args, world_size=4, device_type="cpu")
    assert not dist.is_initialized()
    assert str(e.value).startswith("invalid configuration (")
    return str(e.value)


def test_ids_of_a_larger_tokenizer_are_refused_with_dataset_id_and_vocabulary(tmp_path):
    """Data built with a 2,000-piece tokenizer, trained with --vocab-size 100 (NullTokenizer: 101 ids)."""
    prefix = write_dataset(str(tmp_path / "big_text_document"), max_id=1999)
    msg = error(argv(prefix))
    assert f"--data-path {prefix}: token id 1999 is outside the tokenizer's vocabulary of 101 ids (0..100)" in msg
    assert "built with another tokenizer" in msg
    parse_arguments(argv(prefix, vocab="1999"), world_size=4, device_type="cpu")  # 2,000 ids: fine


def test_ids_beyond_a_sentencepiece_vocabulary_are_refused(tmp_path):
    model = make_sentencepiece(tmp_path, vocab=400)
    prefix = write_dataset(str(tmp_path / "d"), max_id=1999)
    args = argv(prefix)
    args[args.index("NullTokenizer")] = "GPTSentencePieceTokenizer"
    args[args.index("--vocab-size"):args.index("--vocab-size") + 2] = ["--tokenizer-model", model]
    msg = error(args)
    assert "token id 1999 is outside the tokenizer's vocabulary of 400 ids" in msg and prefix in msg


def test_corrupt_dtype_code_is_refused(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"))
    with open(prefix + ".idx", "r+b") as f:  # uint16 (8) -> int16 (3): same width, pointers still agree
        f.seek(17)
        assert f.read(1) == struct.pack("<B", 8)
        f.seek(17)
        f.write(struct.pack("<B", 3))
    assert IndexedDataset(prefix).dtype == np.int16
    assert "its index stores tokens as int16, which no tokenizer writer produces" in error(argv(prefix))


def test_dtype_too_narrow_for_the_vocabulary(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"))
    msg = error(argv(prefix, vocab="70000"))
    assert "tokens are stored as uint16 (ids up to 65535), too narrow for the tokenizer's 70001 ids" in msg


def test_empty_validation_split_is_a_configuration_problem(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"))
    msg = error(argv(prefix, "--split", "100,0,0", "--lr", "-1"))
    assert "--split 100,0,0: the valid split of" in msg and "receives no documents" in msg
    assert "--eval-iters 0" in msg
    assert "--lr and --min-lr must be >= 0" in msg  # listed in the same error
    # a share that rounds to zero documents (100 documents x 0.1 %)
    assert "--split 998,1,1: the valid split" in error(argv(prefix, "--split", "998,1,1"))
    parse_arguments(argv(prefix, "--split", "100,0,0", "--eval-iters", "0"), world_size=4, device_type="cpu")


def test_split_of_documents_without_tokens(tmp_path):
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "d")
    with IndexedDatasetBuilder(prefix + ".bin") as b:
        for d in range(10):
            b.add_item(list(range(1, 40)) if d < 9 else [])
            b.end_document()
        b.finalize(prefix + ".idx")
    msg = error(argv(prefix, "--split", "9,1,0"))
    assert "the valid split of" in msg and "(documents [9, 10)) holds no tokens" in msg


def test_tokenizer_file_that_is_not_sentencepiece(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"))
    bogus = tmp_path / "tokenizer.model"
    bogus.write_bytes(b"this is not a protobuf \x00\x01\x02" * 10)
    args = argv(prefix, "--seq-length", "128")
    args[args.index("NullTokenizer")] = "SentencePieceTokenizer"
    args[args.index("--vocab-size"):args.index("--vocab-size") + 2] = ["--tokenizer-model", str(bogus)]
    msg = error(args)
    assert f"--tokenizer-model {bogus}: not a SentencePiece model" in msg
    assert "--seq-length (128) exceeds --max-position-embeddings (64)" in msg  # one error, every problem


def test_corrupt_index_is_listed_with_the_other_problems(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"))
    with open(prefix + ".idx", "r+b") as f:
        f.seek(26)
        f.write(struct.pack("<Q", 31))
    msg = error(argv(prefix, "--lr", "-1e-3"))
    assert f"--data-path {prefix}: {prefix}.idx: inconsistent index" in msg
    assert "--lr and --min-lr must be >= 0" in msg


# ---- the per-batch check (ids the start-up sample did not see) -------------------------------

def _gpt(prefix, n, name="train"):
    ds = IndexedDataset(prefix)
    return GPTDataset(ds, (0, ds.num_documents), n, 16, seed=1, name=name, cache_dir=str(__import__("os").path.dirname(prefix)))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_is_checked_and_names_the_dataset(tmp_path, workers):
    good = write_dataset(str(tmp_path / "good"), max_id=50)
    bad = write_dataset(str(tmp_path / "bad"), max_id=1999, num_docs=20)
    ok = VocabCheckedDataset(_gpt(good, 64), 101, "train")
    assert sum(1 for _ in micro_batches(ok, 0, 4, 0, 1, torch.device("cpu"), workers)) == len(ok) // 4
    blend = BlendedDataset([_gpt(good, 64), _gpt(bad, 64)], [0.5, 0.5], 100)
    checked = VocabCheckedDataset(blend, 101, "train")
    with pytest.raises(ValueError, match=rf"train batch: token id \d{{3,4}} from dataset {bad} is outside the "
                                         r"tokenizer's vocabulary of 101 ids \(0\.\.100\)"):
        for _ in micro_batches(checked, 0, 4, 0, 1, torch.device("cpu"), workers):
            pass
