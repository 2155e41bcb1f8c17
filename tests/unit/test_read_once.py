"""What start-up reads, it reads once (issue: read once, pass the result): the tokenizer and each dataset
index are loaded once by the flag checks and reused by training, the banner's memory prediction and the
planner."""
import os

from megatron_ru.flags.arguments import parse_arguments
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


def _count_checkpoint_reads(rank: int, world_size: int, save: str, prefix: str, cache: str) -> list[dict[str, int]]:
    """Rank body: train 3 iterations into ``save``, then count the reads of its pointer and metadata.json while
    a continued run (``--load`` = ``--save``) parses its flags and sets up (resume included): with
    ``--use-checkpoint-args`` (the flags read the checkpoint first) and without (the --save checks do)."""
    import builtins
    import contextlib

    import torch.distributed as dist

    from megatron_ru.checkpointing import meta as meta_module
    from megatron_ru.checkpointing.meta import METADATA_FILE, TRACKER_FILE
    from megatron_ru.training.pretrain import run, setup
    from tests.integration._train_helpers import TINY_MODEL_FLAGS, without_flags
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run(parse_arguments(tiny_argv(prefix, cache, iters=3, extra=["--save", save, "--save-interval", "3"]),
                        world_size=world_size, device_type="cpu"))
    dist.barrier()
    real_open, real_read = builtins.open, meta_module.CheckpointMeta.read.__func__
    continued = tiny_argv(prefix, cache, iters=4, extra=["--save", save, "--load", save])
    out = []
    for argv in (without_flags(continued, *TINY_MODEL_FLAGS) + ["--use-checkpoint-args"], continued):
        meta_module._READ.clear()  # what this process read before does not count
        reads = {TRACKER_FILE: 0, METADATA_FILE: 0, "CheckpointMeta.read": 0}

        def counting_read(cls, ckpt_dir):  # also the calls that the per-file cache of CheckpointMeta.read answers
            reads["CheckpointMeta.read"] += 1
            return real_read(cls, ckpt_dir)

        def counting_open(file, mode="r", *a, **kw):
            name = os.path.basename(str(file))
            if name in reads and "r" in mode:
                reads[name] += 1
            return real_open(file, mode, *a, **kw)

        builtins.open, meta_module.CheckpointMeta.read = counting_open, classmethod(counting_read)
        try:
            args = parse_arguments(argv, world_size=world_size, device_type="cpu")
            with contextlib.ExitStack() as resources:
                trainer = setup(args, resources=resources)
        finally:
            builtins.open, meta_module.CheckpointMeta.read = real_open, classmethod(real_read)
        assert trainer.progress.iteration == 3
        out.append(reads)
        dist.barrier()
    return out


def test_checkpoint_pointer_and_metadata_are_read_once_per_process(tmp_path):
    """A continued run reads ``latest_checkpointed_iteration.txt`` and ``metadata.json`` once in each process:
    --use-checkpoint-args, the --save/--load checks, the vocabulary rows, the model check and the load itself
    share what the first of them read (``Arguments.load_target``). Before: rank 0 read the pointer 7 times and
    called CheckpointMeta.read 4 times (its cache kept the file opens at 1), rank 1 4 and 4, in both start-ups."""
    from tests.dist_utils import run_distributed
    prefix = make_corpus(str(tmp_path))
    counts = run_distributed(_count_checkpoint_reads, 2, args=(str(tmp_path / "ckpt"), prefix,
                                                               str(tmp_path / "cache")),
                             timeout=300, env={"DS_ACCELERATOR": "cpu"})
    once = {"latest_checkpointed_iteration.txt": 1, "metadata.json": 1, "CheckpointMeta.read": 1}
    assert counts == [[once, once]] * 2, counts
