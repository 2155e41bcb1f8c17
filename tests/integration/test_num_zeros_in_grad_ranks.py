"""--log-num-zeros-in-grad in real runs: the 'num-zeros' logged to --metrics-file at TP 2 (TP-replicated
gradients counted on one rank) and at DP 2 with ZeRO 1 (each rank counts its partition of the fp32 gradient;
summed over DP), equals the single-process run's at every iteration; bf16 at DP 2 (BF16_Optimizer: the fp32 gradient whole on
each DP rank, counted once) is that of one process up to bf16's rounding; the unit test (tests/unit/test_num_zeros_in_grad.py)
checks the count itself against torch."""
from __future__ import annotations

import json

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}


def _zeros(path) -> dict[int, int]:
    recs = [json.loads(line) for line in open(path)]
    return {r["iteration"]: r["num_zeros"] for r in recs if r["type"] == "train"}


def test_num_zeros_at_tp2_and_zero1_dp2_equal_single_process(tmp_path):
    prefix = make_corpus(str(tmp_path))
    # the vocabulary (96) padded to 128 rows at TP 1 and TP 2 alike: the padding rows' gradients are zeros,
    # and Megatron's default (a multiple of 128 x TP) would give TP 2 128 more of them
    base = tiny_argv(prefix, str(tmp_path / "cache"), iters=3,
                     extra=["--log-num-zeros-in-grad", "--make-vocab-size-divisible-by", "64"])

    def run(name, *extra):
        return base + [*extra, "--metrics-file", str(tmp_path / f"{name}.jsonl")]

    run_distributed(train_body, 2, args=([run("tp2", "--tensor-model-parallel-size", "2"),
                                          run("zero1", "--zero-stage", "1"),
                                          run("bf16_dp2", "--bf16", "--zero-stage", "1")],), timeout=600, env=ENV)
    run_distributed(train_body, 1, args=([run("one"), run("bf16_one", "--bf16", "--zero-stage", "1")],),
                    timeout=600, env=ENV)
    one = _zeros(tmp_path / "one.jsonl")
    assert sorted(one) == [1, 2, 3] and all(n > 0 for n in one.values())
    assert _zeros(tmp_path / "tp2.jsonl") == one
    assert _zeros(tmp_path / "zero1.jsonl") == one
    # bf16: the gradients themselves differ in their last bits between the layouts (the micro batches' bf16
    # gradients are summed in another order), so a few elements cancel to exactly zero in one and not the
    # other; counting a partition only, or a replica twice, would be off by about half or double
    bf16_one, bf16_dp2 = _zeros(tmp_path / "bf16_one.jsonl"), _zeros(tmp_path / "bf16_dp2.jsonl")
    assert sorted(bf16_dp2) == [1, 2, 3]
    for it, n in bf16_one.items():
        assert abs(bf16_dp2[it] - n) <= 0.03 * n, (it, bf16_dp2[it], n)
