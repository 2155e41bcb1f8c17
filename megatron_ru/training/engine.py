"""What goes into the DeepSpeed engine: its JSON config from the flags (:mod:`megatron_ru.flags.deepspeed`), the optimizer, the LR schedule and
TP/PP-aware clipping; :func:`initialize_engine` hands them to :mod:`megatron_ru.deepspeed_bridge`.

* PP = 1: a plain module, ``deepspeed.initialize(..., mpu=ParallelState)``; ZeRO 0-3.
* PP > 1: a ``PipelineModule`` whose topology is :func:`megatron_ru.deepspeed_bridge.pipeline.topology` (same
  rank order as our groups: TP fastest, then DP, then PP); ZeRO 0-1. DeepSpeed then uses the module's grid
  as its mpu (it refuses an explicit one with a pipeline).
* Gradient clipping counts every gradient element once across the model: TP-sharded parameters
  (``tensor_model_parallel``) on every TP rank, replicated ones (norms, biases of row-parallel
  layers) on TP rank 0 only, pipeline-tied copies (``ds_pipe_replicated``) once. DeepSpeed's ZeRO
  and bf16 optimizers already filter this way; its fp32 no-ZeRO path filters replicated parameters
  by the *model*-parallel rank (TP × PP), which drops them on every stage but the first when PP > 1,
  so that one path uses :func:`clip_grad_norm_tp_aware` instead (installed through
  :mod:`megatron_ru.deepspeed_bridge.compat`, where every patch of DeepSpeed's internals lives).
* We use torch's AdamW (no JIT build) and skip DeepSpeed's shared-memory CPU collective kernel,
  whose first use JIT-compiles for ~50 s: gloo does the same work.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

from megatron_ru.flags.deepspeed import build_ds_config
from megatron_ru.deepspeed_bridge import compat as dsc
from megatron_ru.deepspeed_bridge.engine import attach_comm, initialize
from megatron_ru.deepspeed_bridge.pipeline import is_pipeline_module
from megatron_ru.utils.logging import get_logger, log_rank0
from megatron_ru.utils.optim import weight_decay_groups

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments
    from megatron_ru.deepspeed_bridge.engine import DeepSpeedEngine
    from megatron_ru.parallel.state import ParallelState
    from megatron_ru.config.lr_schedule import LRSchedule

__all__ = ["NumZerosInGrad", "build_optimizer", "clip_grad_norm_tp_aware", "initialize_engine", "params_norm_tp_aware",
           "optimizer_param_groups"]

log = get_logger(__name__)


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float,
                           decoupled: Iterable[torch.nn.Parameter] = ()) -> list[dict[str, Any]]:
    """Megatron's grouping: no weight decay on biases and norm weights (1-D tensors), nor on a frozen
    stage's placeholder (:func:`megatron_ru.training.freeze.keep_optimizer_busy`). The ``decoupled``
    parameters (--decoupled-lr: the input word embedding and the output layer) come last, in groups of their
    own marked :data:`~megatron_ru.training.lr.DECOUPLED` for the learning-rate scheduler."""
    from megatron_ru.training.freeze import ANCHOR_ATTR
    from megatron_ru.training.lr import DECOUPLED
    apart = {id(p) for p in decoupled}
    trained = [p for _, p in model.named_parameters() if p.requires_grad]
    out: list[dict[str, Any]] = []
    for own_lr in (False, True):
        groups = weight_decay_groups([p for p in trained if (id(p) in apart) == own_lr],
                                     lambda p: p.ndim >= 2 and not getattr(p, ANCHOR_ATTR, False))
        out += [{"params": g, "weight_decay": weight_decay if decay else 0.0, **({DECOUPLED: True} if own_lr else {})}
                for decay, g in groups]
    return out


def decoupled_parameters(model: torch.nn.Module, model_cfg: Any) -> list[torch.nn.Parameter]:
    """The parameters --decoupled-lr applies to, as Megatron-LM marks them: the input word embedding and the
    output layer's weight (not a learned position table), on this rank's stage."""
    from megatron_ru.model.spec import VOCAB_WEIGHTS, canonical_named_parameters
    return [p for name, p in canonical_named_parameters(model, model_cfg) if name in VOCAB_WEIGHTS]


def build_optimizer(model: torch.nn.Module, opt_cfg: Any, model_cfg: Any = None) -> torch.optim.Optimizer:
    """The torch optimizer over the trainable parameters (``model_cfg``: the model's description, needed to find
    the embedding and output layer under --decoupled-lr)."""
    decoupled: list[torch.nn.Parameter] = []
    if getattr(opt_cfg, "decoupled_lr", None) is not None:
        if model_cfg is None:
            raise ValueError("internal: --decoupled-lr needs the model's description to find its embedding")
        decoupled = decoupled_parameters(model, model_cfg)
    groups = optimizer_param_groups(model, opt_cfg.weight_decay, decoupled)
    if not groups:
        raise ValueError("no trainable parameters on this rank: the model has none")
    if opt_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=opt_cfg.sgd_momentum)
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                             eps=opt_cfg.adam_eps, **adam_kernel(opt_cfg.adam_implementation, groups))


def adam_kernel(implementation: str, groups: list[dict[str, Any]]) -> dict[str, bool]:
    """torch AdamW's kernel choice for ``--adam-implementation``. Each updates every element on its own: the
    for-loop and foreach results do not depend on how the tensors are sharded or flattened (layout invariance);
    the fused CPU kernel's do only where every shard is a whole number of SIMD vectors (a tensor's last partial
    vector takes a scalar path that can round differently).
    ``auto``: fused on CUDA (one kernel for all tensors: a single pass over weights, gradients and moments,
    where the for-loop makes about seven), the for-loop on CPU (the reference the exactness tests hold)."""
    if implementation == "auto":
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        implementation = "fused" if on_cuda else "for-loop"
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}


def _counts_here(p: torch.nn.Parameter, tp_rank: int) -> bool:
    if getattr(p, "ds_pipe_replicated", False):
        return False
    return tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def grad_norm_tp_aware(params: Iterable[torch.nn.Parameter], tp_rank: int, mp_group: Any) -> torch.Tensor:
    """Global L2 norm of the gradients of one model replica spread over the TP × PP group."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    # Per-tensor norms in fp32 (as torch's clip_grad_norm_; no float64 copy of every gradient), in one
    # multi-tensor call (each norm as torch.linalg.vector_norm's), combined in float64 so summing many
    # tensors and ranks loses nothing.
    grads = [p.grad.detach() for p in params if _counts_here(p, tp_rank)]
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if grads else []
    sq = (torch.stack(norms).double().pow(2).sum() if norms
          else torch.zeros((), dtype=torch.float64, device=device))
    if dist.is_initialized() and mp_group is not None and dist.get_world_size(mp_group) > 1:
        dist.all_reduce(sq, group=mp_group)
    return sq.sqrt().float()


