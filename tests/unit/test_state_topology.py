"""Pure grid math (no processes): world sizes 1..64, DP-size rule, DeepSpeed agreement, CLI."""
import json
import re
from pathlib import Path

import pytest

from megatron_ru.parallel.state import ParallelState, main
from megatron_ru.parallel.topology import ParallelLayout, layout_problems, valid_pairs

ALL_SHAPES = [(w, tp, pp) for w in range(1, 65) for tp, pp in valid_pairs(w)]


def _assert_partition(groups, world_size, size):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world_size))
    assert all(len(g) == size for g in groups)
    assert all(g == sorted(g) for g in groups)


def test_every_valid_pair_of_every_world_size_up_to_64():
    assert len(ALL_SHAPES) > 500  # the table really covers many shapes
    for w, tp, pp in ALL_SHAPES:
        lay = ParallelLayout(w, tp, pp)
        assert lay.dp * tp * pp == w
        _assert_partition(lay.tp_groups(), w, tp)
        _assert_partition(lay.dp_groups(), w, lay.dp)
        _assert_partition(lay.pp_groups(), w, pp)
        _assert_partition(lay.mp_groups(), w, tp * pp)
        coords = [lay.coord(r) for r in range(w)]
        for r, c in enumerate(coords):
            assert lay.rank(c.tp, c.dp, c.pp) == r
            assert r == c.tp + tp * (c.dp + lay.dp * c.pp)  # Megatron order: TP fastest, then DP, PP
        # members of a TP group differ only in tp rank (listed in order), etc.
        for kind, axis, others in (("tp", "tp", ("dp", "pp")), ("dp", "dp", ("tp", "pp")),
                                   ("pp", "pp", ("tp", "dp"))):
            for g in dict(lay.groups())[kind]:
                assert [getattr(coords[x], axis) for x in g] == list(range(len(g)))
                assert len({tuple(getattr(coords[x], o) for o in others) for x in g}) == 1
        for g in lay.mp_groups():
            assert len({coords[x].dp for x in g}) == 1
        # group_of (used by ParallelState and the CLIs) agrees with the group lists
        for kind, groups in lay.groups():
            member_of = {r: g for g in groups for r in g}
            for r in range(w):
                assert lay.group_of(kind, r) == member_of.get(r), (w, tp, pp, r, kind)
        emb = lay.embedding_groups()
        if pp == 1:
            assert emb == []
        else:
            assert emb == [[g[0], g[-1]] for g in lay.pp_groups()]


def test_design_doc_example_8_ranks_tp2_pp2():
    lay = ParallelLayout(8, 2, 2)
    assert lay.dp == 2
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.mp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_order_equals_deepspeed_pipe_model_data_topology():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    checked = 0
    for w, tp, pp in ALL_SHAPES:
        if w > 32 and w not in (48, 64):
            continue
        lay = ParallelLayout(w, tp, pp)
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=lay.dp)
        for r in range(w):
            c, ds = lay.coord(r), topo.get_coord(r)
            assert (ds.model, ds.data, ds.pipe) == (c.tp, c.dp, c.pp), (w, tp, pp, r)
        assert sorted(topo.get_axis_comm_lists("model")) == sorted(lay.tp_groups()) or tp == 1
        assert sorted(topo.get_axis_comm_lists("data")) == sorted(lay.dp_groups()) or lay.dp == 1
        assert sorted(topo.get_axis_comm_lists("pipe")) == sorted(lay.pp_groups()) or pp == 1
        # DeepSpeed's "model parallel" group (its PipelineParallelGrid) = all ranks of one dp index
        assert [sorted(topo.get_axis_list("data", d)) for d in range(lay.dp)] == lay.mp_groups()
        checked += 1
    assert checked > 150


@pytest.mark.parametrize("w, tp, pp, dp", [(1, 1, 1, 1), (8, 2, 2, 2), (8, 8, 1, 1), (8, 1, 8, 1),
                                           (12, 2, 3, 2), (64, 4, 4, 4), (6, 3, 1, 2)])
