"""Learning-rate schedule with Megatron-LM's semantics.

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
from dataclasses import asdict, dataclass
from typing import Any

import torch


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


class MegatronLRScheduler:
    """Sets ``lr`` of every param group from an :class:`LRSchedule`; DeepSpeed calls ``step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule, num_steps: int = 0) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.num_steps = num_steps
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule.lr(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        return [self.schedule.lr(self.num_steps)]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self, *_: Any, **__: Any) -> None:
        """One applied optimizer step (arguments DeepSpeed may pass are ignored: we count steps)."""
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "schedule": asdict(self.schedule)}

    def load_state_dict(self, state: dict[str, Any], *, override_schedule: bool = True) -> None:
        """Restore the step count. The schedule of the current flags wins (``override_schedule``)
        so that a resumed run may change e.g. ``--train-iters``; Megatron does the same by default."""
        self.num_steps = int(state["num_steps"])
        if not override_schedule and "schedule" in state:
            self.schedule = LRSchedule(**state["schedule"])
        self._apply()
