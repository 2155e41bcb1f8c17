"""The layer format's optimizer state, as the fp32 master and Adam moments of each saved TP shard:

* :class:`LayerFileOptim`: its per-layer optimizer files (``write_checkpoint``, resharding);
* :class:`FragmentOptim`: (from training) each TP shard's fragments, joined over the data-parallel ranks'
  ``optim_states-pp*-tp*-dp*.pt`` files.

Both share the step, LR scheduler and loss scaler recorded in ``metadata.json``.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.layout import OPTIM_KEYS, layer_optim_file, optim_fragment_file, stage_of
from megatron_ru.checkpointing.sources.common import OptimShard, OptimSource
from megatron_ru.model.spec import ParamSpec, stage_bounds


class _LayerFormatOptim(OptimSource):
    def common_state(self) -> dict[str, Any]:
        return dict(self.files.meta.optimizer or {})


class LayerFileOptim(_LayerFormatOptim):
    """``layer_{j:02d}-model_{t:02d}-optim_states.pt``: every TP rank's file of a layer read whole, one layer at
    a time."""

    _layer: Optional[tuple[int, list[dict[str, Any]]]] = None

    def shard(self, spec: ParamSpec, t: int) -> OptimShard:
        files, layer = self.files, spec.layer_index
        if self._layer is None or self._layer[0] != layer:
            self._layer = None
            self._layer = (layer, [files.load(layer_optim_file(layer, r), mmap=False) for r in range(files.tp)])
        where = layer_optim_file(layer, t)
        state = self._layer[1][t].get(spec.local_name)
        if not isinstance(state, dict):
            raise CheckpointError(f"{os.path.join(files.dir, where)} has no optimizer state for "
                                  f"{spec.local_name!r}: the file is damaged")
        return {k: files.checked(spec, state.get(k), where, f"{spec.local_name}.{k}") for k in OPTIM_KEYS}


class FragmentOptim(_LayerFormatOptim):
    """``optim_states-pp*-tp*-dp*.pt``: each data-parallel rank's fragments (``offset`` into the flat TP shard)
    of the parameters of one pipeline stage and TP rank, memory-mapped one layer at a time."""

    def shard(self, spec: ParamSpec, t: int) -> OptimShard:
        """TP shard ``t``'s optimizer state, joined from the fragments the data-parallel ranks saved."""
        files = self.files
        files.map_layer(spec.layer_index)
        stage = stage_of(spec.layer_index, stage_bounds(files.cfg, files.pp))
        shape = files.shard_shape(spec)
        numel = int(torch.Size(shape).numel())
        pieces = []
        for d in range(int(files.meta.optimizer_fragments or 1)):
            frag = files.mapped(optim_fragment_file(stage, t, d)).get(spec.name)
            if frag is not None:
                pieces.append((int(frag["offset"]), d, frag))
        if not pieces:
            return self.untrained(spec, t)
        pieces.sort(key=lambda x: x[0])
        out = {}
        for key in OPTIM_KEYS:
            parts, at = [], 0
            for offset, d, frag in pieces:
                where = optim_fragment_file(stage, t, d)
                value = frag.get(key)
                if value is None and key == "fp32":  # ZeRO 0 in fp32: the weight is the master
                    value = self.weight_shard(spec, t).detach().reshape(-1)[offset:]
                if not torch.is_tensor(value) or offset != at:
                    raise CheckpointError(f"{os.path.join(files.dir, where)}: the {key} fragment of {spec.name} "
                                          f"{'is not a tensor' if not torch.is_tensor(value) else f'starts at element {offset}, expected {at}'}: "
                                          f"the optimizer files are damaged or from another run")
                parts.append(value.reshape(-1))
                at += value.numel()
            if at != numel:
                raise CheckpointError(f"{files.dir}: the saved {key} fragments of {spec.name} hold {at} values, its "
                                      f"TP shard has {numel}: an optimizer file is missing or from another run")
            full = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[key] = full.view(shape).float()
        return out
