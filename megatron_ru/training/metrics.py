"""Progress lines, JSONL metrics, TensorBoard and Weights & Biases scalars, throughput, TFLOP/s, MFU, ETA.

The scalars of a logged iteration or evaluation are computed once (:func:`train_scalars`,
:func:`eval_scalars`) and handed to every sink (TensorBoard, W&B), so the two cannot drift apart.

TFLOP/s per device: the model FLOPs of :mod:`megatron_ru.model.flops` per iteration, divided by the
iteration time and the number of devices.

MFU = achieved TFLOP/s per device / peak dense TFLOP/s of the device in the training precision
(:data:`megatron_ru.plan.hardware.PEAK_TFLOPS`, or ``--peak-tflops``).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_ru.utils.logging import get_logger

if TYPE_CHECKING:
    from megatron_ru.config.model import ModelConfig

log = get_logger(__name__)

def peak_memory_mib() -> tuple[str, float]:
    """(label, MiB): peak allocated accelerator memory, or this process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return "peak mem", torch.cuda.max_memory_allocated() / 2 ** 20
    # ru_maxrss is KiB on Linux
    return "peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def format_duration(seconds: float) -> str:
    """``1 day, 2:03:04`` / ``0:05:07``: whole seconds, like ``datetime.timedelta``."""
    return str(datetime.timedelta(seconds=int(round(seconds))))


class EtaClock:
    """Estimated time to finish: the mean wall time per iteration since the end of this process's first
    logged interval, times the iterations left to ``train_iters`` (--train-iters, or --train-samples over
    the global batch). The first interval is left out: it holds the warm-up (first forward graphs, the
    allocator growing, data loader start). Evaluations and checkpoint saves between logged iterations are
    inside the mean, as they will be inside the remaining time. None until a second interval was logged."""

    def __init__(self, train_iters: int) -> None:
        self.train_iters = train_iters
        self._start: Optional[tuple[int, float]] = None

    def update(self, iteration: int, now: float) -> Optional[float]:
        """Seconds left after ``iteration``, measured at wall time ``now`` (seconds)."""
        if self._start is None or iteration <= self._start[0]:
            self._start = (iteration, now)
            return None
        it0, t0 = self._start
        return (now - t0) / (iteration - it0) * max(0, self.train_iters - iteration)


def format_train_line(rec: dict[str, Any]) -> str:
    """One Megatron-like progress line from a train record (see :meth:`MetricsWriter.log_train`)."""
    parts = [
        f" iteration {rec['iteration']:8d}/{rec['train_iters']:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
    ]
    if rec.get("consumed_tokens") is not None:
        parts.append(f"consumed tokens: {rec['consumed_tokens']:14d}")
    parts += [
        f"elapsed time per iteration (ms): {rec['elapsed_ms']:.1f}",
        f"learning rate: {rec['lr']:.3E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['lm_loss']:.6E}",
        f"loss scale: {rec['loss_scale']:.1f}",
    ]
    if rec.get("grad_norm") is not None:
        parts.append(f"grad norm: {rec['grad_norm']:.3f}")
    parts += [
        f"number of skipped iterations: {rec['skipped_iterations']:3d}",
        f"tokens/s: {rec['tokens_per_sec']:.1f}",
        f"TFLOP/s/device: {rec['tflops_per_device']:.3f}",
    ]
    if rec.get("mfu") is not None:
        parts.append(f"MFU: {100.0 * rec['mfu']:.1f}%")
    parts.append(f"{rec['memory_label']} (MiB): {rec['peak_memory_mib']:.0f}")
    if rec.get("eta_seconds") is not None:
        parts.append(f"ETA: {format_duration(rec['eta_seconds'])}")
    return " | ".join(parts) + " |"


#: the scalars of a train record, under ``train/<key>``, against the iteration
TRAIN_SCALAR_KEYS = ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device", "mfu",
                     "elapsed_ms", "peak_memory_mib", "consumed_samples", "consumed_tokens")
