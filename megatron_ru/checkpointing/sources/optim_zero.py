"""DeepSpeed's optimizer state, as the fp32 master and Adam moments of each saved TP shard:

* :class:`Zero0Optim` (ZeRO 0, fp32): torch AdamW's state inside the ``mp_rank`` files, matched to parameters by
  the ordered canonical names of each optimizer group that the save recorded in ``metadata.json``
  (``optimizer_groups``; for PP = 1 checkpoints saved before that, rebuilt from the module's order);
* :class:`Zero1Optim` (ZeRO 1: fp32, bf16, fp16): the flat fp32 partitions of
  ``[bf16_]zero_pp_rank_{d}_mp_rank_{m}`` concatenated over the data-parallel ranks ``d`` and walked with the
  ``param_shapes`` of the model file, like DeepSpeed's ``zero_to_fp32`` (each partition's alignment padding cut
  first).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.layout import OPTIM_KEYS, mp_model_file, mp_rank_of, stage_of
from megatron_ru.checkpointing.sources.common import CheckpointDir, OptimShard, OptimSource, WeightShard
from megatron_ru.model.spec import ParamSpec, canonical_name, stage_bounds
from megatron_ru.utils.optim import weight_decay_groups


class _DeepSpeedOptim(OptimSource):
    """What ZeRO 0 and 1 share: the model-parallel rank of a shard, the step, LR scheduler and loss scaler."""

    def mp_of(self, spec: ParamSpec, t: int) -> int:
        files = self.files
        if files.pp == 1:
            return t
        stage = stage_of(spec.layer_index, stage_bounds(files.cfg, files.pp))
        recorded = files.meta.optimizer_groups or {}
        for key, rec in recorded.items():
            if rec.get("pp_rank") == stage and rec.get("tp_rank") == t:
                return int(key)
        return mp_rank_of(stage, t, files.tp)

    def _optimizer_state(self, out: dict[str, Any], head: dict[str, Any]) -> Any:
        """torch's per-parameter optimizer state (``step`` in it) of model-parallel rank 0 (``head``: its model
        file); the loss scaler into ``out``."""
        raise NotImplementedError

    def common_state(self) -> dict[str, Any]:
        head = self.files.mp_file(0)
        meta = self.files.meta
        out: dict[str, Any] = {"lr_scheduler": head.get("lr_scheduler"),
                               "skipped_steps": int(head.get("skipped_steps") or 0),
                               "global_steps": int(head.get("global_steps") or meta.iteration),
                               "global_samples": int(head.get("global_samples") or meta.consumed_train_samples),
                               "loss_scaler": None}
        state = self._optimizer_state(out, head)
        steps = [s["step"] for s in (state.values() if isinstance(state, dict) else state)
                 if isinstance(s, dict) and "step" in s]
        out["step"] = int(float(steps[0])) if steps else 0
        return out


class Zero0Optim(_DeepSpeedOptim):
    """ZeRO 0 in fp32: torch's optimizer state in the ``mp_rank`` model files (the weight is the master)."""

    def __init__(self, files: CheckpointDir, weight_shard: WeightShard) -> None:
        super().__init__(files, weight_shard)
        self._index: dict[int, dict[str, int]] = {}

    def _group_names(self, mp: int) -> list[list[str]]:
        """Ordered canonical names of each optimizer group of model-parallel rank ``mp``."""
        files = self.files
        rec = (files.meta.optimizer_groups or {}).get(str(mp))
        if rec is not None:
            return [list(g) for g in rec["groups"]]
        if files.pp > 1:
            raise CheckpointError(f"{files.dir}: the save did not record the order of the optimizer's parameters "
                                  f"(saved by an older megatron_ru); convert the weights only (--no-load-optim), "
                                  f"or resume once at the checkpoint's layout and save again")
        module = files.mp_file(mp).get("module") or {}
        names = [k for k in module if k in files.specs]
        return [g for _, g in weight_decay_groups(names, lambda n: module[n].ndim >= 2)]  # the engine's groups

    def _state_index(self, mp: int, optim: dict[str, Any], where: str) -> dict[str, int]:
        """{canonical name: index in torch's optimizer state} of model-parallel rank ``mp``."""
        if mp in self._index:
            return self._index[mp]
        groups = self._group_names(mp)
        path = os.path.join(self.files.dir, where)
        if len(groups) != len(optim["param_groups"]):
            raise CheckpointError(f"{path}: the optimizer has {len(optim['param_groups'])} parameter groups, "
                                  f"metadata.json records {len(groups)}: the checkpoint is damaged")
        index: dict[str, int] = {}
        for g, (names, group) in enumerate(zip(groups, optim["param_groups"])):
            if len(names) != len(group["params"]):
                raise CheckpointError(f"{path}: optimizer group {g} has {len(group['params'])} parameters, the "
                                      f"recorded order {len(names)}")
            for n, idx in zip(names, group["params"]):
                index[canonical_name(n, self.files.cfg)] = idx
        self._index[mp] = index
        return index

    def shard(self, spec: ParamSpec, t: int) -> OptimShard:
        files, mp = self.files, self.mp_of(spec, t)
        files.map_layer(spec.layer_index)
        where = mp_model_file(mp)
        optim = files.mp_file(mp).get("optimizer")
        if not isinstance(optim, dict) or "state" not in optim:
            raise CheckpointError(f"{os.path.join(files.dir, where)} holds no optimizer state (ZeRO stage 0): the "
                                  f"file is damaged; convert the weights only with --no-load-optim")
        index = self._state_index(mp, optim, where).get(spec.name)
        if index is None or index not in optim["state"]:
            return self.untrained(spec, t)
        state = optim["state"][index]
        out = {"fp32": self.weight_shard(spec, t).float()}
        for k in ("exp_avg", "exp_avg_sq"):
            out[k] = files.checked(spec, state.get(k), where, f"optimizer state {index}.{k}")
        return out

    def _optimizer_state(self, out: dict[str, Any], head: dict[str, Any]) -> Any:
        return (head.get("optimizer") or {}).get("state") or {}