def test_dp_size_divisible(w, tp, pp, dp):
    assert ParallelLayout(w, tp, pp).dp == dp
    assert layout_problems(w, tp, pp) == []


@pytest.mark.parametrize("w, tp, pp, pairs, sizes", [
    (6, 2, 2, "(1,1), (1,2), (1,3), (1,6), (2,1), (2,3), (3,1), (3,2), (6,1)", "4, 8"),
    (10, 4, 1, "(1,1), (1,2), (1,5), (1,10), (2,1), (2,5), (5,1), (5,2), (10,1)", "8, 12"),
    (3, 2, 2, "(1,1), (1,3), (3,1)", "4, 8"),   # no valid size below: two above
    (7, 1, 2, "(1,1), (1,7), (7,1)", "6, 8"),
])
def test_dp_size_not_divisible_message(w, tp, pp, pairs, sizes):
    with pytest.raises(ValueError) as err:
        ParallelLayout(w, tp, pp)
    msg = str(err.value)
    assert f"WORLD_SIZE={w} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}" in msg
    assert f"valid (TP,PP) pairs for WORLD_SIZE={w}: {pairs};" in msg
    assert f"world size that works with TP={tp}, PP={pp}: {sizes}" in msg
    assert "--tensor-model-parallel-size" in msg and "--pipeline-model-parallel-size" in msg


