import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # spawns gloo ranks


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def test_run_distributed_returns_by_rank():
    assert run_distributed(_allreduce, 2, timeout=60) == [3.0, 3.0]


def test_run_distributed_reports_rank_error():
    with pytest.raises(RuntimeError, match="boom from rank 1"):
        run_distributed(_fail_on_one, 2, timeout=60)