class Zero1Optim(_DeepSpeedOptim):
    """ZeRO 1: the flat fp32 partitions and moments of each optimizer group, one file per data-parallel rank."""

    def __init__(self, files: CheckpointDir, weight_shard: WeightShard) -> None:
        super().__init__(files, weight_shard)
        self._flat = files.layer_cache()  # {mp: flat index}, memory-mapped partitions: dropped on each new layer

    def _optim_files(self, mp: int) -> list[dict[str, Any]]:
        files = self.files
        prefixes = sorted({n.split("zero_pp_rank_")[0] for n in files.present if "zero_pp_rank_" in n
                           and n.endswith("_optim_states.pt")})
        if not prefixes:
            raise CheckpointError(f"{files.dir} holds no *zero_pp_rank_*_optim_states.pt files although saved with "
                                  f"ZeRO stage 1: the checkpoint is incomplete; convert the weights only with "
                                  f"--no-load-optim")
        return [files.load(f"{prefixes[0]}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")["optimizer_state_dict"]
                for d in range(files.meta.data_parallel_size)]

    def _flat_index(self, mp: int) -> dict[str, Any]:
        """Where each parameter of model-parallel rank ``mp`` lies in its group's flat fp32 vector."""
        files = self.files
        if mp in self._flat:
            return self._flat[mp]
        if len(self._flat) >= files.tp:
            self._flat.clear()  # one stage's TP ranks' (memory-mapped) files at a time
        where = mp_model_file(mp)
        shapes = files.mp_file(mp).get("param_shapes")
        if not shapes:
            rec = (files.meta.optimizer_groups or {}).get(str(mp))
            if rec is None:
                raise CheckpointError(f"{os.path.join(files.dir, where)} has no param_shapes: the optimizer state "
                                      f"cannot be matched to parameters; convert the weights only "
                                      f"(--no-load-optim)")
            shapes = [{n: files.specs[canonical_name(n, files.cfg)].shape for n in g} for g in rec["groups"]]
        parts = self._optim_files(mp)
        bounds = stage_bounds(files.cfg, files.pp)
        stage = mp // files.tp if files.pp > 1 else 0
        index: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        for g, group in enumerate(shapes):
            offset = 0
            for n, shape in group.items():
                numel = int(torch.Size(shape).numel())
                cname = canonical_name(n, files.cfg)
                spec = files.specs.get(cname)
                # a tied weight is in both end stages' groups: read it from the stage that holds layer 0
                if spec is not None and (files.pp == 1 or stage_of(spec.layer_index, bounds) == stage):
                    index[cname] = (g, offset, tuple(shape))
                offset += numel
            total = sum(int(p["single_partition_of_fp32_groups"][g].numel()) for p in parts)
            if total < offset:
                raise CheckpointError(f"{files.dir}: the ZeRO partitions of model-parallel rank {mp}, group {g} "
                                      f"hold {total} values, its parameters need {offset}: the optimizer files are "
                                      f"damaged or from another model")
        self._flat[mp] = {"index": index, "parts": parts}
        return self._flat[mp]

    def shard(self, spec: ParamSpec, t: int) -> OptimShard:
        mp = self.mp_of(spec, t)
        self.files.map_layer(spec.layer_index)
        flat = self._flat_index(mp)
        if spec.name not in flat["index"]:
            return self.untrained(spec, t)
        g, offset, shape = flat["index"][spec.name]
        numel = int(torch.Size(shape).numel())
        out = {}
        for key in OPTIM_KEYS:
            pieces, start = [], 0
            for p in flat["parts"]:
                fp32 = p["single_partition_of_fp32_groups"][g]
                if key == "fp32":
                    vec = fp32
                else:
                    base = p["base_optimizer_state"]
                    # elastic_checkpoint: one state per group; otherwise torch's state_dict
                    moments = base[g] if isinstance(base, list) else base["state"].get(g, {})
                    # no state: saved before the optimizer's first step (weights-only load, no update yet)
                    vec = moments[key][: fp32.numel()] if key in moments else torch.zeros(fp32.numel())
                stop = start + vec.numel()
                lo, hi = max(start, offset), min(stop, offset + numel)
                if lo < hi:
                    pieces.append(vec[lo - start: hi - start])
                start = stop
            value = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).float().view(shape)
            out[key] = self.files.checked(spec, value, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt", spec.name)
        return out

    def _optimizer_state(self, out: dict[str, Any], head: dict[str, Any]) -> Any:
        part = self._optim_files(0)[0]
        base = part["base_optimizer_state"]
        scaler = part.get("loss_scaler")
        if scaler is not None:
            out["loss_scaler"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
        return base if isinstance(base, list) else base["state"]
