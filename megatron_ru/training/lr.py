"""Applies the learning-rate schedule of :mod:`megatron_ru.config.lr_schedule` to the optimizer's param groups.

The scheduler is stepped by DeepSpeed after every applied (non-skipped) optimizer step, and its
``state_dict`` (the step count plus the schedule's parameters, checked on load) goes into the
checkpoint so a resumed run continues on the same curve.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import torch

from megatron_ru.config.lr_schedule import LRSchedule
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)


#: the key that marks an optimizer param group of the input word embedding and the output layer (--decoupled-lr)
DECOUPLED = "decoupled_lr"


class MegatronLRScheduler:
    """Sets ``lr`` of every param group from an :class:`LRSchedule`; DeepSpeed calls ``step()``. ``get_lr`` is
    the lr of the other parameters (what Megatron-LM logs as the learning rate)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule, num_steps: int = 0) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.num_steps = num_steps
        self._apply()

    def _apply(self) -> None:
        """Every group's ``lr`` at this step; a group marked ``decoupled`` (the input word embedding and the output
        layer under --decoupled-lr) follows the schedule's decoupled peak and end."""
        lr = self.schedule.lr(self.num_steps)
        decoupled = self.schedule.decoupled().lr(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = decoupled if group.get(DECOUPLED) else lr

    def get_lr(self) -> list[float]:
        return [self.schedule.lr(self.num_steps)]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    #: what the next applied step adds to ``num_steps``: 1, or under a schedule in samples (--rampup-batch-size)
    #: the step's global batch, or in tokens (--lr-*-tokens) the batch x --seq-length; the training loop sets it
    #: before each step
    increment: int = 1
    #: set by a load whose checkpoint counted steps in another unit (--rampup-batch-size added or dropped): the
    #: caller puts the position right with :meth:`set_position`
    unit_changed: bool = False

    def step(self, *_: Any, **__: Any) -> None:
        """One applied optimizer step (arguments DeepSpeed may pass are ignored: we count steps, or samples)."""
        self.num_steps += self.increment
        self._apply()

    def set_position(self, iteration: int, consumed_samples: int, seq_length: Optional[int] = None) -> None:
        """The position of a run at ``iteration`` after ``consumed_samples`` samples (of ``seq_length`` tokens), in
        the schedule's unit."""
        unit = self.schedule.unit
        if unit == "tokens" and seq_length is None:
            raise ValueError("a schedule in tokens is positioned by tokens: pass seq_length")
        self.num_steps = (consumed_samples * seq_length if unit == "tokens" and seq_length is not None
                          else consumed_samples if unit == "samples" else iteration)
        self.unit_changed = False
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "schedule": asdict(self.schedule)}

    #: set from --use-checkpoint-opt-param-scheduler before a load: continue the checkpoint's schedule
    use_checkpoint_schedule: bool = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count. The schedule of this run's flags wins, so that a continued run may change
        ``--lr``, ``--train-iters`` or the decay; one line says what changed (Megatron-LM stops with "class input
        value ... and checkpoint value ... do not match" unless --override-opt-param-scheduler, and its
        --use-checkpoint-opt-param-scheduler keeps the checkpoint's: ``use_checkpoint_schedule`` here)."""
        self.num_steps = int(state["num_steps"])
        saved = state.get("schedule")
        if saved is not None:
            saved_schedule = LRSchedule(**{**asdict(self.schedule), "unit": "iterations", "decay_start": None,
                                           **saved})
            changes = schedule_changes(saved_schedule, self.schedule)
            if saved_schedule.unit != self.schedule.unit and not self.use_checkpoint_schedule:
                self.unit_changed = True
            if self.use_checkpoint_schedule:
                if changes:
                    log_rank0(log, f"--use-checkpoint-opt-param-scheduler: continuing the checkpoint's learning-rate "
                                   f"schedule ({'; '.join(changes)} in this run's flags are not used)", level=30)
                self.schedule = saved_schedule
            elif changes:
                log_rank0(log, f"the learning-rate schedule of this run's flags differs from the checkpoint's "
                               f"({'; '.join(changes)}): this run follows its flags from step {self.num_steps} "
                               f"(lr {self.schedule.lr(self.num_steps):.3e}); --use-checkpoint-opt-param-scheduler "
                               f"continues the checkpoint's instead", level=30)
        self._apply()


def schedule_changes(saved: LRSchedule, flags: LRSchedule) -> list[str]:
    """What differs between two schedules, in the flags' names: ``--lr 3e-4 -> 1e-4``."""
    names = {"max_lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "warmup iterations", "decay_steps":
             "decay iterations", "decay_style": "--lr-decay-style", "wsd_decay_steps": "WSD decay iterations",
             "wsd_decay_style": "--lr-wsd-decay-style", "decoupled_lr": "--decoupled-lr",
             "decoupled_min_lr": "--decoupled-min-lr", "decay_start": "decay start",
             "unit": "steps counted in (--rampup-batch-size, --lr-*-tokens)"}
    a, b = asdict(saved), asdict(flags)
    return [f"{names[k]} {a[k]} -> {b[k]}" for k in names if a[k] != b[k] and
            not (k.startswith("wsd") and "WSD" not in (saved.decay_style, flags.decay_style))]
