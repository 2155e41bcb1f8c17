"""The layout resolved at parse time (from the launcher's environment) is checked against the
real process group: a mismatch is a clear error, not a silently different DP size."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _body(rank: int, world_size: int, prefix: str) -> str:
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.pretrain import setup
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings",
            "32", "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--data-path", prefix, "--distributed-timeout-minutes", "1"]
    args = parse_arguments(argv, world_size=4, device_type="cpu")  # the environment said 4 ranks
    assert args.layout.dp == 4
    with pytest.raises(ValueError) as e:
        setup(args)
    return str(e.value)


def test_layout_is_checked_against_the_real_world_size(tmp_path):
    from tests.fixtures.datasets import write_dataset
    prefix = write_dataset(str(tmp_path / "d"))
    for msg in run_distributed(_body, world_size=2, args=(prefix,), timeout=120):
        assert "world_size=4" in msg and "WORLD_SIZE=2" in msg
