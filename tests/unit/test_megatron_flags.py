"""The Megatron flag table (megatron_ru/flags/megatron_flags.py): one class per flag, the generated doc in step
with it, spellings that give exactly the configuration of the flags they stand for, refusals in one line each."""
from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.flags.megatron_flags import NO_EFFECT, REFUSED, SPELLING, TABLE, markdown, same_flags
from tests.integration._train_helpers import make_corpus, tiny_argv, without_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return make_corpus(str(d)), str(d / "cache")


def _parse(corpus, *extra, drop=()):
    return parse_arguments(without_flags(tiny_argv(*corpus), *drop) + list(extra), world_size=2, device_type="cpu")


def _configs(args):
    return {name: dataclasses.asdict(getattr(args, name)) for name in ("parallel", "model", "data", "tokenizer",
                                                                       "training", "optimizer", "checkpoint",
                                                                       "logging", "lora")}


def test_the_doc_is_generated_from_the_table():
    with open(os.path.join(REPO, "docs", "megatron_flags.md"), encoding="utf-8") as f:
        assert f.read() == markdown(same_flags()), "regenerate: python -m megatron_ru.flags.megatron_flags > " \
                                                   "docs/megatron_flags.md"


def test_every_flag_is_in_exactly_one_class():
    flags = [f.flag for f in TABLE]
    assert len(flags) == len(set(flags))
    assert not set(flags) & set(same_flags())  # a flag of ours is "same", never also in the table
    assert {f.kind for f in TABLE} == {SPELLING, NO_EFFECT, REFUSED}
    for f in TABLE:
        assert f.note and f.source in ("LM", "DS", "LM, DS"), f
        assert f.kind != SPELLING or f.apply is not None or f.flag == "--recompute-num-layers" or \
            f.flag == "--recompute-method", f


@pytest.mark.parametrize("spelling, ours, drop", [
    (["--num-key-value-heads", "2"], ["--group-query-attention", "--num-query-groups", "2"],
     ("--group-query-attention", "--num-query-groups")),
    (["--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", "500000"],
     ["--position-embedding-type", "rope", "--rotary-base", "500000"], ("--position-embedding-type",)),
    (["--use-distributed-optimizer"], ["--zero-stage", "1"], ()),
    (["--wandb-project", "p", "--wandb-name", "n"], ["--wandb-project", "p", "--wandb-exp-name", "n"], ()),
    (["--data-impl", "mmap", "--context-parallel-size", "1", "--rotary-percent", "1.0"], [], ()),
    (["--normalization", "rmsnorm"], ["--normalization", "RMSNorm"], ("--normalization",)),
    (["--ckpt-format", "torch_dist"], ["--ckpt-format", "megatron_ru"], ()),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2", "--distribute-checkpointed-activations"],
     ["--checkpoint-activations", "--recompute-num-layers", "2", "--distribute-saved-activations"], ()),
    (["--recompute-granularity", "full", "--partition-activations"],
     ["--recompute-granularity", "full", "--distribute-saved-activations"], ()),
    (["--recompute-activations"], ["--recompute-granularity", "selective"], ()),
    (["--layernorm-epsilon", "1e-6", "--accumulate-allreduce-grads-in-fp32", "--universal-checkpoint"],
     ["--norm-epsilon", "1e-6"], ()),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"],
     ["--position-embedding-type", "rope", "--rope-scaling-type", "llama3", "--rope-scaling-factor", "32",
      "--rope-scaling-low-freq-factor", "1", "--rope-scaling-high-freq-factor", "4",
      "--rope-scaling-original-max-position-embeddings", "8192"], ("--position-embedding-type",)),
    (["--save", "ckpt", "--exit-signal-handler-for-training", "--lr-warmup-init", "0", "--softmax-type", "vanilla",
      "--exp-avg-dtype", "fp32", "--main-params-dtype", "fp32", "--weight-decay-incr-style", "constant"],
     ["--save", "ckpt", "--exit-signal-handler"], ()),
])
def test_a_spelling_is_exactly_the_flags_it_stands_for(corpus, spelling, ours, drop, monkeypatch):
    monkeypatch.setattr("megatron_ru.config.training.wandb_installed", lambda: True)
    assert _configs(_parse(corpus, *spelling, drop=drop)) == _configs(_parse(corpus, *ours, drop=drop))


def test_no_effect_flags_change_nothing_and_are_listed(corpus):
    flags = []
    for f in TABLE:
        if f.kind == NO_EFFECT and f.flag not in ("--tiktoken-pattern", "--no-initialization"):
            flags += [f.flag] + (["1"] if f.arity in (1, "+") else [])
    args = _parse(corpus, *flags)
    assert _configs(args) == _configs(_parse(corpus))
    assert sorted(args.megatron_no_effect) == sorted(f for f in flags if f.startswith("--"))


