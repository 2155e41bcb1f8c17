"""--rampup-batch-size: the global batch of every step, consumed samples, the iteration count of a
--train-samples run and the learning rate in samples, against hand-written computations and Megatron's
documented example; the flag's validation."""
from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megatron_ru.flags.arguments import parse_arguments
from megatron_ru.config.batch_ramp import BatchRamp, ramp_problems
from megatron_ru.config.lr_schedule import LRSchedule, schedule_from_config
from megatron_ru.training.lr import MegatronLRScheduler
from tests.fixtures.datasets import write_dataset


def _hand_batch(start: int, inc: int, samples: int, gbs: int, consumed: int) -> int:
    """The ramp by thresholds: after the ramp the full batch; inside it START plus one INCREMENT for every
    threshold k * SAMPLES / n (k = 1..n, exact fractions) the consumed samples reached."""
    if consumed > samples:
        return gbs
    n = (gbs - start) // inc
    reached = sum(1 for k in range(1, n + 1) if consumed >= Fraction(k * samples, n))
    return start + reached * inc


@pytest.mark.parametrize("start,inc,samples,gbs", [(2, 2, 8, 8), (4, 4, 60, 16), (16, 8, 3000, 128), (8, 8, 1, 32),
                                                   (3, 6, 90, 21)])
def test_batch_per_step_and_consumed_samples_follow_the_formula(start, inc, samples, gbs):
    ramp = BatchRamp(start, inc, samples, gbs)
    consumed, seen = 0, []
    for _ in range(200):
        batch = ramp.batch_size_at(consumed)
        if samples % ((gbs - start) // inc) == 0:  # thresholds exact in floats too: equal everywhere
            assert batch == _hand_batch(start, inc, samples, gbs, consumed), consumed
        seen.append((consumed, batch))
        consumed += batch
    # the step sequence: consumed advances by each step's own batch
    assert [s for _, s in zip(range(200), ramp.steps())] == seen
    assert all(b1 <= b2 for (_, b1), (_, b2) in zip(seen, seen[1:]))
    assert seen[0][1] == start and seen[-1][1] == gbs
    assert ramp.consumed_after(10) == sum(b for _, b in seen[:10])
    assert ramp.consumed_after(3, seen[4][0]) == seen[7][0]


def test_small_ramp_by_hand():
    # 2 -> 8 in steps of 2 over 8 samples: 3 increments of 8/3 samples
    ramp = BatchRamp(2, 2, 8, 8)
    got = [b for _, b in zip(range(6), (b for _, b in ramp.steps()))]
    assert got == [2, 2, 4, 8, 8, 8]  # consumed 0, 2, 4, 8 (not past 8: int(8 / (8/3)) = 3), 16, 24
    assert [c for _, (c, _) in zip(range(6), ramp.steps())] == [0, 2, 4, 8, 16, 24]


def test_megatron_documented_example():
    # Megatron's --rampup-batch-size help: "16 8 300000 --global-batch-size 1024 will start with global batch size
    # 16 and over (1024 - 16) / 8 = 126 intervals will increase the batch size linearly to 1024. In each interval
    # we will use approximately 300000 / 126 = 2380 samples."
    ramp = BatchRamp(16, 8, 300000, 1024)
    assert ramp.num_increments == 126
    assert ramp.batch_size_at(0) == 16
    assert ramp.batch_size_at(2380) == 16 and ramp.batch_size_at(2381) == 24
    assert ramp.batch_size_at(299_999) == 1016
    assert ramp.batch_size_at(300_000) == 1024 and ramp.batch_size_at(10**9) == 1024
    sizes = set()
    for consumed, batch in ramp.steps():
        if consumed > 300_000:
            break
        sizes.add(batch)
    assert sizes == set(range(16, 1017, 8))  # every batch of the ramp is run, 1024 only after it


def test_train_iters_of_a_samples_run_is_megatrons_count():
    def hand(start, inc, samples, gbs, train_samples):  # Megatron's update_train_iters, written out
        it, c = 0, 0
        while c <= samples and c <= train_samples:
            c += BatchRamp(start, inc, samples, gbs).batch_size_at(c)
            it += 1
        return it + max(0, train_samples - c) // gbs
    assert BatchRamp(2, 2, 8, 8).train_iters(40) == 7  # 2 + 2 + 4 + 8 = 16 in the ramp, then (40 - 16) // 8
    assert BatchRamp(2, 2, 8, 8).train_iters(43) == 7  # a partial last batch is dropped
    assert BatchRamp(2, 2, 8, 8).train_iters(3) == 2  # steps while consumed <= train samples (Megatron's loop)
    for case in [(4, 4, 60, 16, 1000), (16, 8, 3000, 128, 9000), (8, 8, 1, 32, 100)]:
        assert BatchRamp(*case[:4]).train_iters(case[4]) == hand(*case)


def test_lr_schedule_in_samples_is_megatrons():
    opt = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_decay_style="linear", lr_warmup_iters=2, lr_warmup_fraction=None,
                          lr_warmup_samples=0, lr_decay_iters=None, lr_decay_samples=None,
                          lr_wsd_decay_style="exponential", lr_wsd_decay_iters=None, lr_wsd_decay_samples=None,
                          decoupled_lr=None, decoupled_min_lr=None)
    # iteration flags x the final global batch (Megatron's iteration-based scheduler)
    s = schedule_from_config(opt, 10, 8, in_samples=True)
    assert (s.unit, s.warmup_steps, s.decay_steps) == ("samples", 16, 80)
    # sample flags as they are; the decay defaults to --train-samples
    opt2 = SimpleNamespace(**{**vars(opt), "lr_warmup_iters": 0, "lr_warmup_samples": 12})
    s2 = schedule_from_config(opt2, 10, 8, in_samples=True, train_samples=70)
    assert (s2.warmup_steps, s2.decay_steps) == (12, 70)
    assert schedule_from_config(opt, 10, 8).unit == "iterations"
    # the scheduler advances by each step's batch: lr at consumed samples c is Megatron's lr(c)
    param = torch.nn.Parameter(torch.zeros(1))
    opt_ = torch.optim.SGD([param], lr=1.0)
    sched = MegatronLRScheduler(opt_, s)
    ramp = BatchRamp(2, 2, 8, 8)
    for _, (consumed, batch) in zip(range(12), ramp.steps()):
        if consumed <= 16:  # Megatron: warmup from 0 over 2 x 8 samples, linear decay to 10 x 8 samples
            want = 1e-3 * consumed / 16
        else:
            want = 1e-4 + (1e-3 - 1e-4) * (1 - min(consumed - 16, 64) / 64)
        assert sched.get_lr()[0] == pytest.approx(want, rel=1e-12, abs=1e-15), consumed
        sched.increment = batch
        sched.step()