def params_norm_tp_aware(params: Iterable[torch.nn.Parameter], tp_rank: int, mp_group: Any) -> float:
    """L2 norm of all the weights of one model replica spread over the TP × PP group (--log-params-norm),
    each element counted once as :func:`grad_norm_tp_aware` counts gradients (TP-replicated parameters on TP
    rank 0, pipeline-tied copies once); the model's own parameters (bf16 under --bf16), summed in float64.
    Every rank of the model-parallel group must call it. Not for ZeRO 3 (partitioned weights; validation
    refuses the pair)."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    norms = [torch.linalg.vector_norm(p.detach(), 2, dtype=torch.float32) for p in params if _counts_here(p, tp_rank)]
    sq = (torch.stack(norms).double().pow(2).sum() if norms
          else torch.zeros((), dtype=torch.float64, device=device))
    if dist.is_initialized() and mp_group is not None and dist.get_world_size(mp_group) > 1:
        dist.all_reduce(sq, group=mp_group)
    return float(sq.sqrt())


class NumZerosInGrad:
    """--log-num-zeros-in-grad: the number of zero elements in the gradient of the last optimizer step
    (Megatron-LM's 'num-zeros': unscaled, clipped, counted before the step), each element once across the
    whole run: :func:`_counts_here`'s rule within a model replica (as the grad norm), summed over the
    model-parallel group and, where ZeRO 1/2 partition the gradient, over the data-parallel group. The count
    is taken on every step (installed on the engine's optimizer, :func:`install_grad_zero_count`); reading
    it is one all-reduce, which every rank must call."""

    def __init__(self, engine: Any, state: "ParallelState") -> None:
        tp_rank = state.tp_rank
        self._counter = dsc.install_grad_zero_count(engine, lambda p: _counts_here(p, tp_rank))
        self._groups = [state.mp_group] + ([state.dp_group] if self._counter.partitioned else [])
        self._device = state.device

    def value(self) -> Any:
        """The count of the engine's last step (an int), or None when that step was skipped."""
        local = self._counter.last()
        if local is None:
            return None
        total = torch.as_tensor(local, dtype=torch.int64, device=self._device)
        for group in self._groups:
            if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return int(total)


def clip_grad_norm_tp_aware(params: Iterable[torch.nn.Parameter], max_norm: float, tp_rank: int,
                            mp_group: Any) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    norm = grad_norm_tp_aware(params, tp_rank, mp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad.detach() for p in params]
        for dtype in {g.dtype for g in grads}:  # one multi-tensor multiply per dtype (each element as mul_)
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(grads[0].device, dtype))
    return norm


def initialize_engine(model: torch.nn.Module, state: "ParallelState", args: "Arguments",
                      schedule: "LRSchedule") -> "DeepSpeedEngine":
    """``deepspeed.initialize`` for a module (PP=1) or a ``PipelineModule`` (PP>1)."""
    attach_comm()
    from megatron_ru.training.lr import MegatronLRScheduler

    is_pipe = is_pipeline_module(model)
    if (state.pp_size > 1) != is_pipe:
        raise ValueError(f"internal: PP={state.pp_size} needs {'a' if state.pp_size > 1 else 'no'} PipelineModule")
    optimizer = build_optimizer(model, args.optimizer, args.model)
    ds_config = build_ds_config(args)
    engine = initialize(model, optimizer, ds_config, mpu=None if is_pipe else state,
                        lr_scheduler=lambda opt: MegatronLRScheduler(opt, schedule))
    dsc.skip_single_replica_allreduce(engine, state.dp_size)
    dsc.install_batched_bf16_step(engine)
    if not (args.training.bf16 or args.training.fp16) and args.training.zero_stage == 0:
        tp_rank, mp_group, max_norm = state.tp_rank, state.mp_group, engine.gradient_clipping()
        dsc.install_fp32_clipping(
            engine, lambda params: clip_grad_norm_tp_aware(params, max_norm, tp_rank, mp_group))
    log_rank0(log, f"DeepSpeed engine: {type(engine).__name__}, optimizer {type(engine.optimizer).__name__}, "
                   f"ZeRO {args.training.zero_stage}, {args.precision}, micro batch {args.training.micro_batch_size}"
                   f" x grad accum {args.grad_accum} x DP {args.dp} = global batch {args.global_batch_size}")
    return engine
