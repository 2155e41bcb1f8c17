"""The train/eval loop: steps, logging, evaluation, checkpoints, exit conditions.

One iteration = one optimizer step over the global batch (gradient accumulation inside). The
logged loss is the mean over the global batch (micro batches and data-parallel ranks) and over
the iterations since the last logged one, like Megatron; :class:`TrainResult` also keeps the
loss of every iteration.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ru.training import checkpoint as ckpt
from megatron_ru.training.data import micro_batches, pipeline_items
from megatron_ru.training.engine import grad_norm_of, loss_scale_of
from megatron_ru.training.metrics import (MetricsWriter, ModelShape, device_peak_tflops, flops_per_token,
                                          peak_memory_mib)
from megatron_ru.training.signals import ExitSignal
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)


@dataclass
class Progress:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, Optional[float]] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    iteration: int = 0
    exit_reason: str = "done"
    saved: list[int] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dp_mean(value: torch.Tensor, state: Any) -> float:
    if state.dp_size > 1:
        value = value.clone()
        dist.all_reduce(value, group=state.dp_group)
        value /= state.dp_size
    return float(value.item())


class Trainer:
    def __init__(self, engine: Any, state: Any, args: Any, train_ds: Any, valid_ds: Any, shape: ModelShape,
                 metrics: MetricsWriter, progress: Progress, exit_signal: Optional[ExitSignal] = None) -> None:
        self.engine, self.state, self.args = engine, state, args
        self.valid_ds = valid_ds
        self.metrics = metrics
        self.progress = progress
        self.exit_signal = exit_signal
        self.device = state.device
        self.is_pipe = state.pp_size > 1
        self.seq_length = args.data.seq_length
        self.flops_per_iter = flops_per_token(shape, args.model.recompute) * args.global_batch_size * self.seq_length
        self.peak_tflops = device_peak_tflops(args.precision, args.logging.peak_tflops)
        self.train_batches = micro_batches(train_ds, progress.consumed_train_samples, args.training.micro_batch_size,
                                           state.dp_rank, state.dp_size, self.device, args.data.num_workers)
        self._last_lr = engine.lr_scheduler.get_lr()[0]
        if self.train_batches is None:
            raise ValueError("the training dataset is empty: check --data-path and --split")
        self._valid_batches: Optional[Iterator] = None

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> float:
        engine = self.engine
        if self.is_pipe:
            loss = engine.train_batch(data_iter=pipeline_items(self.train_batches))
            return float(loss.item())  # already averaged over micro batches and DP by DeepSpeed
        engine.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(self.args.grad_accum):
            b = next(self.train_batches)
            loss = engine(b.tokens, labels=b.labels)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        return _dp_mean(total / self.args.grad_accum, self.state)

    def evaluate(self) -> Optional[float]:
        t = self.args.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        if self._valid_batches is None:
            self._valid_batches = self._cycle_valid()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.engine.eval()
        with torch.no_grad():
            for _ in range(t.eval_iters):
                if self.is_pipe:
                    total += self.engine.eval_batch(data_iter=pipeline_items(self._valid_batches)).double().reshape(())
                else:
                    for _ in range(self.args.grad_accum):
                        b = next(self._valid_batches)
                        total += self.engine(b.tokens, labels=b.labels).detach().double() / self.args.grad_accum
                self.progress.consumed_valid_samples += self.args.global_batch_size
        self.engine.train()
        mean = total / t.eval_iters
        return float(mean.item()) if self.is_pipe else _dp_mean(mean, self.state)

    def _cycle_valid(self) -> Iterator:
        """Validation micro batches continuing at the consumed-sample position; when the split is
        exhausted (e.g. a resumed run that evaluates more often than the first) start it over."""
        t, n = self.args.training, len(self.valid_ds)
        start = self.progress.consumed_valid_samples % n
        while True:
            got = 0
            for batch in micro_batches(self.valid_ds, start, t.micro_batch_size, self.state.dp_rank,
                                       self.state.dp_size, self.device):
                got += 1
                yield batch
            if got == 0 and start == 0:
                raise ValueError(f"the validation split has {n} samples, fewer than one micro batch per "
                                 f"data-parallel rank: give it a larger share in --split or set --eval-iters 0")
            log_rank0(log, f"validation split ({n} samples) read to the end: starting it over")
            start = 0

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, result: TrainResult) -> None:
        from megatron_ru.parallel.random import get_rng_state
        c, p = self.args.checkpoint, self.progress
        if not c.save or (result.saved and result.saved[-1] == p.iteration):
            return
        meta = ckpt.CheckpointMeta(
            iteration=p.iteration, consumed_train_samples=p.consumed_train_samples,
            consumed_valid_samples=p.consumed_valid_samples, tensor_model_parallel_size=self.state.tp_size,
            pipeline_model_parallel_size=self.state.pp_size, data_parallel_size=self.state.dp_size,
            zero_stage=self.args.training.zero_stage, args=self.args.to_dict())
        ckpt.save_checkpoint(self.engine, c.save, p.iteration, meta, self.state.rank, get_rng_state(),
                             keep_last=c.keep_last)
        result.saved.append(p.iteration)

    # ---- the loop ---------------------------------------------------------------------------
    def _exit_reason(self, started: float) -> Optional[str]:
        t, it = self.args.training, self.progress.iteration
        if t.exit_interval and it % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        if t.exit_duration_in_mins is not None:
            over = torch.tensor([1 if (time.time() - started) / 60.0 > t.exit_duration_in_mins else 0],
                                dtype=torch.int32, device=self.device)
            if dist.is_initialized():
                dist.all_reduce(over, op=dist.ReduceOp.MAX)  # all ranks stop at the same iteration
            if over.item():
                return f"--exit-duration-in-mins {t.exit_duration_in_mins}"
        if self.exit_signal is not None and self.exit_signal.received(self.device):
            return "exit signal"
        return None

    def _log(self, it: int, losses: list[float], elapsed: float, skipped: int, grad_norm: Optional[float]) -> None:
        n = len(losses)
        per_iter = elapsed / n
        tokens_per_sec = self.args.global_batch_size * self.seq_length / per_iter
        tflops = self.flops_per_iter / per_iter / self.state.world_size / 1e12
        label, mem = peak_memory_mib()
        self.metrics.log_train({
            "iteration": it, "train_iters": self.args.train_iters,
            "consumed_samples": self.progress.consumed_train_samples, "elapsed_ms": 1000.0 * per_iter,
            "lr": self._last_lr, "global_batch_size": self.args.global_batch_size,
            "lm_loss": sum(losses) / n, "loss_scale": loss_scale_of(self.engine), "grad_norm": grad_norm,
            "skipped_iterations": skipped, "tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
            "mfu": (tflops / self.peak_tflops) if self.peak_tflops else None, "memory_label": label,
            "peak_memory_mib": mem})

    def train(self, on_iteration: Optional[Callable[[int, float], None]] = None,
              job_started: Optional[float] = None) -> TrainResult:
        args, p, result = self.args, self.progress, TrainResult()
        started = time.time() if job_started is None else job_started
        window: list[float] = []
        skipped_window = 0
        window_start = time.perf_counter()
        log_rank0(log, f"training from iteration {p.iteration} to {args.train_iters} "
                       f"(consumed samples {p.consumed_train_samples})")
        while p.iteration < args.train_iters:
            self._last_lr = self.engine.lr_scheduler.get_lr()[0]  # the lr this step applies
            skipped_before = self.engine.skipped_steps
            loss = self.train_step()
            p.iteration += 1
            p.consumed_train_samples += args.global_batch_size
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at iteration {p.iteration}; lower --lr, raise "
                                         f"--lr-warmup-iters, or use --bf16 instead of --fp16")
            grad_norm = grad_norm_of(self.engine)
            result.losses[p.iteration], result.grad_norms[p.iteration] = loss, grad_norm
            window.append(loss)
            skipped_window += self.engine.skipped_steps - skipped_before
            if on_iteration is not None:
                on_iteration(p.iteration, loss)
            if p.iteration % args.logging.log_interval == 0 or p.iteration == args.train_iters:
                _sync(self.device)
                self._log(p.iteration, window, time.perf_counter() - window_start, skipped_window, grad_norm)
                window, skipped_window, window_start = [], 0, time.perf_counter()
            if args.training.eval_interval and p.iteration % args.training.eval_interval == 0:
                self._eval_and_log(result)
            c = args.checkpoint
            if c.save and c.save_interval and p.iteration % c.save_interval == 0:
                self.save(result)
            reason = self._exit_reason(started) if p.iteration < args.train_iters else None
            if reason:
                log_rank0(log, f"exiting at iteration {p.iteration}: {reason}")
                result.exit_reason = reason
                break
        if result.exit_reason == "done" and not (args.training.eval_interval and
                                                 p.iteration % args.training.eval_interval == 0):
            self._eval_and_log(result)
        self.save(result)
        result.iteration = p.iteration
        return result

    def _eval_and_log(self, result: TrainResult) -> None:
        val = self.evaluate()
        if val is not None:
            result.evals.append(self.metrics.log_eval(self.progress.iteration, val))
