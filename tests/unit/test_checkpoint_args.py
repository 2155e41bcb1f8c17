"""``--use-checkpoint-args``: the model flags come from the checkpoint's metadata; contradicting
flags are errors naming both values; the tokenizer recorded with the checkpoint is used when no
tokenizer flag is given."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_ru.flags.arguments import parse_arguments
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


def test_dropout_defaults_to_the_checkpoints(tmp_path):
    """Megatron's default dropout (0.1) on an imported LLaMA/Mistral/Qwen2 silently trains a broken
    network: the checkpoint's dropout is the default under --use-checkpoint-args, for an imported
    model (0, or config.json's attention_dropout), an adapted one and any later one; a dropout flag
    on the command line wins without a conflict."""
    import argparse

    from megatron_ru.adapt.adapt_vocab import add_arguments, adapt_vocab
    from megatron_ru.flags.checkpoint_args import read_checkpoint_meta
    from megatron_ru.convert.import_hf import import_hf
    from megatron_ru.data.tokenizer import GPTSentencePieceTokenizer
    from tests.fixtures.models import tiny_llama
    from tests.fixtures.tokenizers import adaptation_tokenizers

    old_sp, new_sp, tok_dir = adaptation_tokenizers(str(tmp_path))
    hf = tiny_llama(str(tmp_path / "hf"), vocab_size=GPTSentencePieceTokenizer(old_sp).vocab_size,
                    tokenizer_dir=tok_dir)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["attention_dropout"] = 0.05                  # a source that does use some: recorded as it is
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    imported = str(tmp_path / "imported")
    import_hf(hf, imported)
    p = argparse.ArgumentParser()
    add_arguments(p)
    adapted = str(tmp_path / "adapted")
    adapt_vocab(p.parse_args(["--model", imported, "--new-tokenizer", new_sp, "--save", adapted]))
    # the README's continued-pretraining command: no dropout flags
    argv = _without(tiny_argv("/nonexistent", "/tmp"), *MODEL_FLAGS, "--tokenizer-type", "--vocab-size",
                    "--hidden-dropout", "--attention-dropout")
    for ckpt in (imported, adapted):
        assert read_checkpoint_meta(ckpt).model_args["hidden_dropout"] == 0.0
        args = parse_arguments(argv + ["--load", ckpt, "--use-checkpoint-args", "--finetune"], world_size=1,
                               device_type="cpu", validate=False)
        assert (args.model.hidden_dropout, args.model.attention_dropout) == (0.0, 0.05), ckpt
        args = parse_arguments(argv + ["--load", ckpt, "--use-checkpoint-args", "--hidden-dropout", "0.2"],
                               world_size=1, device_type="cpu", validate=False)
        assert (args.model.hidden_dropout, args.model.attention_dropout) == (0.2, 0.05)
    # without --use-checkpoint-args the flags (and Megatron's defaults) stand as before
    args = parse_arguments(argv + ["--load", imported], world_size=1, device_type="cpu", validate=False)
    assert (args.model.hidden_dropout, args.model.attention_dropout) == (0.1, 0.1)


def test_later_checkpoints_record_the_dropout_they_trained_with(tmp_path):
    """A run's checkpoints (continued pretraining, LoRA) record the run's dropout, so the next
    --use-checkpoint-args run carries it on."""
    from megatron_ru.training.pretrain import checkpoint_record
    _write_checkpoint(str(tmp_path), model_args_dict(parse_arguments(
        tiny_argv("/nonexistent", "/tmp"), world_size=1, device_type="cpu", validate=False).model), vocab_size=151)
    argv = _without(tiny_argv("/nonexistent", "/tmp"), *MODEL_FLAGS, "--hidden-dropout", "--attention-dropout")
    args = parse_arguments(argv + ["--load", str(tmp_path), "--use-checkpoint-args", "--lora-rank", "4"],
                           world_size=1, device_type="cpu", validate=False)
    record = checkpoint_record(args, 151)
    assert record["model_args"]["hidden_dropout"] == 0.0 and record["model_args"]["attention_dropout"] == 0.0