def test_loading_a_schedule_in_another_unit_asks_for_the_position():
    param = torch.nn.Parameter(torch.zeros(1))
    saved = MegatronLRScheduler(torch.optim.SGD([param], lr=1.0), LRSchedule(1.0, 0.0, 2, 10, "linear"), 5)
    ramped = MegatronLRScheduler(torch.optim.SGD([param], lr=1.0),
                                 LRSchedule(1.0, 0.0, 16, 80, "linear", unit="samples"))
    ramped.load_state_dict(saved.state_dict())
    assert ramped.unit_changed
    ramped.set_position(iteration=5, consumed_samples=40)
    assert ramped.num_steps == 40 and not ramped.unit_changed and ramped.get_lr()[0] == pytest.approx(0.625)


def test_ramp_problems_name_the_flag_and_a_fix():
    assert ramp_problems(None, 8, 1, 2) == []
    assert ramp_problems([2, 2, 8], 8, 1, 2) == []
    (p,) = ramp_problems([3, 2, 8], 9, 1, 2)
    assert "START (3) must be a multiple of --micro-batch-size (1) x data-parallel size (2) = 2" in p
    (p,) = ramp_problems([2, 4, 8], 8, 1, 1)
    assert "--global-batch-size (8) - START (2) = 6 must be a multiple of INCREMENT (4)" in p
    (p,) = ramp_problems([8, 2, 8], 8, 1, 1)
    assert "START (8) must be smaller than --global-batch-size (8)" in p
    assert "give --global-batch-size" in ramp_problems([2, 2, 8], None, 1, 1)[0]
    assert "takes three numbers" in ramp_problems([2, 2], 8, 1, 1)[0]
    assert "must be >= 1" in ramp_problems([0, 2, 8], 8, 1, 1)[0]
    assert "SAMPLES must be >= 1" in ramp_problems([2, 2, 0], 8, 1, 1)[0]


def _argv(prefix, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", prefix, "--lr", "1e-3", *extra]


def test_flag_parses_validates_and_counts_iterations(tmp_path):
    prefix = write_dataset(str(tmp_path / "corpus_text_document"))
    a = parse_arguments(_argv(prefix, "--train-samples", "40", "--rampup-batch-size", "2", "2", "8"),
                        world_size=2, device_type="cpu")
    assert a.batch_ramp == BatchRamp(2, 2, 8, 8) and a.train_iters == 7
    a = parse_arguments(_argv(prefix, "--train-iters", "5", "--rampup-batch-size", "2", "2", "8"),
                        world_size=2, device_type="cpu")
    assert a.train_iters == 5
    with pytest.raises(ValueError) as e:
        parse_arguments(_argv(prefix, "--train-iters", "5", "--rampup-batch-size", "2", "2", "8"), world_size=4,
                        device_type="cpu")
    assert "START (2) must be a multiple of --micro-batch-size (1) x data-parallel size (4) = 4" in str(e.value)
    assert "INCREMENT (2) must be a multiple" in str(e.value)
    with pytest.raises(SystemExit):  # argparse: three values
        parse_arguments(_argv(prefix, "--train-iters", "5", "--rampup-batch-size", "2", "2"), world_size=1,
                        device_type="cpu")
