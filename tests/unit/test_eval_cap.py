"""Item 8 of issue 33: one evaluation reads the validation split at most once (--eval-iters is
lowered to fit, with a notice), instead of cycling a few documents dozens of times."""
import logging

import numpy as np

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
from megatron_ru.data.builder import dataset_sizes
from megatron_ru.training.data import cap_eval_iters, validation_pass_samples


def _corpus(tmp_path, docs=100, length=33):
    prefix = str(tmp_path / "c_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for d in range(docs):
        builder.add_document(np.full(length, d % 50, dtype=np.int64), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def _args(prefix, tmp_path, eval_iters, split="90,10,0"):
    return parse_arguments(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                            "--global-batch-size", "2", "--train-iters", "10", "--eval-interval", "5",
                            "--eval-iters", str(eval_iters), "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "64", "--data-path", prefix, "--split", split,
                            "--data-cache-path", str(tmp_path / "cache")], world_size=1, device_type="cpu")


def test_one_pass_is_megatron_s_count_per_epoch(tmp_path):
    prefix = _corpus(tmp_path)
    assert validation_pass_samples([prefix], (0.9, 0.1, 0.0), 32) == (10 * 33 - 1) // 32  # 10 documents


def test_eval_iters_beyond_the_split_are_capped_with_a_notice(tmp_path, caplog):
    prefix = _corpus(tmp_path)
    args = _args(prefix, tmp_path, eval_iters=100)
    with caplog.at_level(logging.INFO, logger="megatron_ru"):
        logging.getLogger("megatron_ru").addHandler(caplog.handler)
        try:
            cap_eval_iters(args)
        finally:
            logging.getLogger("megatron_ru").removeHandler(caplog.handler)
    assert args.training.eval_iters == 5  # 10 samples in one pass, global batch 2
    (notice,) = [r.getMessage() for r in caplog.records if "--eval-iters" in r.getMessage()]
    assert notice.startswith("--eval-iters 100 asks 200 validation samples per evaluation, but the validation "
                             "split holds 10")
    assert dataset_sizes(10, 2, 5, args.training.eval_iters)[1] == 3 * 5 * 2


def test_eval_iters_within_the_split_or_zero_are_kept(tmp_path):
    prefix = _corpus(tmp_path)
    for wanted in (0, 3, 5):
        args = _args(prefix, tmp_path, eval_iters=wanted)
        cap_eval_iters(args)
        assert args.training.eval_iters == wanted
    args = _args(prefix, tmp_path, eval_iters=4, split="99,1,0")  # 1 document: less than a global batch
    cap_eval_iters(args)
    assert args.training.eval_iters == 1
