"""The learning-rate schedule with Megatron-LM's semantics, resolved from the flags (the validation of the
flags builds it too; :class:`megatron_ru.training.lr.MegatronLRScheduler` applies it).

``lr(step)`` for ``step`` = optimizer steps already taken (0 before the first update):

* warmup (``step <= warmup``, ``warmup > 0``): ``max_lr * step / warmup`` — so the very first
  update of a warmed-up run uses lr 0, exactly as Megatron's ``OptimizerParamScheduler``;
* ``constant``: ``max_lr`` after warmup;
* after ``decay`` steps: ``min_lr``;
* in between, with ``r = (step - warmup) / (decay - warmup)``:
  ``linear``: ``min_lr + (max_lr - min_lr) * (1 - r)``,
  ``cosine``: ``min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * r))``.

The scheduler is stepped by DeepSpeed after every applied (non-skipped) optimizer step, and its
``state_dict`` (the step count plus the schedule's parameters, checked on load) goes into the
checkpoint so a resumed run continues on the same curve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str  # constant | linear | cosine

    def __post_init__(self) -> None:
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {self.decay_style!r}; use constant, linear or cosine")
        if self.decay_style != "constant" and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"the LR decay length ({self.decay_steps} iterations) must exceed the warmup "
                f"({self.warmup_steps}): raise --lr-decay-iters/--train-iters or lower the warmup")

    def lr(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * float(step) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        ratio = float(step - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def schedule_from_config(opt_cfg: Any, train_iters: int, global_batch_size: int) -> LRSchedule:
    """Resolve warmup/decay lengths from ``OptimizerConfig`` flags (Megatron's precedence:
    samples flags are divided by the global batch; the warmup fraction is of the decay length)."""
    if opt_cfg.lr_decay_samples is not None:
        decay = opt_cfg.lr_decay_samples // global_batch_size
    elif opt_cfg.lr_decay_iters is not None:
        decay = opt_cfg.lr_decay_iters
    else:
        decay = train_iters
    if opt_cfg.lr_warmup_fraction is not None:
        warmup = int(opt_cfg.lr_warmup_fraction * decay)
    elif opt_cfg.lr_warmup_samples:
        warmup = opt_cfg.lr_warmup_samples // global_batch_size
    else:
        warmup = opt_cfg.lr_warmup_iters
    return LRSchedule(max_lr=opt_cfg.lr, min_lr=opt_cfg.min_lr, warmup_steps=warmup,
                      decay_steps=decay, decay_style=opt_cfg.lr_decay_style)
