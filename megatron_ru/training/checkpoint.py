"""Checkpoints: one directory per iteration, an atomic ``latest`` pointer, weights-only loading.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     "10" — Megatron's pointer, replaced atomically last
    DIR/iter_0000010/
        metadata.json                         iteration, consumed samples, layout, args (rank 0)
        mp_rank_XX_model_states.pt            DeepSpeed's model files (PP=1) or
        layer_XX-model_YY-model_states.pt     DeepSpeed's per-layer files (PP>1)
        *zero_pp_rank_*_optim_states.pt       DeepSpeed's (ZeRO-partitioned) optimizer states
        rng_rank_00003.pt                     RNG states of every rank

DeepSpeed writes the model/optimizer/scheduler/loss-scaler files (``save_checkpoint`` with our
tag and ``save_latest=False``); we add the metadata and RNG files and own the pointer: it is
written to a temporary name and ``os.replace``-d only after a barrier that every rank reaches
after finishing its files, so a crash during a save leaves the previous checkpoint current.

Loading never unpickles arbitrary code: every file is read with ``torch.load(weights_only=True)``;
DeepSpeed's optimizer files need four of its plain data classes, which are allow-listed
explicitly (:data:`SAFE_DEEPSPEED_GLOBALS`), nothing else.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _safe_deepspeed_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` with DeepSpeed's plain data classes allow-listed."""
    with torch.serialization.safe_globals(_safe_deepspeed_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def install_weights_only_loading(engine: Any) -> None:
    """Make DeepSpeed read checkpoints through :func:`safe_load` (its default engine uses
    ``weights_only=False``)."""
    ckpt_engine = engine.checkpoint_engine

    def load(path: str, map_location: Any = None) -> Any:
        return safe_load(path, map_location="cpu" if map_location is None else map_location)

    ckpt_engine.load = load


def write_text_atomic(path: str, text: str) -> None:
    """Write to a temporary name, fsync, rename over ``path`` (atomic on POSIX)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration in ``latest_checkpointed_iteration.txt``; None when there is no checkpoint."""
    path = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        raise ValueError(f"{path} says 'release' (a Megatron-LM release checkpoint); this loader reads "
                         f"checkpoints written by megatron_ru: point --load at one of those")
    if not text.isdigit():
        raise ValueError(f"{path} should hold an iteration number, found {text!r}; the checkpoint "
                         f"directory is damaged: fix or remove the file, or point --load elsewhere")
    return int(text)


def list_iterations(save_dir: str) -> list[int]:
    if not os.path.isdir(save_dir):
        return []
    out = [int(m.group(1)) for m in (_ITER_RE.match(n) for n in os.listdir(save_dir)) if m]
    return sorted(out)


def prune_checkpoints(save_dir: str, keep_last: int, current: int) -> list[int]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never ``current``)."""
    iters = [i for i in list_iterations(save_dir) if i <= current]
    doomed = iters[:-keep_last] if keep_last > 0 else []
    for it in doomed:
        if it != current:
            shutil.rmtree(os.path.join(save_dir, iteration_dir_name(it)), ignore_errors=True)
    return doomed


@dataclass
class CheckpointMeta:
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    args: dict[str, Any]

    @classmethod
    def read(cls, ckpt_dir: str) -> "CheckpointMeta":
        path = os.path.join(ckpt_dir, METADATA_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {ckpt_dir} is not a complete megatron_ru "
                                    f"checkpoint; point --load at a directory written by --save")
        return cls(**json.load(open(path, encoding="utf-8")))


def layout_problems(meta: CheckpointMeta, tp: int, pp: int, dp: int, zero_stage: int,
                    load_optim: bool) -> list[str]:
    """Why a checkpoint cannot be loaded at the current layout (empty list: it can)."""
    out = []
    if meta.tensor_model_parallel_size != tp or meta.pipeline_model_parallel_size != pp:
        out.append(
            f"the checkpoint was saved with --tensor-model-parallel-size {meta.tensor_model_parallel_size} "
            f"--pipeline-model-parallel-size {meta.pipeline_model_parallel_size}, this run uses {tp} and {pp}; "
            f"resharding is not supported yet: run with the checkpoint's TP/PP")
    elif load_optim and (meta.data_parallel_size != dp or meta.zero_stage != zero_stage) and \
            max(meta.zero_stage, zero_stage) > 0:
        out.append(
            f"the checkpoint's optimizer state is partitioned for ZeRO stage {meta.zero_stage} over "
            f"{meta.data_parallel_size} data-parallel ranks, this run uses stage {zero_stage} over {dp}: "
            f"keep the data-parallel size and --zero-stage, or load weights only with --no-load-optim "
            f"or --finetune")
    return out


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(engine: Any, save_dir: str, iteration: int, meta: CheckpointMeta,
                    rank: int, rng_state: dict[str, Any], keep_last: Optional[int] = None,
                    before_commit: Optional[Callable[[], None]] = None) -> str:
    """Write ``iter_XXXXXXX/`` on every rank, then (rank 0, after a barrier) the pointer."""
    ckpt_dir = os.path.join(save_dir, iteration_dir_name(iteration))
    if read_latest_iteration(save_dir) == iteration:
        return ckpt_dir  # already saved (e.g. interval save followed by the save on exit)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        # a directory of this iteration left by a crashed save is not current: start clean
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.makedirs(ckpt_dir, exist_ok=True)
    _barrier()
    engine.save_checkpoint(save_dir, tag=iteration_dir_name(iteration), save_latest=False)
    rng_path = os.path.join(ckpt_dir, f"rng_rank_{rank:05d}.pt")
    torch.save(rng_state, rng_path + ".tmp")
    os.replace(rng_path + ".tmp", rng_path)
    if rank == 0:
        write_text_atomic(os.path.join(ckpt_dir, METADATA_FILE), json.dumps(meta.__dict__, indent=1,
                                                                            default=str))
    if before_commit is not None:  # test hook: simulate a crash between the files and the pointer
        before_commit()
    _barrier()  # every rank has finished its files
    if rank == 0:
        write_text_atomic(os.path.join(save_dir, TRACKER_FILE), f"{iteration}\n")
        if keep_last:
            prune_checkpoints(save_dir, keep_last, iteration)
    _barrier()
    log_rank0(log, f"saved checkpoint at iteration {iteration} to {ckpt_dir}")
    return ckpt_dir


def load_checkpoint(engine: Any, load_dir: str, *, rank: int, tp: int, pp: int, dp: int, zero_stage: int,
                    load_optim: bool, finetune: bool) -> Optional[tuple[CheckpointMeta, Optional[dict]]]:
    """Load the checkpoint ``latest`` points at; None when ``load_dir`` has none.

    Returns the metadata and this rank's saved RNG state (None if the file is absent)."""
    iteration = read_latest_iteration(load_dir)
    if iteration is None:
        log_rank0(log, f"no {TRACKER_FILE} in {load_dir}: starting from scratch")
        return None
    ckpt_dir = os.path.join(load_dir, iteration_dir_name(iteration))
    meta = CheckpointMeta.read(ckpt_dir)
    weights_only = finetune or not load_optim
    problems = layout_problems(meta, tp, pp, dp, zero_stage, load_optim=not weights_only)
    if problems:
        raise ValueError(f"cannot load {ckpt_dir}: " + "; ".join(problems))
    install_weights_only_loading(engine)
    path, _ = engine.load_checkpoint(load_dir, tag=iteration_dir_name(iteration),
                                     load_optimizer_states=not weights_only,
                                     load_lr_scheduler_states=not weights_only,
                                     load_module_only=weights_only)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no model files in {ckpt_dir} for this rank; the checkpoint "
                                f"is incomplete or was saved with another layout")
    rng_path = os.path.join(ckpt_dir, f"rng_rank_{rank:05d}.pt")
    rng = safe_load(rng_path) if os.path.isfile(rng_path) else None
    log_rank0(log, f"loaded checkpoint {ckpt_dir} (iteration {meta.iteration}, "
                   f"{'weights only' if weights_only else 'full state'})")
    return meta, rng
