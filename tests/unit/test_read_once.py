"""What start-up reads, it reads once (issue: read once, pass the result): the tokenizer and each dataset
index are loaded once by the flag checks and reused by training, the banner's memory prediction and the
planner."""
import os

from megatron_ru.config.arguments import parse_arguments
from megatron_ru.data import indexed_dataset, tokenizer
from tests.integration._train_helpers import make_corpus, tiny_argv


def test_tokenizer_and_dataset_index_are_read_once(tmp_path, monkeypatch):
    from megatron_ru.plan.api import vocab_size_for_arguments
    from megatron_ru.training.data import cap_eval_iters
    builds, opens = [], []
    real_build, real_init = tokenizer._build, indexed_dataset.IndexedDataset.__init__
    monkeypatch.setattr(tokenizer, "_build", lambda cfg: (builds.append(1), real_build(cfg))[1])
    monkeypatch.setattr(indexed_dataset.IndexedDataset, "__init__",
                        lambda self, prefix: (opens.append(prefix), real_init(self, prefix))[1])
    monkeypatch.setattr(indexed_dataset.IndexedDataset, "_opened", {})
    prefix = make_corpus(str(tmp_path))
    args = parse_arguments(tiny_argv(prefix, str(tmp_path / "cache"), extra=["--eval-interval", "5"]),
                           world_size=1, device_type="cpu")
    assert vocab_size_for_arguments(args) == args.built_tokenizer().vocab_size
    cap_eval_iters(args)
    from megatron_ru.training.data import build_datasets
    build_datasets(args, is_builder_rank=True, barrier=None)
    assert len(builds) == 1
    assert opens == [prefix]


def test_a_rewritten_dataset_is_opened_again(tmp_path):
    prefix = make_corpus(str(tmp_path))
    first = indexed_dataset.IndexedDataset.open(prefix)
    assert indexed_dataset.IndexedDataset.open(prefix) is first
    os.utime(prefix + ".idx", ns=(1, 1))  # another version of the file
    assert indexed_dataset.IndexedDataset.open(prefix) is not first
