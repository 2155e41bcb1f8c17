"""The DeepSpeed engine: ``deepspeed.comm`` over the process group we initialised, ``deepspeed.initialize``,
DeepSpeed's start-up output, and what the training loop reads of the engine's state.

What goes into the engine (the JSON config, the optimizer, the LR schedule, clipping) is decided in
:mod:`megatron_ru.training.engine`.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ru.deepspeed_bridge import compat
from megatron_ru.utils.logging import forward_logger, get_logger, stdout_to_log

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

__all__ = ["attach_comm", "grad_norm_of", "initialize", "loss_scale_of", "quiet"]


def attach_comm() -> None:
    """Let DeepSpeed's ``deepspeed.comm`` use the process group we initialised (our rank discovery,
    no MPI discovery that would rewrite MASTER_ADDR/PORT). Needed before building a PipelineModule."""
    compat.check_version()
    compat.disable_cpu_shm_comm()
    compat.compile_lazily()
    import deepspeed
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                               dist_init_required=False)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DeepSpeed's start-up chatter as debug records of ``megatron_ru.deepspeed``: what it prints while the
    model and the engine are built (``SEED_LAYERS=...``, ``Using topology: ...``, the per-stage layer
    listing of PipelineModule) and, from then on, its logger (warnings kept on rank 0, see
    :func:`forward_logger`). MEGATRON_RU_LOG_LEVEL=DEBUG shows them."""
    with stdout_to_log(get_logger("megatron_ru.deepspeed")):
        import deepspeed  # noqa: F401 - its logger exists from the import on
        forward_logger("DeepSpeed")
        yield


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any], mpu: Any,
               lr_scheduler: Callable[[torch.optim.Optimizer], Any]) -> "DeepSpeedEngine":
    """``deepspeed.initialize`` on the process group already attached (:func:`attach_comm`)."""
    import deepspeed
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                           lr_scheduler=lr_scheduler, dist_init_required=False)
    return engine


def loss_scale_of(engine: Any) -> float:
    """The loss scale of the engine's optimizer (1 when it does not scale)."""
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if isinstance(value, (int, float)) or torch.is_tensor(value):
            return float(value)
    return 1.0


def grad_norm_of(engine: Any) -> Optional[float]:
    """The global gradient norm of the last step (None before the first, or when not computed)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm)
