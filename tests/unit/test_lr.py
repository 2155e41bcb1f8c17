import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ru.config.lr_schedule import LRSchedule, schedule_from_config
from megatron_ru.training.lr import MegatronLRScheduler


def _opt_cfg(**kw):
    base = dict(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_iters=0, lr_warmup_fraction=None,
                lr_warmup_samples=0, lr_decay_iters=None, lr_decay_samples=None, lr_wsd_decay_style="exponential",
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None, decoupled_lr=None, decoupled_min_lr=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_linear_warmup_then_linear_decay_points():
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style="linear")
    assert s.lr(0) == 0.0  # Megatron: the first update of a warmed-up run uses lr 0
    assert s.lr(5) == pytest.approx(0.5)
    assert s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.lr(110) == pytest.approx(0.1)
    assert s.lr(1000) == 0.1


def test_cosine_midpoint_and_quarter():
    s = LRSchedule(max_lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="cosine")
    assert s.lr(0) == pytest.approx(2.0)
    assert s.lr(50) == pytest.approx(1.0)
    assert s.lr(25) == pytest.approx(1.0 * (math.cos(math.pi * 0.25) + 1.0))
    assert s.lr(100) == pytest.approx(0.0, abs=1e-12)


def test_constant_keeps_max_after_warmup_and_decay():
    s = LRSchedule(max_lr=3e-4, min_lr=0.0, warmup_steps=4, decay_steps=4, decay_style="constant")
    assert s.lr(2) == pytest.approx(1.5e-4)
    assert s.lr(4) == pytest.approx(3e-4)
    assert s.lr(10_000) == pytest.approx(3e-4)


def test_decay_not_longer_than_warmup_is_an_error_naming_flags():
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=10, decay_steps=10, decay_style="cosine")


def test_warmup_fraction_is_of_decay_length_and_defaults_to_train_iters():
    s = schedule_from_config(_opt_cfg(lr_warmup_fraction=0.1), train_iters=200, global_batch_size=8)
    assert (s.warmup_steps, s.decay_steps) == (20, 200)
    s = schedule_from_config(_opt_cfg(lr_warmup_fraction=0.25, lr_decay_iters=40), train_iters=200,
                             global_batch_size=8)
    assert (s.warmup_steps, s.decay_steps) == (10, 40)


def test_samples_flags_are_divided_by_global_batch():
    s = schedule_from_config(_opt_cfg(lr_warmup_samples=64, lr_decay_samples=800), train_iters=10,
                             global_batch_size=16)
    assert (s.warmup_steps, s.decay_steps) == (4, 50)


def test_scheduler_sets_param_groups_and_resumes_from_state():
    sched = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=10, decay_style="linear")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p, ], lr=123.0)
    s = MegatronLRScheduler(opt, sched)
    assert opt.param_groups[0]["lr"] == 0.0
    seen = []
    for _ in range(6):
        s.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == [sched.lr(i) for i in range(1, 7)]
    state = s.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5.0)
    s2 = MegatronLRScheduler(opt2, sched)
    s2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    s.step(), s2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == sched.lr(7)


# ---- WSD (warmup-stable-decay) against Megatron-LM's definition, written out independently --------------------

def _megatron_wsd(step, max_lr, min_lr, warmup, decay, wsd_steps, style):
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if step > decay:
        return min_lr
    anneal_start = decay - wsd_steps
    if step <= anneal_start:
        return max_lr
    q = (step - anneal_start) / wsd_steps
    coeff = {"linear": 1 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1), "minus_sqrt": 1 - math.sqrt(q),
             "exponential": 2 * 0.5 ** q - 1}[style]
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_follows_megatron_at_every_step(style):
    s = schedule_from_config(_opt_cfg(lr=3e-4, min_lr=3e-5, lr_decay_style="WSD", lr_warmup_iters=10,
                                      lr_wsd_decay_style=style, lr_wsd_decay_iters=20), train_iters=100,
                             global_batch_size=8)
    assert (s.warmup_steps, s.decay_steps, s.wsd_decay_steps) == (10, 100, 20)
    for step in range(0, 120):
        assert s.lr(step) == pytest.approx(_megatron_wsd(step, 3e-4, 3e-5, 10, 100, 20, style), rel=1e-12, abs=0)
    assert s.lr(80) == 3e-4 and s.lr(100) == pytest.approx(3e-5)  # stable to the decay phase, min at its end
    by_samples = schedule_from_config(_opt_cfg(lr_decay_style="WSD", lr_wsd_decay_samples=160), train_iters=100,
                                      global_batch_size=8)
    assert by_samples.wsd_decay_steps == 20


def test_wsd_needs_its_decay_phase():
    from megatron_ru.config.training import OptimizerConfig
    assert "--lr-decay-style WSD needs the length of its decay phase" in " ".join(
        OptimizerConfig(lr_decay_style="WSD").problems())
    with pytest.raises(ValueError, match="WSD's decay phase .30 iterations"):
        LRSchedule(1.0, 0.0, warmup_steps=80, decay_steps=100, decay_style="WSD", wsd_decay_steps=30)


def test_a_new_schedule_on_load_is_followed_and_said_or_the_checkpoints_kept(records):
    """Megatron-LM stops on a changed --lr unless told; Megatron-DeepSpeed users trip over the flag's bugs
    (NVIDIA/Megatron-LM#963, #1533). Here: the flags win, one line says what changed; the flag keeps the old."""
    old = LRSchedule(max_lr=3e-4, min_lr=3e-5, warmup_steps=10, decay_steps=100, decay_style="cosine")
    new = LRSchedule(max_lr=1e-4, min_lr=1e-5, warmup_steps=10, decay_steps=200, decay_style="WSD",
                     wsd_decay_steps=50)
    saved = MegatronLRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), old, 40).state_dict()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = MegatronLRScheduler(opt, new)
    sched.load_state_dict(saved)
    assert sched.num_steps == 40 and opt.param_groups[0]["lr"] == new.lr(40) == 1e-4
    assert ("the learning-rate schedule of this run's flags differs from the checkpoint's (--lr 0.0003 -> 0.0001; "
            "--min-lr 3e-05 -> 1e-05; decay iterations 100 -> 200; --lr-decay-style cosine -> WSD; WSD decay "
            "iterations 0 -> 50): this run follows its flags from step 40") in records.text
    sched = MegatronLRScheduler(opt, new)
    sched.use_checkpoint_schedule = True
    sched.load_state_dict(saved)
    assert sched.schedule == old and opt.param_groups[0]["lr"] == old.lr(40)
    assert "--use-checkpoint-opt-param-scheduler: continuing the checkpoint's learning-rate schedule" in records.text