def test_refused_flags_say_so_in_one_line_each(corpus):
    with pytest.raises(ValueError) as e:
        _parse(corpus, "--rotary-percent", "0.5", "--data-impl", "lazy", "--num-experts", "8")
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid configuration (3 problems):"
    assert lines[1:] == [  # in the table's order
        "  - --data-impl lazy is not supported: megatron_ru reads the mmap format (.bin/.idx, MMIDIDX) that "
        "tools/preprocess_data.py writes; use --data-impl mmap (or drop the flag)",
        "  - --rotary-percent 0.5 is not supported: partial rotary embeddings are not available; use --rotary-percent 1.0",
        "  - --num-experts is not supported: mixture-of-experts layers are not available: dense models only"]


def test_the_vocabulary_s_refusals_and_value_checks(corpus):
    with pytest.raises(ValueError) as e:
        _parse(corpus, "--fp8-margin", "0", "--inprocess-restart", "--lr-warmup-init", "1e-5", "--no-initialization",
               "--softmax-type", "learnable", "--accumulate-allreduce-grads-in-fp32", "--fp16")
    lines = str(e.value).splitlines()[1:]
    assert ("  - --fp8-margin is not supported: this low-precision setting (FP4, MXFP8, TransformerEngine's delayed FP8 "
            "scaling and its knobs) is not available: use --fp8-format with --fp8-recipe tensorwise or rowwise "
            "(torchao), or --bf16") in lines
    assert any(line.startswith("  - --inprocess-restart is not supported: in-process restart is not available")
               for line in lines)
    assert "  - --lr-warmup-init 1e-5 is not supported: the warmup here rises from 0 to --lr; use --lr-warmup-init 0" \
        in lines
    assert any(line.startswith("  - --no-initialization without --load") for line in lines)
    assert any(line.startswith("  - --softmax-type learnable is not supported") for line in lines)
    assert any(line.startswith("  - --accumulate-allreduce-grads-in-fp32 with --fp16 is not supported") for line in lines)
    assert all(line.startswith("  - ") for line in lines)


def test_a_spelling_that_contradicts_our_flag_is_an_error(corpus):
    with pytest.raises(ValueError, match=r"--use-distributed-optimizer shards the optimizer state \(ZeRO stage 1\), but "
                                         r"--zero-stage 0 is given too"):
        _parse(corpus, "--use-distributed-optimizer", "--zero-stage", "0")
    with pytest.raises(ValueError, match=r"--num-key-value-heads 2 means --num-query-groups 2, but --num-query-groups "
                                         r"4 is given too"):
        _parse(corpus, "--num-key-value-heads", "2")


def test_megatron_behaviours_for_values_we_used_to_refuse(corpus):
    args = _parse(corpus, "--sequence-parallel", "--bf16", "--zero-stage", "0")
    assert args.sequence_parallel is False and args.training.zero_stage == 1
    assert len(args.notices) == 2


def test_mock_data_needs_no_dataset_and_gives_the_same_samples_everywhere(tmp_path):
    """--mock-data (Megatron-LM's throughput flag): no --data-path, seeded samples independent of the layout."""
    import numpy as np

    from megatron_ru.training.data import MockDataset, build_datasets
    argv = without_flags(tiny_argv(str(tmp_path / "none"), str(tmp_path / "cache")), "--data-path")
    args = parse_arguments([*argv, "--mock-data", "--eval-interval", "5"], world_size=2, device_type="cpu")
    train, valid, test = build_datasets(args, is_builder_rank=True, barrier=None)
    assert isinstance(train, MockDataset) and len(train) == 10 * 4 and len(valid) == 3 * 2 * 4 and len(test) == 0
    sample = train[7]["tokens"]
    vocab = args.built_tokenizer().vocab_size  # NullTokenizer: --vocab-size 95 and the end-of-document id
    assert vocab == 96 and sample.shape == (33,) and sample.min() >= 0 and sample.max() < vocab
    assert np.array_equal(sample, MockDataset(40, 32, vocab, 7, 0)[7]["tokens"])  # --seed 7, split 0, index 7
    assert not np.array_equal(sample, train[8]["tokens"]) and not np.array_equal(sample, valid[7]["tokens"])
    with pytest.raises(ValueError, match="--mock-data trains on synthetic tokens and --data-path on a dataset"):
        parse_arguments([*tiny_argv(str(tmp_path / "x"), str(tmp_path / "c")), "--mock-data"], world_size=1,
                        device_type="cpu")
