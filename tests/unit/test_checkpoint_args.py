"""``--use-checkpoint-args``: the model flags come from the checkpoint's metadata; contradicting
flags are errors naming both values; the tokenizer recorded with the checkpoint is used when no
tokenizer flag is given."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_ru.config.arguments import parse_arguments
from megatron_ru.model.spec import model_args_dict
from tests.integration._train_helpers import TINY_MODEL_FLAGS as MODEL_FLAGS
from tests.integration._train_helpers import tiny_argv
from tests.integration._train_helpers import without_flags as _without


def _write_checkpoint(directory: str, model: dict, vocab_size: int, tokenizer: dict | None = None) -> None:
    it = os.path.join(directory, "iter_0000000")
    os.makedirs(it)
    meta = dict(iteration=0, consumed_train_samples=0, consumed_valid_samples=0, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=0, args={}, files={},
                model_args=model, vocab_size=vocab_size, tokenizer=tokenizer)
    with open(os.path.join(it, "metadata.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("0\n")


def test_model_flags_come_from_the_checkpoint(tmp_path):
    full = parse_arguments(tiny_argv("/nonexistent", "/tmp"), world_size=1, device_type="cpu", validate=False)
    recorded = model_args_dict(full.model)
    recorded["norm_epsilon"] = 1e-6
    _write_checkpoint(str(tmp_path), recorded, vocab_size=151)
    argv = _without(tiny_argv("/nonexistent", "/tmp"), *MODEL_FLAGS)
    args = parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args", "--finetune"],
                           world_size=1, device_type="cpu", validate=False)
    got = dataclasses.asdict(args.model)
    for name in ("hidden_dropout", "attention_dropout"):  # chosen by the run, not the checkpoint
        recorded.pop(name), got.pop(name)
    assert got == recorded
    assert args.model_vocab_size == 151
    # a flag equal to the checkpoint's value is fine; a contradicting one names both values
    parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args", "--hidden-size", "64"],
                    world_size=1, device_type="cpu", validate=False)
    with pytest.raises(ValueError, match=r"--num-layers 2 contradicts the checkpoint's 4; --hidden-size 128 "
                                         r"contradicts the checkpoint's 64"):
        parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args", "--hidden-size", "128",
                                "--num-layers", "2"], world_size=1, device_type="cpu", validate=False)


def test_tokenizer_recorded_with_the_checkpoint(tmp_path):
    full = parse_arguments(tiny_argv("/nonexistent", "/tmp"), world_size=1, device_type="cpu", validate=False)
    tok = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer"}
    _write_checkpoint(str(tmp_path), model_args_dict(full.model), vocab_size=100, tokenizer=tok)
    argv = _without(tiny_argv("/nonexistent", "/tmp"), *MODEL_FLAGS, "--tokenizer-type", "--vocab-size")
    args = parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args"], world_size=1,
                           device_type="cpu", validate=False)
    assert args.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert args.tokenizer.tokenizer_model == os.path.join(str(tmp_path), "tokenizer")
    # tokenizer flags on the command line win (all of them: no mixing of two tokenizers' flags)
    args = parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args", "--tokenizer-type",
                                   "NullTokenizer", "--vocab-size", "90"], world_size=1, device_type="cpu",
                           validate=False)
    assert args.tokenizer.tokenizer_type == "NullTokenizer" and args.tokenizer.tokenizer_model is None


def test_use_checkpoint_args_without_a_checkpoint(tmp_path):
    argv = tiny_argv("/nonexistent", "/tmp")
    with pytest.raises(ValueError, match="--use-checkpoint-args takes the model's flags from a checkpoint: add "
                                         "--load DIR"):
        parse_arguments(argv + ["--use-checkpoint-args"], world_size=1, device_type="cpu", validate=False)
    with pytest.raises(ValueError, match=rf"--load {tmp_path} holds no checkpoint"):
        parse_arguments(argv + ["--use-checkpoint-args", "--load", str(tmp_path)], world_size=1,
                        device_type="cpu", validate=False)
