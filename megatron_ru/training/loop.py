"""The train/eval loop: steps, logging, evaluation, checkpoints, exit conditions.

One iteration = one optimizer step over the global batch (gradient accumulation inside). The
logged loss is the mean over the global batch (micro batches and data-parallel ranks) and over
the iterations since the last logged one, like Megatron; :class:`TrainResult` also keeps the
loss of every iteration. Under --rampup-batch-size the global batch of each step is the ramp's at the
samples consumed before it (:class:`megatron_ru.config.batch_ramp.BatchRamp`): the engine's accumulation
count follows it, consumed samples and the learning rate advance by it, the log reports it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ru.config.batch_ramp import BatchRamp
from megatron_ru.config.training import CheckpointConfig, LoggingConfig, TrainingConfig
from megatron_ru.deepspeed_bridge.engine import grad_norm_of, loss_scale_of
from megatron_ru.parallel.comm_audit import audit_for_run
from megatron_ru.parallel.state import ParallelState
from megatron_ru.training import checkpoint as ckpt
from megatron_ru.data.documents import DocumentMasking
from megatron_ru.training.data import Batch, SampleDataset, micro_batches, per_token_denominators, pipeline_items
from megatron_ru.training.metrics import EtaClock, MetricsWriter, memory_bytes, peak_memory_mib
from megatron_ru.training.signals import ExitSignal
from megatron_ru.utils.logging import get_logger, log_rank0

if TYPE_CHECKING:
    from megatron_ru.deepspeed_bridge.engine import DeepSpeedEngine

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


@dataclass(frozen=True)
class BatchPlan:
    """The resolved batch numbers the loop runs by (``Arguments`` derives them from the flags and
    the world size; validation made them exact)."""

    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    seq_length: int
    #: DataLoader worker processes per rank (--num-workers)
    num_workers: int = 0
    #: --rampup-batch-size (None: every step runs ``global_batch_size``)
    ramp: Optional[BatchRamp] = None

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step after ``consumed_samples`` samples."""
        return self.global_batch_size if self.ramp is None else self.ramp.batch_size_at(consumed_samples)


@dataclass(frozen=True)
class Throughput:
    """What the progress line needs to turn step time into TFLOP/s and MFU."""

    flops_per_iter: float
    peak_tflops: Optional[float]


def _dp_mean(value: torch.Tensor, state: ParallelState) -> float:
    if state.dp_size > 1:
        value = value.clone()
        dist.all_reduce(value, group=state.dp_group)
        value /= state.dp_size
    return float(value.item())


