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

__all__ = ["after_inner_step", "by_name_problem", "engine_common_state", "flat_partitions", "fp32_master_fragment", "has_fp32_master",
           "has_fp32_masters", "optimizer_fragment", "restore_engine_state", "set_fp32_master", "set_optimizer_state"]

#: the Adam moments kept per parameter besides the fp32 master weight
MOMENTS = ("exp_avg", "exp_avg_sq")


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


def by_name_problem(engine: Any) -> Optional[str]:
    """Why this engine's optimizer state cannot be saved by parameter name (None: it can): every parameter's
    fp32 master and moments must be either the torch optimizer's per-parameter state (ZeRO 0, fp32) or linked
    to the parameter as a fragment of a flat partition (ZeRO 1/2, or bf16)."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return None
    if type(opt).__name__.startswith("DeepSpeedZeroOptimizer_Stage3"):
        return "ZeRO stage 3 partitions the weights themselves"
    inner = getattr(opt, "optimizer", None)
    if inner is not None and not has_fp32_masters(engine):  # FP16_Optimizer: flat fp32 groups, no fragments
        return f"{type(opt).__name__} keeps its fp32 masters in flat groups not linked to the parameters"
    return None


def _step_of(state: dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item() if torch.is_tensor(step) else step)


def flat_partitions(engine: Any) -> dict[int, torch.Tensor]:
    """{storage address: flat fp32 partition} of the torch optimizer inside a ZeRO 1/2 or bf16 optimizer
    (empty otherwise): the keys of its state, found from a parameter's fragment by storage."""
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is None:
        return {}
    return {flat.untyped_storage().data_ptr(): flat for g in inner.param_groups for flat in g["params"]}


def optimizer_fragment(engine: Any, p: torch.nn.Parameter, partitions: dict[int, torch.Tensor]
                       ) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
    """(offset in ``p``'s flattened elements, ``{"fp32", "exp_avg", "exp_avg_sq"}`` flat views) of the
    optimizer state this rank holds for ``p``; None when it holds none (another data-parallel rank's ZeRO
    partition, or a frozen parameter). With ZeRO 0 in fp32 the master is the weight itself: no ``fp32``
    key. Moments are zeros before the optimizer's first step. ``partitions``: :func:`flat_partitions`.

    The moments are read from the optimizer's state of the flat partition, not from the fragment links
    DeepSpeed keeps on the parameter: ZeRO 1/2 links them after stepping its first group, so the other
    groups' links are empty."""
    mapping = getattr(p, "_hp_mapping", False)
    if mapping is None:
        return None
    if mapping is not False:
        fp32 = mapping.hp_fragment.data.view(-1)
        flat = partitions.get(fp32.untyped_storage().data_ptr())
        if flat is None:
            raise RuntimeError(f"the fp32 master of a parameter of shape {list(p.shape)} is in none of the "
                               f"optimizer's flat partitions")
        state = engine.optimizer.optimizer.state.get(flat, {})
        where = mapping.hp_fragment_address
        out = {"fp32": fp32}
        for k in MOMENTS:
            out[k] = state[k].view(-1).narrow(0, where.start, where.numel) if k in state else torch.zeros_like(fp32)
        return int(mapping.lp_fragment_address.start), out
    if not p.requires_grad:
        return None
    state = engine.optimizer.state.get(p, {})
    return 0, {k: state[k].view(-1) if k in state else torch.zeros(p.numel(), device=p.device) for k in MOMENTS}


def engine_common_state(engine: Any) -> dict[str, Any]:
    """What all parameters share, in plain numbers: ``step`` (the optimizer's step count), ``lr_scheduler``,
    ``loss_scaler`` (its numeric fields; None without loss scaling), ``global_steps``, ``global_samples``,
    ``skipped_steps``: what :func:`restore_engine_state` sets."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    steps = [_step_of(s) for s in inner.state.values() if isinstance(s, dict) and "step" in s]
    scaler = getattr(opt, "loss_scaler", None)
    sched = engine.lr_scheduler
    return {"step": max(steps) if steps else 0,
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "loss_scaler": None if scaler is None else
            {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))},
            "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps)}


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