#: the optional scalars of a train record (present only under their --log-* flag), under Megatron-LM's tag
#: names: record key -> tag. ``mem_max_rss_bytes`` is the CPU stand-in for Megatron's CUDA allocator numbers
#: (this process's peak resident set size; Megatron has no CPU tag).
MEGATRON_TRAIN_TAGS = {"batch_size": "batch-size", "world_size": "world-size", "params_norm": "params-norm",
                       "num_zeros": "num-zeros",
                       "iteration_time": "iteration-time", "mem_reserved_bytes": "mem-reserved-bytes",
                       "mem_allocated_bytes": "mem-allocated-bytes",
                       "mem_max_allocated_bytes": "mem-max-allocated-bytes", "mem_max_rss_bytes": "mem-max-rss-bytes"}
#: the tag of the consumed-samples axis, and the scalars plotted against it instead of the iteration
SAMPLES_TAG = "train/consumed_samples"
VS_SAMPLES_TAGS = ("train/lm_loss_vs_samples", "batch-size vs samples", "world-size vs samples",
                   "params-norm vs samples", "num-zeros vs samples", "lm loss validation ppl vs samples")


def memory_bytes(device: torch.device) -> dict[str, float]:
    """--log-memory-to-tensorboard: Megatron's CUDA allocator numbers (reserved, allocated, peak allocated
    bytes) on a GPU; on CPU this process's peak RSS (``mem_max_rss_bytes``), the one honest number there."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem_reserved_bytes": float(stats.get("reserved_bytes.all.current", 0)),
                "mem_allocated_bytes": float(stats.get("allocated_bytes.all.current", 0)),
                "mem_max_allocated_bytes": float(stats.get("allocated_bytes.all.peak", 0))}
    return {"mem_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0}  # KiB on Linux


@dataclass(frozen=True)
class Scalars:
    """What one logged iteration or evaluation sends to TensorBoard and W&B: ``values`` (tag -> value) at
    step ``iteration``, except the tags in :data:`VS_SAMPLES_TAGS`, whose step is ``samples`` (then also
    present as :data:`SAMPLES_TAG`)."""

    iteration: int
    values: dict[str, float]
    samples: Optional[int] = None

    def step_of(self, tag: str) -> int:
        if tag in VS_SAMPLES_TAGS:
            assert self.samples is not None, tag
            return self.samples
        return self.iteration


def train_scalars(rec: dict[str, Any]) -> Scalars:
    """The scalars of a train record (:meth:`MetricsWriter.log_train`); None values are left out."""
    values = {f"train/{key}": float(rec[key]) for key in TRAIN_SCALAR_KEYS if rec.get(key) is not None}
    values["train/lm_loss_vs_samples"] = float(rec["lm_loss"])
    values[SAMPLES_TAG] = float(rec["consumed_samples"])
    for key, tag in MEGATRON_TRAIN_TAGS.items():
        if rec.get(key) is not None:
            values[tag] = float(rec[key])
            if f"{tag} vs samples" in VS_SAMPLES_TAGS:
                values[f"{tag} vs samples"] = float(rec[key])
    return Scalars(rec["iteration"], values, samples=int(rec["consumed_samples"]))


def eval_scalars(rec: dict[str, Any], megatron_ppl: bool = False) -> Scalars:
    """The scalars of an eval record (:meth:`MetricsWriter.log_eval`): ``<split>/loss``, ``<split>/ppl`` and,
    for a tokenizer with text, ``<split>/bits_per_byte`` and ``<split>/bits_per_char``. ``megatron_ppl``
    (--log-validation-ppl-to-tensorboard): also Megatron-LM's ``lm loss <split> ppl`` (exp(min(loss, 20))),
    against the iteration and, as ``... vs samples``, against the consumed training samples."""
    split = rec["split"]
    values = {f"{split}/loss": float(rec["val_loss"]), f"{split}/ppl": float(rec["val_ppl"])}
    for key in ("val_bits_per_byte", "val_bits_per_char"):
        if rec.get(key) is not None:
            values[f"{split}/{key[4:]}"] = float(rec[key])
    samples = rec.get("consumed_samples")
    if megatron_ppl:
        values[f"lm loss {split} ppl"] = float(rec["val_ppl"])
        if samples is not None and split == "validation":
            values["lm loss validation ppl vs samples"] = float(rec["val_ppl"])
    return Scalars(rec["iteration"], values, samples=samples)


class TensorBoardSink:
    """TensorBoard scalars (``torch.utils.tensorboard``), flushed after every logging event."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, scalars: Scalars) -> None:
        for tag, value in scalars.values.items():
            self._writer.add_scalar(tag, value, scalars.step_of(tag))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Writes progress lines, JSONL records, TensorBoard and W&B scalars; active on one rank only (global
    rank 0, which holds the loss averaged over the whole batch also with a pipeline: DeepSpeed broadcasts
    it from the last stage). ``run_config``: all flags, resolved (the W&B run's config); ``save_dir``:
    --save (W&B's default directory is ``<save>/wandb``, as in Megatron)."""

    def __init__(self, log_cfg: Any, active: bool, run_config: Optional[dict[str, Any]] = None,
                 save_dir: Optional[str] = None) -> None:
        self.active = active
        self._megatron_ppl = bool(getattr(log_cfg, "log_validation_ppl_to_tensorboard", False))
        self._jsonl = None
        self._sinks: list[Any] = []
        if not active:
            return
        if log_cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log_cfg.metrics_file)), exist_ok=True)
            self._jsonl = open(log_cfg.metrics_file, "a", encoding="utf-8")
        if log_cfg.tensorboard_dir:
            self._sinks.append(TensorBoardSink(log_cfg.tensorboard_dir))
        if log_cfg.wandb_requested:
            from megatron_ru.training.wandb_writer import WandbSink
            self._sinks.append(WandbSink(log_cfg.wandb_project, log_cfg.wandb_exp_name, log_cfg.wandb_save_dir,
                                         save_dir, run_config, getattr(log_cfg, "wandb_id", None)))

    def _write_scalars(self, scalars: Scalars) -> None:
        for sink in self._sinks:
            sink.write(scalars)

    def _write_json(self, rec: dict[str, Any]) -> None:
        if self._jsonl is not None:
            # json writes floats with repr(): full precision, not rounded
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()

    def log_auto_layout(self, choice: dict[str, Any]) -> None:
        """--auto-layout's choice (megatron_ru/plan/auto.py), one record before the first iteration's."""
        if self.active:
            self._write_json({"type": "auto_layout", **{k: v for k, v in choice.items() if k != "block"}})

    def log_train(self, rec: dict[str, Any]) -> None:
        if not self.active:
            return
        log.info(format_train_line(rec))
        self._write_json({"type": "train", **rec})
        self._write_scalars(train_scalars(rec))

    def log_eval(self, iteration: int, val_loss: float, split: str = "validation",
                 text: Optional[dict[str, float]] = None, consumed_tokens: Optional[int] = None,
                 consumed_samples: Optional[int] = None) -> dict[str, Any]:
        """Log a validation loss and its perplexity (``exp(min(loss, 20))`` like Megatron); ``text``:
        bits per byte / per character and the counts behind them (:func:`bits_per_text`);
        ``consumed_tokens`` / ``consumed_samples``: training tokens / samples consumed so far (kept in the
        JSONL record, for plots; the samples are the step of ``lm loss validation ppl vs samples``)."""
        rec = {"type": "eval", "split": split, "iteration": iteration, "val_loss": val_loss,
               "val_ppl": math.exp(min(20.0, val_loss)), **(text or {})}
        if consumed_tokens is not None:
            rec["consumed_tokens"] = consumed_tokens
        if consumed_samples is not None:
            rec["consumed_samples"] = consumed_samples
        if not self.active:
            return rec
        extra = ""
        if text:
            extra = (f" bits per byte: {text['val_bits_per_byte']:.6f} | bits per char: "
                     f"{text['val_bits_per_char']:.6f} |")
        log.info(f" {split} loss at iteration {iteration} | lm loss value: {val_loss:.6E} | "
                 f"lm loss PPL: {rec['val_ppl']:.6E} |{extra}")
        self._write_json(rec)
        self._write_scalars(eval_scalars(rec, self._megatron_ppl))
        return rec

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def bits_per_text(mean_loss: float, tokens: int, nbytes: int, nchars: int) -> dict[str, float]:
    """Bits per byte and per character of scored text: the total negative log-likelihood (``mean_loss``
    nats × ``tokens``) in bits over the text's UTF-8 bytes / characters (comparable across tokenizers)."""
    bits = mean_loss * tokens / math.log(2)
    return {"val_bits_per_byte": bits / nbytes if nbytes else float("nan"),
            "val_bits_per_char": bits / nchars if nchars else float("nan"),
            "val_tokens": tokens, "val_bytes": nbytes, "val_chars": nchars}
