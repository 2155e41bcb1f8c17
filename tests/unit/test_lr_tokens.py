"""Megatron-DeepSpeed's token schedules (--lr-warmup-tokens / --lr-decay-tokens): the lr after every step equals
its ``OptimizerParamScheduler.get_lr`` written out by hand below (steps counted in samples, tokens consumed
= samples x --seq-length, the step warmup's end recorded as tokens when the decay is in tokens)."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ru.config.lr_schedule import schedule_from_config
from megatron_ru.config.training import OptimizerConfig, TrainingConfig
from megatron_ru.training.lr import MegatronLRScheduler

GBS, SEQ = 8, 32


def _opt(**kw):
    base = dict(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=0, lr_warmup_fraction=None,
                lr_warmup_samples=0, lr_decay_iters=None, lr_decay_samples=None, lr_wsd_decay_style="exponential",
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None, decoupled_lr=None, decoupled_min_lr=None,
                lr_decay_tokens=None, lr_warmup_tokens=None)
    base.update(kw)
    return SimpleNamespace(**base)


class _MDS:
    """Megatron-DeepSpeed's get_lr, by hand: ``num_steps`` in samples, ``num_tokens`` consumed."""

    def __init__(self, max_lr, min_lr, style, warmup_steps, decay_steps, warmup_tokens, decay_tokens):
        self.max_lr, self.min_lr, self.style = max_lr, min_lr, style
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.warmup_tokens, self.decay_tokens = warmup_tokens, decay_tokens
        self.num_steps = self.num_tokens = 0

    def lr(self):
        if self.warmup_tokens is None:
            if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
                if self.num_steps == self.warmup_steps and self.decay_tokens is not None:
                    self.warmup_tokens = self.num_tokens
                return self.max_lr * self.num_steps / self.warmup_steps
        elif self.warmup_tokens > 0 and self.num_tokens <= self.warmup_tokens:
            return self.max_lr * self.num_tokens / self.warmup_tokens
        if self.decay_tokens is None:
            if self.num_steps > self.decay_steps:
                return self.min_lr
            ratio = (self.num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        else:
            if self.num_tokens > self.decay_tokens:
                return self.min_lr
            ratio = (self.num_tokens - self.warmup_tokens) / (self.decay_tokens - self.warmup_tokens)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, samples):
        self.num_steps += samples
        self.num_tokens += samples * SEQ
        return self.lr()


def _ours_vs_mds(opt, mds, steps=14):
    schedule = schedule_from_config(opt, 10, GBS, seq_length=SEQ)
    assert schedule.unit == "tokens"
    sched = MegatronLRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), schedule)
    sched.increment = GBS * SEQ
    ours, theirs = [sched.get_lr()[0]], [mds.lr()]
    for _ in range(steps):
        sched.step()
        ours.append(sched.get_lr()[0])
        theirs.append(mds.step(GBS))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    return ours


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_token_warmup_and_token_decay(style):
    opt = _opt(lr_decay_style=style, lr_warmup_tokens=600, lr_decay_tokens=2600)
    lrs = _ours_vs_mds(opt, _MDS(1e-3, 1e-4, style, 0, 10 * GBS, 600, 2600))
    assert lrs[1] == pytest.approx(1e-3 * 256 / 600) and lrs[-1] == 1e-4


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_iteration_warmup_and_token_decay(style):
    """The step warmup's last step records its tokens (3 x 8 x 32 = 768); the token decay counts from there."""
    opt = _opt(lr_decay_style=style, lr_warmup_iters=3, lr_decay_tokens=2600)
    lrs = _ours_vs_mds(opt, _MDS(1e-3, 1e-4, style, 3 * GBS, 10 * GBS, None, 2600))
    assert lrs[3] == pytest.approx(1e-3)
    r = (4 * 256 - 768) / (2600 - 768)
    expected = 1e-4 + (1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r))) * 9e-4
    assert lrs[4] == pytest.approx(expected)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_token_warmup_and_iteration_decay(style):
    """A token warmup with the decay in iterations: the decay counts from the step warmup (0), as MDS's does."""
    opt = _opt(lr_decay_style=style, lr_warmup_tokens=700, lr_decay_iters=12)
    _ours_vs_mds(opt, _MDS(1e-3, 1e-4, style, 0, 12 * GBS, 700, None))


def test_samples_warmup_and_token_decay():
    opt = _opt(lr_decay_style="linear", lr_warmup_samples=16, lr_decay_tokens=3000)
    _ours_vs_mds(opt, _MDS(1e-3, 1e-4, "linear", 16, 10 * GBS, None, 3000))


def test_resume_positions_the_token_schedule():
    opt = _opt(lr_decay_style="linear", lr_warmup_tokens=512, lr_decay_tokens=2560)
    sched = MegatronLRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0),
                                schedule_from_config(opt, 10, GBS, seq_length=SEQ))
    sched.set_position(iteration=5, consumed_samples=40, seq_length=SEQ)
    assert sched.num_steps == 40 * SEQ
    assert sched.get_lr()[0] == pytest.approx(1e-4 + (1 - (1280 - 512) / (2560 - 512)) * 9e-4)
    with pytest.raises(ValueError, match="seq_length"):
        sched.set_position(iteration=5, consumed_samples=40)


def test_a_decay_not_past_the_warmup_is_refused_in_tokens():
    with pytest.raises(ValueError, match="in tokens"):
        schedule_from_config(_opt(lr_warmup_tokens=3000, lr_decay_tokens=2000), 10, GBS, seq_length=SEQ)


def test_flag_validation():
    assert any("--train-tokens" in p for p in TrainingConfig(train_iters=4, train_tokens=0).problems())
    assert not any("tokens" in p for p in TrainingConfig(train_iters=4, train_tokens=100).problems())
    assert any("--lr-decay-tokens" in p for p in OptimizerConfig(lr_decay_tokens=0).problems())
    assert any("--lr-warmup-tokens" in p for p in OptimizerConfig(lr_warmup_tokens=-1).problems())
