"""A training run's checkpoint by canonical parameter names: every rank writes its own slices.

The layer format of :mod:`megatron_ru.checkpointing.layout`, written from a running DeepSpeed engine:

* weights: pipeline layer ``j``'s TP shard ``t`` in ``layer_{j:02d}-model_{t:02d}-model_states.pt``, written by
  the data-parallel rank 0 of the stage that holds layer ``j`` (a tied output head is the embedding's, written
  once, by the first stage), in the run's dtype, vocabulary rows padded as at this TP size;
* optimizer state: each rank's own fragments (views of its flat partitions, whose storage is written once) in ``optim_states-pp{p:02d}-tp{t:02d}-dp{d:03d}.pt``,
  ``{canonical name: {"offset", "fp32", "exp_avg", "exp_avg_sq"}}`` where ``offset`` is the fragment's first
  element in the flattened TP shard. With ZeRO 1/2 every data-parallel rank writes the part of the fp32
  masters and moments its partition holds; with ZeRO 0 the data-parallel rank 0 writes whole shards (and in
  fp32 no ``fp32`` key: the weight is the master);
* the state all parameters share (step, LR schedule, loss scaler, DeepSpeed's counters) in ``metadata.json``
  (``optimizer``), and ``optimizer_fragments`` = how many data-parallel ranks' files hold the state.

Nothing here is collective; the caller (``training/checkpoint.py``) writes the metadata and the pointer once
every rank reported its files written. Each file goes to a temporary name and is renamed when complete.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from megatron_ru.checkpointing.layout import layer_file, optim_fragment_file
from megatron_ru.deepspeed_bridge.masters import flat_partitions, optimizer_fragment
from megatron_ru.model.spec import ParamSpec, canonical_named_parameters, parameter_specs, stage_bounds
from megatron_ru.utils.memory import own_storage

__all__ = ["write_rank_files"]


def _save(obj: Any, path: str, run: Callable[[str, Callable[[], None]], None]) -> None:
    def write() -> None:
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)
    run(path, write)


def write_rank_files(engine: Any, ckpt_dir: str, cfg: Any, vocab_size: int, *, pp_size: int, pp_rank: int,
                     tp_rank: int, dp_rank: int, zero_stage: int, exclude_frozen: bool,
                     run: Callable[[str, Callable[[], None]], None]) -> None:
    """This rank's files of the checkpoint in ``ckpt_dir``. ``exclude_frozen``: leave out the parameters
    that do not train (a LoRA run whose frozen weights stay in its base checkpoint). ``run(path, write)``
    performs a write (the caller records a failure instead of raising mid-save)."""
    specs: dict[str, ParamSpec] = {s.name: s for s in parameter_specs(cfg, vocab_size)}
    start, stop = stage_bounds(cfg, pp_size)[pp_rank]
    # every layer of the stage has its file (empty when all its tensors stay in a LoRA run's base)
    layers: dict[int, dict[str, torch.Tensor]] = {s.layer_index: {} for s in specs.values()
                                                  if start <= s.layer_index < stop} if dp_rank == 0 else {}
    fragments: dict[str, dict[str, Any]] = {}
    partitions = flat_partitions(engine)
    for name, p in canonical_named_parameters(engine.module, cfg):
        spec = specs[name]
        if not start <= spec.layer_index < stop:
            continue  # a tied output head: the embedding, saved by the stage that holds it
        if dp_rank == 0 and (p.requires_grad or not exclude_frozen):
            layers.setdefault(spec.layer_index, {})[spec.local_name] = p
        if zero_stage == 0 and dp_rank != 0:
            continue  # every data-parallel rank holds the same state: rank 0 writes it
        frag = optimizer_fragment(engine, p, partitions)
        if frag is not None:
            offset, state = frag
            fragments[name] = {"offset": offset, **state}
    for index in sorted(layers):  # one layer's copies in memory at a time
        # a parameter inside DeepSpeed's flat buffer is a view: copied, or torch.save writes the whole buffer
        _save({k: own_storage(v.detach().to("cpu")) for k, v in layers[index].items()}, os.path.join(ckpt_dir, layer_file(index, tp_rank)),
              run)
    if zero_stage > 0 or dp_rank == 0:
        # the fragments are views of the optimizer's flat partitions: torch.save writes each partition's storage
        # once (no copy), and a memory-mapped read touches only the fragments a reader asks for
        _save(fragments, os.path.join(ckpt_dir, optim_fragment_file(pp_rank, tp_rank, dp_rank)), run)