class Trainer:
    """Runs the loop over an engine. It reads only what it is given: the batch plan, the
    training/checkpoint/logging configs, and ``run_config`` (all flags, resolved: stored in each
    checkpoint's metadata)."""

    def __init__(self, engine: "DeepSpeedEngine", state: ParallelState, plan: BatchPlan,
                 training: TrainingConfig, checkpoint: CheckpointConfig, logging: LoggingConfig,
                 train_ds: Optional[SampleDataset], valid_ds: Optional[SampleDataset], throughput: Throughput,
                 metrics: MetricsWriter, progress: Progress, exit_signal: Optional[ExitSignal] = None,
                 run_config: Optional[dict[str, Any]] = None,
                 checkpoint_record: Optional[dict[str, Any]] = None,
                 text_tables: Optional[torch.Tensor] = None,
                 predicted_memory_mib: Optional[float] = None,
                 documents: Optional[DocumentMasking] = None) -> None:
        """``documents``: packed documents' position ids, attention and loss masks (--reset-position-ids,
        --reset-attention-mask, --eod-mask-loss). ``checkpoint_record``: what every saved checkpoint records about the model (``model_args``,
        ``vocab_size``, ``tokenizer``: fields of :class:`CheckpointMeta`). ``text_tables``: [2, V] int64
        on the device, UTF-8 bytes and characters per token id (validation then reports bits per byte
        and per character; None for a tokenizer without text). ``predicted_memory_mib``: the planner's
        memory per GPU for this layout, logged next to the measured peak at the first logged iteration."""
        self.engine, self.state, self.plan = engine, state, plan
        self.training, self.checkpoint, self.logging = training, checkpoint, logging
        self.valid_ds = valid_ds
        self.throughput = throughput
        self.metrics = metrics
        self.progress = progress
        self.exit_signal = exit_signal
        self.run_config = run_config or {}
        self.checkpoint_record = checkpoint_record or {}
        self.text_tables = text_tables
        self.predicted_memory_mib = predicted_memory_mib
        self._eta = EtaClock(plan.train_iters)
        self._logged_memory = False
        self._text_counts = torch.zeros(3, dtype=torch.int64, device=state.device)  # bytes, characters, tokens
        self.device = state.device
        self.is_pipe = state.pp_size > 1
        self.documents = documents
        self._num_zeros = None
        if logging.log_num_zeros_in_grad:  # a count before every optimizer step; nothing installed otherwise
            from megatron_ru.training.engine import NumZerosInGrad
            self._num_zeros = NumZerosInGrad(engine, state)
        # the sampler's data-parallel rank and size: the CP ranks of one sample read the same samples
        self.train_batches = micro_batches(train_ds, progress.consumed_train_samples, plan.micro_batch_size,
                                           state.data_rank, state.data_size, self.device, plan.num_workers, documents)
        self._last_lr = engine.lr_scheduler.get_lr()[0]
        if self.train_batches is None:
            raise ValueError("the training dataset is empty: check --data-path and --split")
        self._valid_batches: Optional[Iterator[Batch]] = None
        self.comm_audit = audit_for_run(logging.comm_audit, state)  # per-iteration op counts (--comm-audit)
        #: the global batch (and micro batches per rank) the engine runs now; the ramp changes them between steps
        self.current_batch, self.grad_accum = plan.global_batch_size, plan.grad_accum
        self._window_samples = 0  # samples trained since the last logged iteration

    def set_batch(self, global_batch: int) -> None:
        """Run the next steps with ``global_batch`` samples: DeepSpeed's accumulation count (its loss scaling
        1/count and, with a pipeline, the micro batches of ``train_batch``) follows; the scheduler advances by
        the batch when its schedule is in samples, by the batch's tokens when in tokens (--lr-*-tokens)."""
        scheduler = self.engine.lr_scheduler
        unit = scheduler.schedule.unit
        scheduler.increment = (global_batch if unit == "samples" else global_batch * self.plan.seq_length
                               if unit == "tokens" else 1)
        if global_batch == self.current_batch:
            return
        log_rank0(log, f"batch size ramp-up: global batch {global_batch} from iteration {self.progress.iteration + 1} "
                       f"(consumed samples {self.progress.consumed_train_samples})")
        self.engine.set_train_batch_size(global_batch * self.state.cp_size)  # DeepSpeed's count (DP x CP replicas)
        self.current_batch = global_batch
        self.grad_accum = global_batch // (self.plan.micro_batch_size * self.state.data_size)

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> float:
        engine = self.engine
        batches, _ = self._this_step(self.train_batches, self.grad_accum)
        if self.is_pipe:
            loss = engine.train_batch(data_iter=pipeline_items(batches))
            return float(loss.item())  # already averaged over micro batches and DP by DeepSpeed
        engine.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.grad_accum):
            if self.plan.ramp is not None:  # DeepSpeed's own count (micro steps % accumulation) breaks when it changes
                engine.set_gradient_accumulation_boundary(i == self.grad_accum - 1)
            b = next(batches)
            loss = engine(b.tokens, labels=b.loss_targets(), position_ids=b.position_ids, document_ids=b.document_ids)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        return _dp_mean(total / self.grad_accum, self.state)

    def _this_step(self, batches: Iterator[Batch], count: int) -> tuple[Iterator[Batch], float]:
        """The step's ``count`` micro batches and the step's weight in an average over steps. Without
        --calculate-per-token-loss: ``batches`` itself, read as the engine goes, weight 1. With it: read ahead,
        their unmasked tokens summed over the data-parallel ranks, each given its share of that count
        (:func:`per_token_denominators`); the weight is the count (Megatron-LM's sums of losses and tokens)."""
        if not self.training.calculate_per_token_loss:
            return self._context_split(batches), 1.0
        step = [next(batches) for _ in range(count)]
        tokens = torch.tensor([float(sum(b.scored_tokens() for b in step))], dtype=torch.float64, device=self.device)
        if self.state.data_size > 1:
            dist.all_reduce(tokens, group=self.state.data_group)
        step = per_token_denominators(step, float(tokens.item()), self.state.data_size)
        return self._context_split(iter(step)), float(tokens.item())

    def _context_split(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """With context parallelism, this rank's chunks of each micro batch (:meth:`Batch.for_context_parallel`);
        the batches themselves otherwise."""
        cp = self.state.cp_size
        if cp == 1:
            return batches
        return (b.for_context_parallel(cp, self.state.cp_rank) for b in batches)

    def evaluate(self) -> Optional[float]:
        t = self.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        if self._valid_batches is None:
            self._valid_batches = self._counted(self._cycle_valid())
        self._text_counts.zero_()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        weights = 0.0
        self.engine.eval()
        with torch.no_grad():
            for _ in range(t.eval_iters):
                batches, weight = self._this_step(self._valid_batches, self.plan.grad_accum)
                weights += weight
                if self.is_pipe:
                    total += weight * self.engine.eval_batch(data_iter=pipeline_items(batches),  # full batch
                                                             num_micro_batches=self.plan.grad_accum).double().reshape(())
                else:
                    for _ in range(self.plan.grad_accum):
                        b = next(batches)
                        loss = self.engine(b.tokens, labels=b.loss_targets(), position_ids=b.position_ids,
                                           document_ids=b.document_ids)
                        total += weight * loss.detach().double() / self.plan.grad_accum
                self.progress.consumed_valid_samples += self.plan.global_batch_size
        self.engine.train()
        mean = total / weights
        return float(mean.item()) if self.is_pipe else _dp_mean(mean, self.state)

    def _counted(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """``batches``, adding the UTF-8 bytes and characters of each one's labels (the scored text) to
        the running counts (the first and the last pipeline stage read every micro batch)."""
        for b in batches:
            if self.text_tables is not None:
                labels = b.labels.reshape(-1) if b.loss_mask is None else b.labels[b.loss_mask > 0]
                self._text_counts[:2] += self.text_tables[:, labels].sum(dim=1)
                self._text_counts[2] += labels.numel()
            yield b

    def text_metrics(self, mean_loss: float) -> Optional[dict[str, float]]:
        """Bits per byte / character of the last evaluation (counts summed over the data-parallel ranks;
        only the tokens whose loss counts: all ``b × s`` of a micro batch without --eod-mask-loss)."""
        if self.text_tables is None:
            return None
        from megatron_ru.training.metrics import bits_per_text
        counts = self._text_counts.clone()  # of whole micro batches: summed over the ranks reading other samples
        if self.state.data_size > 1:
            dist.all_reduce(counts, group=self.state.data_group)
        nbytes, nchars, tokens = (int(x) for x in counts.tolist())
        return bits_per_text(mean_loss, tokens, nbytes, nchars)

    def _cycle_valid(self) -> Iterator[Batch]:
        """Validation micro batches continuing at the consumed-sample position; when the split is
        exhausted (e.g. a resumed run that evaluates more often than the first) start it over."""
        assert self.valid_ds is not None
        n = len(self.valid_ds)
        start = self.progress.consumed_valid_samples % n
        while True:
            got = 0
            for batch in micro_batches(self.valid_ds, start, self.plan.micro_batch_size, self.state.data_rank,
                                       self.state.data_size, self.device, documents=self.documents):
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
        c, p = self.checkpoint, self.progress
        if not c.save or (result.saved and result.saved[-1] == p.iteration):
            return
        meta = ckpt.CheckpointMeta(
            iteration=p.iteration, consumed_train_samples=p.consumed_train_samples,
            consumed_valid_samples=p.consumed_valid_samples, tensor_model_parallel_size=self.state.tp_size,
            pipeline_model_parallel_size=self.state.pp_size, data_parallel_size=self.state.dp_size,
            zero_stage=self.training.zero_stage, args=self.run_config, **self.checkpoint_record)
        ckpt.save_checkpoint(self.engine, c.save, p.iteration, meta, get_rng_state(),
                             keep_last=c.keep_last, state=self.state, ckpt_format=c.ckpt_format)
        result.saved.append(p.iteration)

    # ---- the loop ---------------------------------------------------------------------------
    def _tokens_reached(self) -> Optional[str]:
        """--train-tokens (Megatron-DeepSpeed's): the run ends once the tokens consumed reach it."""
        n = self.training.train_tokens
        if n is not None and self.progress.consumed_train_samples * self.plan.seq_length >= n:
            return f"--train-tokens {n}"
        return None

    def _exit_reason(self, started: float) -> Optional[str]:
        t, it = self.training, self.progress.iteration
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
        samples, self._window_samples = self._window_samples, 0  # the ramp's batches of the window, summed
        tokens_per_sec = samples * self.plan.seq_length / elapsed
        flops = self.throughput.flops_per_iter * samples / (n * self.plan.global_batch_size)
        tflops = flops / per_iter / self.state.world_size / 1e12
        peak = self.throughput.peak_tflops
        label, mem = peak_memory_mib()
        eta = self._eta.update(it, time.perf_counter())
        rec = {
            "iteration": it, "train_iters": self.plan.train_iters,
            "consumed_samples": self.progress.consumed_train_samples,
            "consumed_tokens": self.progress.consumed_train_samples * self.plan.seq_length,
            "elapsed_ms": 1000.0 * per_iter,
            "lr": self._last_lr, "global_batch_size": self.current_batch,
            "lm_loss": sum(losses) / n, "loss_scale": loss_scale_of(self.engine), "grad_norm": grad_norm,
            "skipped_iterations": skipped, "tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
            "mfu": (tflops / peak) if peak else None, "memory_label": label,
            "peak_memory_mib": mem, "eta_seconds": eta}
        rec.update(self._megatron_scalars(per_iter, rec["global_batch_size"]))
        self.metrics.log_train(rec)
        if not self._logged_memory:
            self._logged_memory = True
            self._log_memory(label, mem)

    def _megatron_scalars(self, per_iter: float, batch: int) -> dict[str, float]:
        """The record keys of the --log-*-to-tensorboard / --log-params-norm / --log-num-zeros-in-grad
        switches that are on (:data:`megatron_ru.training.metrics.MEGATRON_TRAIN_TAGS` names their tags).
        Called on every rank: the params norm and the zero count are all-reduces."""
        lg, out = self.logging, {}
        if lg.log_params_norm:
            from megatron_ru.training.engine import params_norm_tp_aware
            out["params_norm"] = params_norm_tp_aware(self.engine.module.parameters(), self.state.tp_rank,
                                                      self.state.mp_group)
        if self._num_zeros is not None:
            zeros = self._num_zeros.value()  # the logged iteration's step, as Megatron; None: skipped
            if zeros is not None:
                out["num_zeros"] = zeros
        if lg.log_batch_size_to_tensorboard:
            out["batch_size"] = batch
        if lg.log_world_size_to_tensorboard:
            out["world_size"] = self.state.world_size
        if lg.log_timers_to_tensorboard:
            out["iteration_time"] = per_iter  # seconds, the mean over the logged window (Megatron's)
        if lg.log_memory_to_tensorboard:
            out.update(memory_bytes(self.device))
        return out

    def _log_memory(self, label: str, measured_mib: float) -> None:
        """The measured peak after the first logged iteration (its optimizer steps allocated the optimizer
        state), the largest over all ranks (one all-reduce, every rank logs the same iterations), next to
        the planner's prediction for the layout; logged on global rank 0."""
        peak = torch.tensor([measured_mib], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.state.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        line = f"memory after the first logged iteration: {label} {peak.item():.0f} MiB (largest rank)"
        if self.predicted_memory_mib:
            line += (f", planner's prediction {self.predicted_memory_mib:.0f} MiB per GPU "
                     f"(measured / predicted {peak.item() / self.predicted_memory_mib:.2f})")
            if self.device.type != "cuda":
                line += "; on CPU the measure is the process's RSS (libraries included), not an accelerator's memory"
        log_rank0(log, line)

    def train(self, on_iteration: Optional[Callable[[int, float], None]] = None,
              job_started: Optional[float] = None) -> TrainResult:
        plan, t, c, p, result = self.plan, self.training, self.checkpoint, self.progress, TrainResult()
        started = time.time() if job_started is None else job_started
        window: list[float] = []
        skipped_window = 0
        window_start = time.perf_counter()
        log_rank0(log, f"training from iteration {p.iteration} to {plan.train_iters} "
                       f"(consumed samples {p.consumed_train_samples})"
                       + (f" or {t.train_tokens} tokens" if t.train_tokens is not None else ""))
        budget = self._tokens_reached()  # --train-tokens: an end of training, evaluated and saved as one
        while p.iteration < plan.train_iters and budget is None:
            self._last_lr = self.engine.lr_scheduler.get_lr()[0]  # the lr this step applies
            skipped_before = self.engine.skipped_steps
            self.set_batch(plan.batch_size_at(p.consumed_train_samples))
            with self.comm_audit.window(p.iteration + 1):
                loss = self.train_step()
            p.iteration += 1
            p.consumed_train_samples += self.current_batch
            self._window_samples += self.current_batch
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at iteration {p.iteration}; lower --lr, raise "
                                         f"--lr-warmup-iters, or use --bf16 instead of --fp16")
            grad_norm = grad_norm_of(self.engine)
            result.losses[p.iteration], result.grad_norms[p.iteration] = loss, grad_norm
            window.append(loss)
            skipped_window += self.engine.skipped_steps - skipped_before
            if on_iteration is not None:
                on_iteration(p.iteration, loss)
            budget = self._tokens_reached()
            if p.iteration % self.logging.log_interval == 0 or p.iteration == plan.train_iters or budget:
                _sync(self.device)
                self._log(p.iteration, window, time.perf_counter() - window_start, skipped_window, grad_norm)
                window, skipped_window, window_start = [], 0, time.perf_counter()
            if t.eval_interval and p.iteration % t.eval_interval == 0:
                self._eval_and_log(result)
            if c.save and c.save_interval and p.iteration % c.save_interval == 0:
                self.save(result)
            reason = self._exit_reason(started) if p.iteration < plan.train_iters and budget is None else None
            if reason:
                log_rank0(log, f"exiting at iteration {p.iteration}: {reason}")
                result.exit_reason = reason
                break
        if budget is not None and result.exit_reason == "done" and p.iteration < plan.train_iters:
            log_rank0(log, f"training ends at iteration {p.iteration}: {budget} reached "
                           f"({p.consumed_train_samples * plan.seq_length} tokens consumed)")
            result.exit_reason = budget
        if result.exit_reason in ("done", budget) and not (t.eval_interval and p.iteration % t.eval_interval == 0):
            self._eval_and_log(result)
        self.save(result)
        result.iteration = p.iteration
        return result

    def _eval_and_log(self, result: TrainResult) -> None:
        val = self.evaluate()
        if val is not None:
            tokens = self.progress.consumed_train_samples * self.plan.seq_length
            result.evals.append(self.metrics.log_eval(self.progress.iteration, val, text=self.text_metrics(val),
                                                      consumed_tokens=tokens,
                                                      consumed_samples=self.progress.consumed_train_samples))
