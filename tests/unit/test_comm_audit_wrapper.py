"""The communication audit's wrapper counts known ops exactly (kind, group ranks, payload and wire bytes) in 2-rank and
4-rank gloo groups, counts a nested call once, and leaves torch.distributed unwrapped outside a window."""
import json

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank, world_size, path):
    import torch.distributed as dist

    from megatron_ru.parallel import mappings
    from megatron_ru.parallel.comm_audit import CommAudit
    pair = dist.new_group([0, 1])
    groups = {"tp": [0, 1] if rank < 2 else [2, 3], "dp": [rank % 2, rank % 2 + 2]}
    audit = CommAudit(groups, rank, path)
    original = dist.all_reduce
    x = torch.ones(10, dtype=torch.float32)                       # 40 bytes
    with audit.window(1):
        assert dist.all_reduce is not original
        if rank < 2:
            dist.all_reduce(x, group=pair)                       # 40
            parts = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
            dist.all_gather(parts, torch.ones(3, dtype=torch.float64), group=pair)   # output: 48
            out = torch.empty(8)
            dist.all_gather_into_tensor(out, torch.ones(4), group=pair)  # nested all_gather_single: once, 32
            mappings._ALL_GATHER_SINGLE(out, torch.ones(4), group=pair)  # the captured reference: 32
            rs = torch.empty(2, dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(rs, torch.ones(4, dtype=torch.bfloat16), group=pair)  # input: 8
            if rank == 0:
                dist.send(torch.ones(5, dtype=torch.int64), dst=1)  # 40
            else:
                dist.recv(torch.empty(5, dtype=torch.int64), src=0)
        dist.all_reduce(torch.ones(1), group=None)                # world: 4
        dist.broadcast(torch.ones(6), src=0)                         # world: 24
    assert dist.all_reduce is original and mappings._ALL_GATHER_SINGLE.__name__ in ("all_gather_single",
                                                                                     "all_gather_into_tensor")
    with audit.window(2):
        pass
    dist.all_reduce(x)                                            # outside any window: not counted
    return audit.history


@pytest.mark.slow
def test_counts_kind_group_and_bytes(tmp_path):
    path = str(tmp_path / "audit.jsonl")
    results = run_distributed(_body, 4, args=(path,), timeout=60)
    for rank, history in enumerate(results):
        first, second = history
        assert first["iteration"] == 1 and first["rank"] == rank and second["ops"] == []
        ops = {}
        for o in first["ops"]:  # one entry per call site: sum them
            count, nbytes, _ = ops.get((o["kind"], tuple(o["group"]), o["dtype"]), (0, 0, None))
            ops[(o["kind"], tuple(o["group"]), o["dtype"])] = (count + o["count"], nbytes + o["payload"], o["dim"])
        expected = {("all_reduce", (0, 1, 2, 3), "float32"): (1, 4, "world"),
                    ("broadcast", (0, 1, 2, 3), "float32"): (1, 24, "world")}
        if rank < 2:
            expected.update({
                ("all_reduce", (0, 1), "float32"): (1, 40, "tp"),
                ("all_gather", (0, 1), "float64"): (1, 48, "tp"),
                ("all_gather", (0, 1), "float32"): (2, 64, "tp"),
                ("reduce_scatter", (0, 1), "bfloat16"): (1, 8, "tp"),
                ("send" if rank == 0 else "recv", (rank, 1 - rank), "int64"): (1, 40, "other")})
        assert ops == expected, (rank, first["ops"])
        assert first["payload"] == ({"world": 28, "tp": 160, "other": 40} if rank < 2 else {"world": 28})
        # wire bytes: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast and p2p 1
        assert first["dims"] == ({"world": 6 + 24, "tp": 40 + 24 + 32 + 4, "other": 40} if rank < 2 else {"world": 30})
        assert all("test_comm_audit_wrapper.py" in o["site"] for o in first["ops"]), first["ops"]
    lines = [json.loads(line) for line in open(path)]
    assert sorted((r["rank"], r["iteration"]) for r in lines) == [(r, i) for r in range(4) for i in (1, 2)]


def test_point_to_point_in_the_pipeline_group_is_pp():
    from megatron_ru.parallel.comm_audit import CommAudit
    audit = CommAudit({"tp": [0, 1], "pp": [0, 2], "dp": [0]}, rank=0)
    assert audit.dimension("send", (0, 2)) == "pp"
    assert audit.dimension("recv", (0, 1)) == "other"
    assert audit.dimension("all_reduce", (0,)) == "local"
    assert audit.dimension("all_reduce", (1, 0)) == "tp"
