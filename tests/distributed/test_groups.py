"""ParallelState on real gloo ranks: all_reduce inside each group reaches exactly its members."""
import pytest
import torch
import torch.distributed as dist

from megatron_ru.parallel.state import ParallelState
from megatron_ru.parallel.topology import ParallelLayout
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _members(group) -> list[int]:
    """Which global ranks are in ``group``, learned by communication only: every member
    contributes a one-hot vector of its global rank."""
    onehot = torch.zeros(dist.get_world_size())
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    return [i for i, v in enumerate(onehot.tolist()) if v == 1.0]


def _build_and_probe(rank: int, world_size: int, shapes):
    try:
        ParallelState.build(2, 1, world_size=world_size * 2)
        out = ["no error"]
    except ValueError as e:
        out = [str(e)]
    for tp, pp in shapes:
        s = ParallelState.build(tp, pp)
        probe = {"tp": _members(s.tp_group), "dp": _members(s.dp_group), "pp": _members(s.pp_group),
                 "mp": _members(s.mp_group),
                 "embedding": _members(s.embedding_group) if s.embedding_group is not None else None}
        mpu = {
            "tp": (s.get_tensor_model_parallel_rank(), s.get_tensor_model_parallel_world_size(),
                   dist.get_world_size(s.get_tensor_model_parallel_group())),
            "slice": (s.get_slice_parallel_rank(), s.get_slice_parallel_world_size(),
                      dist.get_world_size(s.get_slice_parallel_group())),
            "dp": (s.get_data_parallel_rank(), s.get_data_parallel_world_size(),
                   dist.get_rank(s.get_data_parallel_group())),
            "pp": (s.get_pipe_parallel_rank(), s.get_pipeline_model_parallel_world_size(),
                   dist.get_rank(s.get_pipe_parallel_group())),
            "mp": (s.get_model_parallel_rank(), s.get_model_parallel_world_size(),
                   dist.get_rank(s.get_model_parallel_group())),
            "src": s.get_tensor_model_parallel_src_rank(),
            "dp_ranks": s.get_data_parallel_group_ranks(),
            "stage": (s.is_first_stage, s.is_last_stage),
        }
        out.append((probe, mpu, s.describe()))
    return out


def _check(results, world_size, shapes):
    for per_rank in results:
        assert f"world_size={2 * world_size}" in per_rank[0] and f"WORLD_SIZE={world_size}" in per_rank[0]
    results = [r[1:] for r in results]
    for i, (tp, pp) in enumerate(shapes):
        lay = ParallelLayout(world_size, tp, pp)
        for rank, per_shape in enumerate(results):
            probe, mpu, desc = per_shape[i]
            c = lay.coord(rank)
            for kind in ("tp", "dp", "pp", "mp", "embedding"):
                assert probe[kind] == lay.group_of(kind, rank), (tp, pp, rank, kind)
            assert mpu["tp"] == mpu["slice"] == (c.tp, tp, tp)
            assert mpu["dp"] == (c.dp, lay.dp, c.dp)                 # group rank == dp rank
            assert mpu["pp"] == (c.pp, pp, c.pp)
            mp_group = lay.group_of("mp", rank)
            assert mpu["mp"] == (mp_group.index(rank), tp * pp, mp_group.index(rank))
            assert mpu["src"] == lay.group_of("tp", rank)[0]
            assert mpu["dp_ranks"] == lay.group_of("dp", rank)
            assert mpu["stage"] == (c.pp == 0, c.pp == pp - 1)
            assert (desc["tp_rank"], desc["dp_rank"], desc["pp_rank"]) == (c.tp, c.dp, c.pp)


def test_groups_4_ranks_layouts():
    shapes = [(2, 1), (1, 2), (2, 2), (4, 1)]
    _check(run_distributed(_build_and_probe, 4, args=(shapes,), timeout=120), 4, shapes)


def test_groups_8_ranks_tp2_pp2_dp2():
    shapes = [(2, 2)]
    _check(run_distributed(_build_and_probe, 8, args=(shapes,), timeout=150), 8, shapes)
