"""Load a checkpoint into a running DeepSpeed engine by canonical parameter names, at any layout.

Sources, read through the offline :class:`~megatron_ru.checkpointing.reader.CheckpointReader` (memory-mapped,
one layer's files at a time): the layer format (written by training, ``reshard`` and ``import-hf``) at any
TP/PP/DP and ZeRO stage 0-2, and DeepSpeed's files saved at another TP/PP, DP size or ZeRO stage. Each rank
takes its TP shards from the saved shards they overlap. With optimizer state:

* ZeRO 1/2 and bf16 (DeepSpeed keeps fp32 master partitions): the torch optimizer's state of each flat
  partition is created, linked to the parameters, and every parameter's fp32 master weight and Adam moments
  are set through DeepSpeed's ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (each DP rank
  keeps its own slice: any DP size works);
* ZeRO 0, fp32: the torch optimizer's state per parameter.

Then the step count, the LR scheduler, the loss scaler and DeepSpeed's step counters. Without optimizer
state (--finetune / --no-load-optim) the fp32 master weights are set from the loaded weights. RNG states are
the caller's (training/checkpoint.py: restored at the saved layout only).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.layout import OPTIM_KEYS, specs_by_name
from megatron_ru.checkpointing.reader import CheckpointReader
from megatron_ru.config.lora import is_adapter_parameter
from megatron_ru.deepspeed_bridge.compat import create_flat_optimizer_state
from megatron_ru.deepspeed_bridge.masters import (has_fp32_masters, restore_engine_state, set_fp32_master,
                                                  set_optimizer_state)
from megatron_ru.model.spec import canonical_named_parameters, model_config_from_dict
from megatron_ru.utils.logging import get_logger, log_rank0
from megatron_ru.utils.memory import release_freed_memory
from megatron_ru.utils.optim import adam_step_tensor

log = get_logger(__name__)


def _shape_error(path: str, key: str, got: Any, want: Any) -> CheckpointError:
    return CheckpointError(f"{path}: {key!r} has shape {list(got)}, this run's parameter has {list(want)}: the "
                           f"checkpoint was written for another model; check the model flags (or use "
                           f"--use-checkpoint-args)")


class _ResliceSource:
    """This rank's shards of a checkpoint (either format, any saved layout), through the offline reader
    (memory-mapped, one layer's files at a time): each from the parts of the saved shards it overlaps."""

    def __init__(self, reader: Any, tp: int, tp_rank: int) -> None:
        self.reader, self.tp, self.tp_rank = reader, tp, tp_rank

    def weight(self, spec: Any) -> tuple[Any, str]:
        part = self.reader.shard_at(spec.name, self.tp, self.tp_rank)
        return part, self.reader.weight_file(spec.name, self.tp_rank if self.tp == self.reader.tp else None)

    def optim(self, spec: Any) -> tuple[dict[str, torch.Tensor], str]:
        return self.reader.optimizer_shard_at(spec.name, self.tp, self.tp_rank), self.reader.dir


def load_by_names(engine: Any, ckpt_dir: str, meta: Any, *, rank: int, tp: int, pp: int, load_optim: bool) -> None:
    """Weights (and, with ``load_optim``, optimizer state, step and schedule) of a checkpoint saved at any layout,
    in either format: read by canonical names and laid out for this run's TP/PP/DP and ZeRO stage."""
    reader = CheckpointReader(ckpt_dir, meta)
    if load_optim:
        problem = reader.optimizer_problem()
        if problem:
            raise CheckpointError(f"cannot load the optimizer state of {ckpt_dir} by canonical names: {problem}")
    common = reader.common_state() if load_optim else {}
    _load_by_name(engine, _ResliceSource(reader, tp, rank % tp), meta, common, load_optim)
    log_rank0(log, f"loaded {ckpt_dir} (saved at TP {meta.tensor_model_parallel_size} x PP "
                   f"{meta.pipeline_model_parallel_size}) at TP {tp} x PP {pp} by canonical names "
                   f"({'weights and optimizer state' if load_optim else 'weights only'})")


def _load_by_name(engine: Any, source: Any, meta: Any, common: dict[str, Any], load_optim: bool) -> None:
    cfg = model_config_from_dict(meta.model_args)
    specs = specs_by_name(cfg, int(meta.vocab_size))
    params = list(canonical_named_parameters(engine.module, cfg))
    hp = has_fp32_masters(engine)
    step = int(common.get("step", 0))
    if cfg.lora is None:  # a base checkpoint under a run with adapters: the adapters start fresh
        params = [(n, p) for n, p in params if not is_adapter_parameter(n)]
    if meta.lora_base is not None:  # the frozen weights were loaded from the base checkpoint already
        params = [(n, p) for n, p in params if p.requires_grad]
    with torch.no_grad():
        for name, p in params:  # weights
            spec = specs.get(name)
            if spec is None:
                raise CheckpointError(f"this run's parameter {name} is not in the checkpoint's model (model_args "
                                      f"in metadata.json): check the model flags")
            shard, where = source.weight(spec)
            if tuple(shard.shape) != tuple(p.shape):
                raise _shape_error(where, spec.local_name, shard.shape, p.shape)
            p.data.copy_(shard)
            if hp and not load_optim and p.requires_grad:
                # the fp32 masters were made from the initial weights: set them from the file's values
                # (not from the possibly bf16-rounded parameter)
                set_fp32_master(p, shard.to(p.device, torch.float32))
        if not load_optim:
            return
        opt = engine.optimizer
        if hp:
            create_flat_optimizer_state(opt, step)
        layer = None
        for name, p in params:
            if not p.requires_grad:
                continue
            spec = specs[name]
            if spec.layer_index != layer:  # the previous layer's temporaries leave the resident set
                layer = spec.layer_index
                release_freed_memory()
            state, where = source.optim(spec)
            for k in OPTIM_KEYS:
                if tuple(state[k].shape) != tuple(p.shape):
                    raise _shape_error(where, f"{spec.local_name}.{k}", state[k].shape, p.shape)
            if hp:
                set_fp32_master(p, state["fp32"].to(p.device, torch.float32))
                for k in ("exp_avg", "exp_avg_sq"):
                    set_optimizer_state(p, state[k].to(p.device, torch.float32), k)
            else:
                p.data.copy_(state["fp32"])
                opt.state[p] = {"step": adam_step_tensor(step, p, opt.param_groups[0]),
                                "exp_avg": state["exp_avg"].to(p.device, torch.float32).clone(),
                                "exp_avg_sq": state["exp_avg_sq"].to(p.device, torch.float32).clone()}
        restore_engine_state(engine, common, meta.iteration, meta.consumed_train_samples)


def layers_layout_problem(meta: Any, zero_stage: int) -> Optional[str]:
    if zero_stage > 2:
        return (f"--zero-stage {zero_stage}: a checkpoint written by megatron_ru's checkpoint writer (reshard, "
                f"import-hf) loads with ZeRO stage 0, 1 or 2 (stage 3 partitions the parameters themselves); train "
                f"with --zero-stage 2 or lower")
    if meta.model_args is None or meta.vocab_size is None:
        return "its metadata.json has no model_args/vocab_size: it is damaged; write it again"
    return None
