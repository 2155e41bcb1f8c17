"""The learning-rate schedule with Megatron-LM's semantics, resolved from the flags (the validation of the
flags builds it too; :class:`megatron_ru.training.lr.MegatronLRScheduler` applies it).

``lr(step)`` for ``step`` = optimizer steps already taken (0 before the first update):

* warmup (``step <= warmup``, ``warmup > 0``): ``max_lr * step / warmup`` — so the very first
  update of a warmed-up run uses lr 0, exactly as Megatron's ``OptimizerParamScheduler``;
* ``constant``: ``max_lr`` after warmup;
* after ``decay`` steps: ``min_lr``;
* in between, with ``r = (step - warmup) / (decay - warmup)``:
  ``linear``: ``min_lr + (max_lr - min_lr) * (1 - r)``,
  ``cosine``: ``min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * r))``;
* ``WSD`` (warmup-stable-decay, Megatron-LM's): ``max_lr`` until the last ``wsd_decay_steps`` of the decay
  length, then with ``q`` the fraction of that phase done: ``exponential`` ``2 * 0.5**q - 1``, ``linear``
  ``1 - q``, ``cosine`` ``0.5 * (1 + cos(pi * q))``, ``minus_sqrt`` ``1 - sqrt(q)`` times ``max_lr - min_lr``
  above ``min_lr``.

The scheduler is stepped by DeepSpeed after every applied (non-skipped) optimizer step, and its
``state_dict`` (the step count plus the schedule's parameters, checked on load) goes into the
checkpoint so a resumed run continues on the same curve.

Token schedules (Megatron-DeepSpeed's --lr-warmup-tokens / --lr-decay-tokens; ``unit`` "tokens", every length in
tokens, the scheduler advancing by each step's batch x --seq-length) follow its ``get_lr``: a token warmup replaces
the step warmup; a token decay counts from where the warmup ends, which after a step warmup
(--lr-warmup-iters/-samples/-fraction) is the tokens consumed by it (MDS records ``num_tokens`` at the step warmup's
last step; here tokens = samples x --seq-length, so that is the warmup's samples x --seq-length). A token warmup
with a step decay keeps the step decay's start (the step warmup, usually 0): ``decay_start``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str  # constant | linear | cosine | WSD
    #: WSD: the decay phase's length (the last steps of the decay length) and shape
    wsd_decay_steps: int = 0
    wsd_decay_style: str = "exponential"
    #: --decoupled-lr / --decoupled-min-lr: the input word embedding's and the output layer's peak and end
    #: (None: ``max_lr`` / ``min_lr``); the same warmup and decay shape
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    #: what a step counts: "iterations" (one per optimizer step), or "samples" (the step's global batch; under
    #: --rampup-batch-size, where every length is in samples and the scheduler advances by the current batch, as
    #: Megatron's scheduler always does)
    unit: str = "iterations"
    #: where the decay's ratio counts from (None: ``warmup_steps``); Megatron-DeepSpeed's token warmup with a step
    #: decay counts the decay from the step warmup's end, not the token warmup's
    decay_start: Optional[int] = None

    @property
    def start(self) -> int:
        return self.warmup_steps if self.decay_start is None else self.decay_start

    def __post_init__(self) -> None:
        if self.decay_style not in ("constant", "linear", "cosine", "WSD"):
            raise ValueError(f"unknown --lr-decay-style {self.decay_style!r}; use constant, linear, cosine or WSD")
        unit = "tokens" if self.unit == "tokens" else "iterations"
        if self.decay_style == "WSD" and not 0 < self.wsd_decay_steps <= self.decay_steps - self.start:
            raise ValueError(
                f"WSD's decay phase ({self.wsd_decay_steps} {unit}, --lr-wsd-decay-iters/-samples) must be at least "
                f"one iteration and fit in the decay length after warmup ({self.decay_steps} - {self.start})")
        if self.decay_style != "constant" and self.decay_steps <= self.start:
            raise ValueError(
                f"the LR decay length ({self.decay_steps} {unit}) must exceed the warmup "
                f"({self.start}): raise --lr-decay-iters/--lr-decay-tokens/--train-iters or lower the warmup")

    def decoupled(self) -> "LRSchedule":
        """The schedule of the input word embedding and the output layer (Megatron-LM's decoupled learning rate:
        its own peak and end, the same warmup from 0 and the same decay shape); itself without --decoupled-lr."""
        if self.decoupled_lr is None:
            return self
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        return dataclasses.replace(self, max_lr=self.decoupled_lr, min_lr=low, decoupled_lr=None,
                                   decoupled_min_lr=None)

    def lr(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * float(step) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        ratio = float(step - self.start) / float(self.decay_steps - self.start)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd(step)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd(self, step: int) -> float:
        """Warmup-stable-decay (Megatron-LM's): 1 until the decay phase, the last ``wsd_decay_steps`` of the decay
        length; then down to 0 in ``wsd_decay_style``."""
        start = self.decay_steps - self.wsd_decay_steps
        if step <= start:
            return 1.0
        r = float(step - start) / float(self.wsd_decay_steps)
        if self.wsd_decay_style == "linear":
            return 1.0 - r
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if self.wsd_decay_style == "minus_sqrt":
            return 1.0 - math.sqrt(r)
        return 2.0 * math.pow(0.5, r) - 1.0  # exponential


def _schedule(opt_cfg: Any, warmup: int, decay: int, wsd: int, **unit: Any) -> LRSchedule:
    """The schedule of ``OptimizerConfig`` flags with these lengths (``unit``: the unit and where a token decay
    starts)."""
    return LRSchedule(max_lr=opt_cfg.lr, min_lr=opt_cfg.min_lr, warmup_steps=warmup, decay_steps=decay,
                      decay_style=opt_cfg.lr_decay_style, wsd_decay_steps=wsd,
                      wsd_decay_style=opt_cfg.lr_wsd_decay_style, decoupled_lr=opt_cfg.decoupled_lr,
                      decoupled_min_lr=opt_cfg.decoupled_min_lr if opt_cfg.decoupled_lr is not None else None, **unit)


def schedule_from_config(opt_cfg: Any, train_iters: int, global_batch_size: int, *, in_samples: bool = False,
                         train_samples: Optional[int] = None, seq_length: Optional[int] = None) -> LRSchedule:
    """Resolve warmup/decay lengths from ``OptimizerConfig`` flags (Megatron's precedence:
    samples flags are divided by the global batch; the warmup fraction is of the decay length).
    ``in_samples`` (a batch ramp): every length in samples instead, iteration flags times the global batch
    (``train_samples``: the decay length when no decay flag is given, else ``train_iters`` global batches).
    --lr-decay-tokens / --lr-warmup-tokens: every length in tokens (``seq_length`` tokens a sample)."""
    if getattr(opt_cfg, "lr_decay_tokens", None) is not None or getattr(opt_cfg, "lr_warmup_tokens", None) is not None:
        if seq_length is None:
            raise ValueError("a token learning-rate schedule needs --seq-length")
        return _schedule_in_tokens(opt_cfg, train_iters, global_batch_size, train_samples, seq_length)
    if in_samples:
        return _schedule_in_samples(opt_cfg, train_iters, global_batch_size, train_samples)
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
    wsd = 0
    if opt_cfg.lr_decay_style == "WSD":
        wsd = (opt_cfg.lr_wsd_decay_samples // global_batch_size if opt_cfg.lr_wsd_decay_samples is not None
               else opt_cfg.lr_wsd_decay_iters or 0)
    return _schedule(opt_cfg, warmup, decay, wsd)


def _schedule_in_samples(opt_cfg: Any, train_iters: int, global_batch_size: int,
                         train_samples: Optional[int]) -> LRSchedule:
    """Megatron's ``get_optimizer_param_scheduler``: lengths in samples (``--lr-*-iters`` x the final global
    batch), stepped by each step's batch, so a ramp's smaller batches move along the curve more slowly."""
    g = global_batch_size
    if opt_cfg.lr_decay_samples is not None:
        decay = opt_cfg.lr_decay_samples
    elif opt_cfg.lr_decay_iters is not None:
        decay = opt_cfg.lr_decay_iters * g
    else:
        decay = train_samples if train_samples is not None else train_iters * g
    if opt_cfg.lr_warmup_fraction is not None:
        warmup = int(opt_cfg.lr_warmup_fraction * decay)
    elif opt_cfg.lr_warmup_samples:
        warmup = opt_cfg.lr_warmup_samples
    else:
        warmup = opt_cfg.lr_warmup_iters * g
    wsd = 0
    if opt_cfg.lr_decay_style == "WSD":
        wsd = (opt_cfg.lr_wsd_decay_samples if opt_cfg.lr_wsd_decay_samples is not None
               else (opt_cfg.lr_wsd_decay_iters or 0) * g)
    try:
        return _schedule(opt_cfg, warmup, decay, wsd, unit="samples")
    except ValueError as e:
        raise ValueError(f"{e} (under --rampup-batch-size these lengths are in samples)") from None


def _schedule_in_tokens(opt_cfg: Any, train_iters: int, global_batch_size: int, train_samples: Optional[int],
                        seq_length: int) -> LRSchedule:
    """Megatron-DeepSpeed's token schedule: its step lengths are in samples, a sample is ``seq_length`` tokens, and
    a token flag replaces the step length it names (see the module's docstring)."""
    steps = _schedule_in_samples(
        SimpleNamespace(**{**vars(opt_cfg), "lr_decay_style": "constant"}), train_iters, global_batch_size,
        train_samples)
    step_warmup, step_decay = steps.warmup_steps * seq_length, steps.decay_steps * seq_length
    warmup_tokens, decay_tokens = getattr(opt_cfg, "lr_warmup_tokens", None), getattr(opt_cfg, "lr_decay_tokens", None)
    warmup = step_warmup if warmup_tokens is None else warmup_tokens
    decay = step_decay if decay_tokens is None else decay_tokens
    start = warmup if decay_tokens is not None else step_warmup
    wsd = 0
    if opt_cfg.lr_decay_style == "WSD":
        wsd = (opt_cfg.lr_wsd_decay_samples if opt_cfg.lr_wsd_decay_samples is not None
               else (opt_cfg.lr_wsd_decay_iters or 0) * global_batch_size)
    try:
        return _schedule(opt_cfg, warmup, decay, wsd * seq_length, unit="tokens", decay_start=start)
    except ValueError as e:
        raise ValueError(f"{e} (with --lr-decay-tokens/--lr-warmup-tokens these lengths are in tokens, "
                         f"samples x --seq-length {seq_length})") from None