def test_sizes_below_one_are_rejected_not_clamped():
    with pytest.raises(ValueError, match=r"TP=0 must be an integer >= 1 \(set --tensor-model-parallel-size\)"):
        ParallelLayout(8, 0, 1)
    with pytest.raises(ValueError, match=r"PP=-2 must be an integer >= 1"):
        ParallelLayout(8, 1, -2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=0 must be an integer >= 1"):
        ParallelLayout(0, 1, 1)


def test_state_cli_prints_layout(capsys):
    assert main(["--world-size", "8", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "WORLD_SIZE=8 TP=2 PP=2 DP=2" in out
    assert "tensor-parallel groups:        [0,1] [2,3] [4,5] [6,7]" in out
    assert "data-parallel groups:          [0,2] [1,3] [4,6] [5,7]" in out
    assert "pipeline groups:               [0,4] [1,5] [2,6] [3,7]" in out
    assert "  5: (1, 0, 1)" in out
    assert main(["--world-size", "4", "--tensor-model-parallel-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dp"] == 2 and data["dp_groups"] == [[0, 2], [1, 3]] and data["embedding_groups"] == []


def test_state_cli_reports_errors(capsys):
    assert main(["--world-size", "6", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=6 is not divisible by TP x PP = 2 x 2 = 4" in err
    # Megatron turns sequence parallelism off at TP 1 (pretrain_gpt.py too, with a warning): the layout stands
    assert main(["--world-size", "4", "--sequence-parallel"]) == 0
    assert "WORLD_SIZE=4 TP=1 PP=1 DP=4" in capsys.readouterr().out


def test_parallel_state_has_every_mpu_method_deepspeed_calls():
    """Scan DeepSpeed's source for ``mpu.get_*(`` calls; each must exist on ParallelState,
    except the DeepSpeed-Ulysses sequence-parallel hooks we deliberately leave out (see state.py)."""
    import deepspeed
    root = Path(deepspeed.__file__).parent
    called = set()
    for path in root.rglob("*.py"):
        called |= set(re.findall(r"\bmpu\.(get_[a-z_]+)\(", path.read_text(errors="ignore")))
    grid_methods = {"get_global_rank", "get_pipe_parallel_rank", "get_slice_parallel_group",
                    "get_pipeline_model_parallel_world_size"}  # PipelineParallelGrid's mpu API
    wanted = {m for m in called | grid_methods if "sequence" not in m}
    assert len(wanted) >= 20
    missing = sorted(m for m in wanted if not callable(getattr(ParallelState, m, None)))
    assert missing == []
    assert not hasattr(ParallelState, "initialize_sequence_parallel")


# ---- the context-parallel dimension (Megatron's order tp-cp-dp-pp) ----------------------------------------
CP_SHAPES = [(w, tp, pp, cp) for w in range(2, 33) for tp, pp in valid_pairs(w) for cp in range(2, w // (tp * pp) + 1)
             if w % (tp * pp * cp) == 0]


def test_context_parallel_grid_for_every_shape_up_to_32():
    assert len(CP_SHAPES) > 150
    for w, tp, pp, cp in CP_SHAPES:
        lay = ParallelLayout(w, tp, pp, cp)
        assert lay.dp * tp * cp * pp == w
        coords = [lay.coord(r) for r in range(w)]
        for r, c in enumerate(coords):
            assert r == c.tp + tp * (c.cp + cp * (c.dp + lay.dp * c.pp)) == lay.rank(c.tp, c.dp, c.pp, c.cp)
        axes = ("tp", "cp", "dp", "pp")
        for kind, varying, size in (("tp", {"tp"}, tp), ("cp", {"cp"}, cp), ("dp", {"dp"}, lay.dp),
                                    ("pp", {"pp"}, pp), ("mp", {"tp", "pp"}, tp * pp),
                                    ("dp_cp", {"dp", "cp"}, lay.dp * cp)):
            groups = dict(lay.groups())[kind]
            _assert_partition(groups, w, size)
            for g in groups:  # members differ only in the varying axes
                assert len({tuple(getattr(coords[x], a) for a in axes if a not in varying) for x in g}) == 1
            member_of = {r: g for g in groups for r in g}
            assert all(lay.group_of(kind, r) == member_of[r] for r in range(w)), (w, tp, pp, cp, kind)
        assert lay.embedding_groups() == ([] if pp == 1 else [[g[0], g[-1]] for g in lay.pp_groups()])


def test_context_parallel_example_16_ranks_and_deepspeeds_data_axis():
    """16 ranks, TP 2 x CP 2 x PP 2 (DP 2), as Megatron-LM's rank generator orders them; DeepSpeed's
    topology with a data axis of DP x CP gives the gradient groups (dp_cp) and the same pipelines."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    lay = ParallelLayout(16, tp=2, pp=2, cp=2)
    assert lay.dp == 2
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert lay.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert lay.pp_groups() == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=lay.dp * lay.cp)
    assert sorted(topo.get_axis_comm_lists("data")) == lay.dp_cp_groups()
    assert sorted(topo.get_axis_comm_lists("pipe")) == lay.pp_groups()
    assert sorted(topo.get_axis_comm_lists("model")) == lay.tp_groups()
    # without CP nothing changes: no CP groups are created, the describe() format is the same
    assert "cp" not in dict(ParallelLayout(8, 2, 2).groups()) and "cp" not in ParallelLayout(8, 2, 2).describe()


def test_context_parallel_size_that_does_not_divide_is_one_error():
    (problem,) = layout_problems(12, 2, 1, 4)
    assert problem.startswith("WORLD_SIZE=12 is not divisible by TP x CP x PP = 2 x 4 x 1 = 8")
    assert "--context-parallel-size from [1, 2, 3, 6]" in problem
    with pytest.raises(ValueError, match="CP=0 must be an integer >= 1"):
        ParallelLayout(8, 1, 1, 0)


def test_state_cli_prints_the_context_parallel_grid(capsys):
    assert main(["--world-size", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WORLD_SIZE=16 TP=2 PP=2 DP=2 CP=2 (rank = tp + TP*(cp + CP*(dp + DP*pp)))")
    assert "context-parallel groups:       [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]" in out
    assert "gradient (DPxCP) groups:       [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]" in out
    assert "  3: (1, 0, 0, 1)" in out and "  5: (1, 1, 0, 0)" in out  # (tp, dp, pp, cp): 3 = 1 + 2 x 1, 5 = 1 + 2 x 2 x 1
