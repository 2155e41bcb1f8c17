"""Write canonical full tensors as a megatron_ru checkpoint at any (TP, PP), one layer at a time.

The output is the layer format of :mod:`megatron_ru.checkpointing.layout` (the one training writes, with
each TP shard's optimizer state whole in per-layer files): ``pretrain_gpt.py --load`` reads it at any TP,
PP and DP size and ZeRO stage 0-2, weights and — when given — optimizer state. Everything is written into ``<save>.tmp-<pid>`` and renamed to ``<save>`` only when complete; an
existing ``<save>`` is refused unless ``force`` (then replaced only after the new one is complete).
Any failure removes the temporary directory: nothing half-written remains.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Optional, Protocol

import torch

from megatron_ru.checkpointing.files import CheckpointSaveError, describe_write_failure
from megatron_ru.checkpointing.layout import LAYERS_FORMAT, OPTIM_KEYS, layer_file, layer_optim_file
from megatron_ru.config.model import ModelConfig, model_parallel_problems
from megatron_ru.model.spec import ParamSpec, layer_parameter_specs, model_args_dict, model_description
from megatron_ru.model.shards import layout_shard, padded_vocab_rows
from megatron_ru.utils.logging import get_logger
from megatron_ru.utils.memory import own_storage

log = get_logger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"


class OptimizerSource(Protocol):
    """What the writer needs to carry optimizer state: full canonical tensors per parameter and the
    state shared by all parameters (step, LR scheduler, loss scaler)."""

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]: ...

    def common_state(self) -> dict[str, Any]: ...


def _check_tensor(spec: ParamSpec, tensor: Any, what: str) -> torch.Tensor:
    if not torch.is_tensor(tensor):
        raise ValueError(f"{what} {spec.name!r}: expected a tensor of shape {list(spec.shape)}, got "
                         f"{type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(spec.shape):
        raise ValueError(f"{what} {spec.name!r} has shape {list(tensor.shape)}, expected {list(spec.shape)} "
                         f"(the model arguments' full canonical shape)")
    if not tensor.is_floating_point():
        raise ValueError(f"{what} {spec.name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
    return tensor


def tp_shards(spec: ParamSpec, full: torch.Tensor, tp: int, rows: int) -> list[torch.Tensor]:
    """The TP shards of one canonical tensor; vocabulary matrices padded with zero rows to ``rows``."""
    if spec.partition_dim is None or tp == 1:
        return [layout_shard(spec, full, rows, tp, 0).contiguous()] * tp
    if spec.vocab and rows > full.shape[0]:  # pad once, not once per rank
        full = layout_shard(spec, full, rows, 1, 0)
    return [layout_shard(spec, full, rows, tp, t) for t in range(tp)]


def _save(obj: Any, path: str, files: dict[str, int]) -> None:
    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as e:  # a full disk: ENOSPC, or torch's zip writer noticing a short write
        raise CheckpointSaveError(f"{describe_write_failure(path, e)}: nothing was written under the output name; "
                                  f"free space or write elsewhere") from None
    files[os.path.basename(path)] = os.path.getsize(path)


def _prepare_output(save_dir: str, force: bool) -> str:
    save_dir = os.path.abspath(save_dir)
    if os.path.exists(save_dir) and not force:
        raise FileExistsError(f"--save {save_dir} already exists: choose a new directory, or pass --force to "
                              f"replace it (it is replaced only once the new checkpoint is complete)")
    parent = os.path.dirname(save_dir)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--save {save_dir}: the parent directory {parent} does not exist; create it first")
    from megatron_ru.utils.staging import remove_stale_temporaries, temporary_name
    remove_stale_temporaries(save_dir)
    tmp = temporary_name(save_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _commit(tmp: str, save_dir: str) -> None:
    """Rename the complete temporary directory to ``save_dir`` (an existing one, with --force, is moved
    aside first and removed after)."""
    save_dir = os.path.abspath(save_dir)
    old = None
    if os.path.exists(save_dir):
        old = f"{save_dir}.old-{os.getpid()}"
        os.replace(save_dir, old)
    os.replace(tmp, save_dir)
    if old is not None:
        if os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def write_checkpoint(save_dir: str, *, cfg: ModelConfig, vocab_size: int, tp: int, pp: int,
                     get_tensor: Callable[[str], torch.Tensor], iteration: int = 0,
                     dtype: Optional[torch.dtype] = None, optimizer: Optional[OptimizerSource] = None,
                     extra_meta: Optional[dict[str, Any]] = None, force: bool = False,
                     extra_files: Optional[Callable[[str], None]] = None) -> str:
    """Write ``save_dir/iter_{iteration:07d}/`` (layer format) and the ``latest`` pointer; return the
    iteration directory. ``get_tensor(name)`` returns the full canonical tensor (V vocabulary rows) and
    is called once per name, one layer at a time. ``dtype``: the weights' dtype in the files (default:
    as given); optimizer tensors are always fp32. ``extra_meta``: more ``metadata.json`` fields
    (consumed_train_samples, args, tokenizer, ...). ``extra_files(tmp_dir)`` may add files (tokenizer)
    before the rename. Raises ValueError naming the tensor on a wrong shape; nothing is left behind."""
    problems = model_parallel_problems(cfg, tp, pp, "--target-tensor-parallel-size",
                                       "--target-pipeline-parallel-size")
    import dataclasses

    from megatron_ru.checkpointing.meta import CheckpointMeta
    unknown = sorted(set(extra_meta or {}) - {f.name for f in dataclasses.fields(CheckpointMeta)})
    if unknown:  # CheckpointMeta.read would refuse the file later
        problems.append(f"extra_meta has fields metadata.json does not hold: {', '.join(unknown)}")
    if problems:
        raise ValueError("cannot write the checkpoint: " + "; ".join(problems))
    tmp = _prepare_output(save_dir, force)
    try:
        # created inside the try: a signal between its creation and the try would leave it behind
        os.makedirs(tmp)
        ckpt = os.path.join(tmp, f"iter_{iteration:07d}")
        os.makedirs(ckpt)
        files: dict[str, int] = {}
        rows = padded_vocab_rows(cfg, vocab_size, tp)
        for desc in model_description(cfg):
            specs = layer_parameter_specs(desc, cfg, vocab_size)
            if specs:  # (a tied output head has nothing of its own)
                _write_layer(ckpt, desc.index, specs, tp, rows, get_tensor, dtype, optimizer, files)
        meta: dict[str, Any] = dict(iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0,
                                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                    data_parallel_size=1, zero_stage=0, args={})
        meta.update(extra_meta or {})
        meta.update(format=LAYERS_FORMAT, model_args=model_args_dict(cfg), vocab_size=vocab_size,
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, iteration=iteration,
                    files=dict(sorted(files.items())),
                    optimizer=None if optimizer is None else jsonable(optimizer.common_state()))
        with open(os.path.join(ckpt, METADATA_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
        with open(os.path.join(tmp, TRACKER_FILE), "w", encoding="utf-8") as f:
            f.write(f"{iteration}\n")
        if extra_files is not None:
            extra_files(tmp)
        _commit(tmp, save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    out = os.path.join(os.path.abspath(save_dir), f"iter_{iteration:07d}")
    log.info(f"wrote {out} (TP {tp}, PP {pp}{', with optimizer state' if optimizer is not None else ''})")
    return out


def _write_layer(ckpt: str, index: int, specs: list[ParamSpec], tp: int, rows: int,
                 get_tensor: Callable[[str], torch.Tensor], dtype: Optional[torch.dtype],
                 optimizer: Optional[OptimizerSource], files: dict[str, int]) -> None:
    """Pipeline layer ``index``: its model files (one per TP rank), then its optimizer files; only this
    layer's tensors are held, and the weights are dropped before the optimizer state is fetched."""
    weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for spec in specs:
        full = _check_tensor(spec, get_tensor(spec.name), "tensor").detach()
        if dtype is not None:
            full = full.to(dtype)
        for t, shard in enumerate(tp_shards(spec, full, tp, rows)):
            weights[t][spec.local_name] = own_storage(shard)
        del full
    for t in range(tp):
        _save(weights[t], os.path.join(ckpt, layer_file(index, t)), files)
        weights[t] = {}
    if optimizer is None:
        return
    states: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(tp)]
    for spec in specs:
        state = dict(optimizer.optimizer_state(spec.name))
        for key in OPTIM_KEYS:
            if key not in state:
                raise ValueError(f"optimizer state of {spec.name!r} has no {key!r} (found {sorted(state)})")
            value = _check_tensor(spec, state.pop(key), f"optimizer state {key!r} of").detach().float()
            for t, shard in enumerate(tp_shards(spec, value, tp, rows)):
                states[t].setdefault(spec.local_name, {})[key] = own_storage(shard)
            del value
        del state
    for t in range(tp):
        _save(states[t], os.path.join(ckpt, layer_optim_file(index, t)), files)
        states[t] = {}


def jsonable(obj: Any) -> Any:
    """Tensors (a step count, a scale) as numbers, so the common state lives in metadata.json."""
    if torch.is_tensor(obj):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
