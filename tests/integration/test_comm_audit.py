"""Acceptance 3 (issue 14): the bytes the trainer sends per step, counted by wrapping torch.distributed,
equal the planner's analytic volume (megatron_ru/plan/comm.py) on every rank and in every dimension —
wire and payload bytes — at TP2, TP2 with sequence parallelism, PP2, DP2 at ZeRO 0 and 1, and CP2 (ring in fp32
and bf16, all-to-all); and
--comm-audit FILE writes one JSON line per rank per iteration. One spawn of 2 gloo ranks."""
import json

import pytest

from benchmarks.comm_audit import LAYOUTS, audit_layouts, steady

pytestmark = pytest.mark.slow

CHOSEN = ("TP2", "TP2 SP", "PP2", "DP2 ZeRO0", "DP2 ZeRO1", "CP2 ring", "CP2 a2a", "CP2 ring bf16 ZeRO1")


def test_counted_bytes_equal_analytic(tmp_path):
    layouts = [lay for lay in LAYOUTS if lay[0] in CHOSEN]
    assert len(layouts) == len(CHOSEN)
    path = str(tmp_path / "audit-{rank}.jsonl")
    name, world, flags = layouts[0]
    layouts[0] = (name, world, flags + ["--comm-audit", path])  # the first one through the flag and its file
    results = steady(audit_layouts(layouts, str(tmp_path), iters=2, timeout=240))
    wrong = [f"{name} rank {r['rank']} {r['dim']}: counted {r['counted']} (payload {r['counted_payload']}), "
             f"analytic {r['analytic']} (payload {r['analytic_payload']})"
             for name, rows in results.items() for r in rows
             if (r["counted"], r["counted_payload"]) != (r["analytic"], r["analytic_payload"])]
    assert not wrong, "\n".join(wrong)
    dims = {name: {r["dim"] for r in rows if r["counted"]} for name, rows in results.items()}
    # context parallelism: the ring's blocks (point to point) or the all-to-all are "cp", the gradients reduced over
    # DP x CP (here the same two ranks) "dp"; in bf16 the ring's key/value blocks travel in bf16 both ways (the
    # backward once sent them upcast to fp32, 1.17x the bytes the planner counts)
    assert dims == {"TP2": {"tp"}, "TP2 SP": {"tp"}, "PP2": {"pp"}, "DP2 ZeRO0": {"dp"}, "DP2 ZeRO1": {"dp"},
                    "CP2 ring": {"cp", "dp"}, "CP2 a2a": {"cp", "dp"}, "CP2 ring bf16 ZeRO1": {"cp", "dp"}}
    for rank in range(2):
        lines = [json.loads(line) for line in open(path.format(rank=rank))]
        assert [(r["rank"], r["iteration"]) for r in lines] == [(rank, 1), (rank, 2)]
        assert lines[1]["dims"]["tp"] > 0 and all("site" in op for op in lines[1]["ops"])
