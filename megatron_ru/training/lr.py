"""Applies the learning-rate schedule of :mod:`megatron_ru.config.lr_schedule` to the optimizer's param groups.

The scheduler is stepped by DeepSpeed after every applied (non-skipped) optimizer step, and its
``state_dict`` (the step count plus the schedule's parameters, checked on load) goes into the
checkpoint so a resumed run continues on the same curve.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from megatron_ru.config.lr_schedule import LRSchedule


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
