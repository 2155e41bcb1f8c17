"""--rampup-batch-size end to end (fp32, CPU, gloo): a ramped run equals the same steps done by hand (a chain
of constant-batch runs, each resumed from the last, with the ramp's global batches), at DP 2 and at PP 2; the
log reports each step's batch, consumed samples and Megatron's learning rate in samples; a run stopped
mid-ramp resumes exactly, also at another layout (TP 2, PP 2) with the same global sizes."""
import json

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, relative_diff, tiny_argv, train_body

pytestmark = pytest.mark.slow

RAMP = ["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "8"]
#: the ramp 2 -> 8 by 2 over 8 samples, step by step (tests/unit/test_batch_ramp.py derives it by hand)
BATCHES = [2, 2, 4, 8, 8, 8]
CONSTANT_LR = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]


def _megatron_lr(consumed: int) -> float:
    """tiny_argv's schedule as Megatron runs it with a ramp: warmup 2 iterations x 8 samples from 0, cosine
    decay to 6 x 8 samples, lr 3e-3 -> 3e-4; the lr of a step is the one at the samples consumed before it."""
    import math
    if consumed <= 16:
        return 3e-3 * consumed / 16
    r = min(consumed - 16, 32) / 32
    return 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * r))


def test_ramp_equals_constant_runs_by_hand_and_resumes_at_another_layout(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    runs, names = [], []

    def add(name, iters, extra):
        names.append(name)
        runs.append(tiny_argv(prefix, cache, iters=iters, extra=extra))

    for layout, flags in (("dp2", ["--zero-stage", "1"]), ("pp2", ["--pipeline-model-parallel-size", "2"])):
        add(f"{layout} ramp", 6, [*flags, *RAMP, *CONSTANT_LR])
        # by hand: 2 steps of 2, 1 step of 4, 3 steps of 8 samples, each run continuing the last one's checkpoint
        hand = str(tmp_path / f"{layout}_hand")
        add(f"{layout} hand 2", 2, [*flags, *CONSTANT_LR, "--global-batch-size", "2", "--save", hand + "2"])
        add(f"{layout} hand 4", 3, [*flags, *CONSTANT_LR, "--global-batch-size", "4", "--load", hand + "2",
                                     "--save", hand + "4"])
        add(f"{layout} hand 8", 6, [*flags, *CONSTANT_LR, "--global-batch-size", "8", "--load", hand + "4"])
    # Megatron's schedule in samples; stopped mid-ramp (after 2 steps: the next batch is 4) and resumed
    save = str(tmp_path / "mid_ramp")
    add("full", 6, ["--zero-stage", "1", *RAMP, "--metrics-file", str(tmp_path / "full.jsonl")])
    add("first", 6, ["--zero-stage", "1", *RAMP, "--save", save, "--exit-interval", "2"])
    add("resumed dp2", 6, ["--zero-stage", "1", *RAMP, "--load", save])
    add("resumed tp2", 6, ["--tensor-model-parallel-size", "2", *RAMP, "--load", save])
    add("resumed pp2", 6, ["--pipeline-model-parallel-size", "2", *RAMP, "--load", save,
                           "--metrics-file", str(tmp_path / "pp2.jsonl")])
    results = dict(zip(names, run_distributed(train_body, 2, args=(runs,), timeout=900,
                                              env={"DS_ACCELERATOR": "cpu"})[0]))

    for layout in ("dp2", "pp2"):
        by_hand = {**results[f"{layout} hand 2"]["losses"], **results[f"{layout} hand 4"]["losses"],
                   **results[f"{layout} hand 8"]["losses"]}
        assert sorted(by_hand) == list(range(1, 7))
        assert results[f"{layout} ramp"]["losses"] == by_hand, layout  # bitwise: the same sums in the same order

    full = results["full"]
    recs = [json.loads(x) for x in open(tmp_path / "full.jsonl")]
    train = [r for r in recs if r["type"] == "train"]
    assert [r["global_batch_size"] for r in train] == BATCHES
    consumed = [sum(BATCHES[:i + 1]) for i in range(6)]
    assert [r["consumed_samples"] for r in train] == consumed
    assert [r["lr"] for r in train] == pytest.approx([_megatron_lr(c - b) for c, b in zip(consumed, BATCHES)],
                                                     rel=1e-12, abs=1e-15)
    # the resume mid-ramp: exact at the same layout, within fp32 rounding at another one
    assert results["first"]["iteration"] == 2 and results["first"]["saved"] == [2]
    assert results["first"]["losses"] == {k: full["losses"][k] for k in (1, 2)}
    later = {k: full["losses"][k] for k in range(3, 7)}
    assert results["resumed dp2"]["losses"] == later
    for layout in ("tp2", "pp2"):
        assert relative_diff(results[f"resumed {layout}"]["losses"], later) < 1e-5, layout
    resumed = [json.loads(x) for x in open(tmp_path / "pp2.jsonl")]
    assert [r["global_batch_size"] for r in resumed if r["type"] == "train"] == BATCHES[2:]


def test_ramp_at_pp2_dp2_equals_constant_runs_by_hand(tmp_path):
    """4 ranks, PP 2 x DP 2 (ZeRO 1): DeepSpeed's pipeline engine runs 1, 1, 2, 4, 4 micro batches per rank."""
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    flags = ["--pipeline-model-parallel-size", "2", "--zero-stage", "1", *CONSTANT_LR]
    hand = str(tmp_path / "hand")
    runs = [tiny_argv(prefix, cache, iters=5, extra=[*flags, *RAMP]),
            tiny_argv(prefix, cache, iters=2, extra=[*flags, "--global-batch-size", "2", "--save", hand + "2"]),
            tiny_argv(prefix, cache, iters=3, extra=[*flags, "--global-batch-size", "4", "--load", hand + "2",
                                                     "--save", hand + "4"]),
            tiny_argv(prefix, cache, iters=5, extra=[*flags, "--global-batch-size", "8", "--load", hand + "4"])]
    ramp, *chain = run_distributed(train_body, 4, args=(runs,), timeout=900, env={"DS_ACCELERATOR": "cpu"})[0]
    by_hand = {k: v for run in chain for k, v in run["losses"].items()}
    assert sorted(by_hand) == list(range(1, 6))
    assert ramp["losses"] == by_hand
