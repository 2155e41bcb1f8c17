"""The state DeepSpeed keeps beside the model: each parameter's fp32 master weight and optimizer state
(linked to the parameter as ``_hp_mapping`` by the ZeRO 1/2 and bf16 optimizers), the optimizer inside
DeepSpeed's wrapper, the engine's step counters and its loss scaler.

Used to load optimizer state by parameter name (:mod:`megatron_ru.checkpointing.loader`), to keep
embedding rows out of training (:mod:`megatron_ru.training.embedding_rows`) and to start DoRA magnitudes
from loaded weights.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["after_inner_step", "fp32_master_fragment", "has_fp32_master", "has_fp32_masters",
           "restore_engine_state", "set_fp32_master", "set_optimizer_state"]


def has_fp32_master(p: torch.nn.Parameter) -> bool:
    """True when DeepSpeed keeps ``p``'s fp32 master in a flat partition linked to it (ZeRO 1/2, bf16)."""
    return hasattr(p, "_hp_mapping")


def has_fp32_masters(engine: Any) -> bool:
    """True when DeepSpeed keeps fp32 master partitions linked to the parameters (ZeRO 1/2, bf16)."""
    return any(has_fp32_master(p) for p in engine.module.parameters())


def set_fp32_master(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``p``'s fp32 master weight (this rank's fragment of it) from the full TP shard ``value``."""
    from deepspeed.utils import safe_set_full_fp32_param
    safe_set_full_fp32_param(p, value)


def set_optimizer_state(p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Set the optimizer state ``key`` (``exp_avg``, ``exp_avg_sq``) of ``p`` from the full TP shard ``value``."""
    from deepspeed.utils import safe_set_full_optimizer_state
    safe_set_full_optimizer_state(p, value, key)


def fp32_master_fragment(p: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], int]:
    """(flat fp32 tensor the optimizer updates for ``p`` on this rank, its offset in ``p``'s elements): this
    rank's fragment of the fp32 master partition (bf16, ZeRO 1/2), else the parameter itself (fp32, no ZeRO)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:
        return mapping.hp_fragment.data.view(-1), int(mapping.lp_fragment_address.start)
    return p.data.view(-1), 0


def after_inner_step(engine: Any, fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every step of the torch optimizer inside the engine's optimizer: after the fp32
    masters are updated, before DeepSpeed copies them into the model's weights."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        fn()
        return out

    optimizer.step = step  # type: ignore[method-assign]


def restore_engine_state(engine: Any, common: dict[str, Any], iteration: int, consumed_samples: int) -> None:
    """The LR scheduler, the loss scaler (a dynamic fp16 scale carries over to a dynamic one; a static
    scale belongs to the run's own configuration) and DeepSpeed's step counters from ``common`` (a
    checkpoint's shared optimizer state; counters missing there come from ``iteration`` and
    ``consumed_samples``)."""
    sched = common.get("lr_scheduler")
    if sched is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sched)
    scaler: Optional[dict[str, Any]] = common.get("loss_scaler")
    target = getattr(engine.optimizer, "loss_scaler", None)
    if scaler and scaler.get("dynamic") and target is not None and getattr(target, "dynamic", False):
        for k, v in scaler.items():
            if hasattr(target, k):
                setattr(target, k, v)
    engine.global_steps = int(common.get("global_steps", iteration))
    engine.global_samples = int(common.get("global_samples", consumed_samples))
    engine.skipped_steps = int(common.get("skipped_steps", 0))
