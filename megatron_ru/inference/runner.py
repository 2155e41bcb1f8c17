"""This rank's part of the model for inference, at any TP and PP, without a DeepSpeed engine.

:class:`StageRunner` builds the layers of this rank's pipeline stage from the model description
(:func:`megatron_ru.model.spec.model_description`, cut by :func:`~megatron_ru.model.spec.stage_bounds`
exactly as training cuts it; built on the meta device, without initialisation), fills them from full canonical tensors (:meth:`StageRunner.load`:
vocabulary rows padded for this layout, then this TP rank's shard), and runs a forward step:

* the first stage embeds the tokens; every other stage receives the hidden states [s, b, h] from
  the previous stage (``torch.distributed`` point-to-point, same TP rank), and sends its output on;
* the last stage returns float32 logits gathered over TP, exactly the ``V`` real vocabulary rows
  ([b, s, V]; padded rows are cut off, so they can never be chosen), identical on its TP ranks.

Every rank of a model replica runs the same loop with the same batch shapes, so each knows what it
receives. :meth:`StageRunner.broadcast_from_last` hands the last stage's choice (the next tokens)
to every rank of the replica.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_ru.config.model import ModelConfig, model_parallel_problems
from megatron_ru.model.gpt import build_layer
from megatron_ru.model.spec import LayerDesc, ParamSpec, layer_parameter_specs, model_description, stage_bounds
from megatron_ru.model.shards import layout_shard, padded_vocab_rows

GetTensor = Callable[[str], torch.Tensor]


class StageRunner(nn.Module):
    """The layers of one pipeline stage at one TP rank, for inference.

    ``state`` is a :class:`megatron_ru.parallel.state.ParallelState` (or any object with its
    ``tp_group, tp_size, tp_rank, pp_size, pp_rank, pp_ranks, mp_group, mp_ranks, layout``)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, state: Any, *, device: Optional[torch.device] = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        problems = cfg.problems() + model_parallel_problems(cfg, state.tp_size, state.pp_size)
        if problems:
            raise ValueError("the checkpoint's model cannot run at this layout:\n"
                             + "\n".join(f"  - {p}" for p in problems))
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.state = state
        self.device = device if device is not None else getattr(state, "device", torch.device("cpu"))
        self.dtype = dtype
        self.tp_group = state.tp_group if state.tp_size > 1 else None
        self.padded_vocab = padded_vocab_rows(cfg, vocab_size, state.tp_size)
        descs = model_description(cfg)
        start, stop = stage_bounds(cfg, state.pp_size)[state.pp_rank] if state.pp_size > 1 else (0, len(descs))
        self.descs: list[LayerDesc] = descs[start:stop]
        self.is_first = state.pp_rank == 0
        self.is_last = state.pp_rank == state.pp_size - 1
        self.layers = nn.ModuleList()
        self._embedding_index: Optional[int] = None
        # built on the meta device (no initialisation of full tensors: minutes for a large model),
        # then given uninitialised storage that load() fills
        with torch.device("meta"):
            for desc in self.descs:
                if desc.tied_output and self._embedding_index is not None:
                    # one stage holds both ends: the output head is the input embedding
                    self.layers.append(nn.Identity())
                    continue
                module = build_layer(desc, cfg, vocab_size, self.tp_group, False, seed=0,
                                     device=torch.device("meta"), dtype=dtype,
                                     **({"output_only": True} if desc.tied_output else {}))
                if desc.kind == "embedding":
                    self._embedding_index = len(self.layers)
                self.layers.append(module.eval())
        self.layers.to_empty(device=self.device)
        self.loaded = False
        self.num_transformer_layers = sum(d.kind == "transformer" for d in self.descs)
        self._embedding_specs = layer_parameter_specs(descs[0], cfg, vocab_size)

    # ---- weights ----------------------------------------------------------------------------
    def _specs_of(self, desc: LayerDesc) -> dict[str, ParamSpec]:
        specs = self._embedding_specs if desc.tied_output else layer_parameter_specs(desc, self.cfg, self.vocab_size)
        return {s.local_name: s for s in specs}

    def canonical_names(self) -> list[str]:
        """The canonical tensors this rank reads (each once)."""
        names: list[str] = []
        for desc, module in zip(self.descs, self.layers):
            specs = self._specs_of(desc)
            for local, _ in module.named_parameters():
                if specs[local].name not in names:
                    names.append(specs[local].name)
        return names

    def local_tensor(self, spec: ParamSpec, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full canonical tensor ``full``: shape checked, vocabulary rows
        padded with zeros to this layout, TP shard taken."""
        if tuple(full.shape) != tuple(spec.shape):
            raise ValueError(f"checkpoint tensor {spec.name} has shape {tuple(full.shape)}, expected "
                             f"{tuple(spec.shape)} for this model")
        return layout_shard(spec, full, self.padded_vocab, self.state.tp_size, self.state.tp_rank)

    @torch.no_grad()
    def load(self, get_tensor: GetTensor) -> None:
        """Fill every parameter of this stage from ``get_tensor(canonical name)`` (full tensors
        with ``V`` vocabulary rows, e.g. ``CheckpointReader.get``). Each tensor is read once."""
        for desc, module in zip(self.descs, self.layers):
            specs = self._specs_of(desc)
            params = dict(module.named_parameters())
            missing = sorted(set(params) - set(specs))
            assert not missing, f"layer {desc.index} has parameters without a canonical spec: {missing}"
            for local, param in params.items():
                spec = specs[local]
                local_value = self.local_tensor(spec, get_tensor(spec.name))
                assert local_value.shape == param.shape, (spec.name, local_value.shape, param.shape)
                param.copy_(local_value.to(dtype=param.dtype))
        self.loaded = True

    def new_kv_caches(self) -> Any:
        """Empty key/value caches for this stage's transformer layers (they grow as steps append)."""
        from megatron_ru.model.kv_cache import KVCache
        return KVCache(self.num_transformer_layers)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,
                attention_mask: Optional[torch.Tensor] = None, kv_caches: Optional[list[Any]] = None,
                last_only: bool = False) -> Optional[torch.Tensor]:
        """One forward step of the whole pipeline, seen from this rank. ``tokens`` [b, s] (every
        rank passes the batch: later stages take the shapes from it); ``position_ids`` [b, s];
        ``attention_mask`` bool [b, 1, s, s_k] for the cached keys; ``kv_caches`` one cache per
        transformer layer of this stage. Returns float32 logits [b, s (1 with ``last_only``), V]
        on the last stage, None elsewhere."""
        if not self.loaded:
            raise RuntimeError("StageRunner: call load() before running the model (its parameters are "
                               "uninitialised until then)")
        b, s = tokens.shape
        x: Any = None
        if not self.is_first:
            x = torch.empty((s, b, self.cfg.hidden_size), dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.state.pp_ranks[self.state.pp_rank - 1])
        logits = None
        layer_i = 0
        for desc, module in zip(self.descs, self.layers):
            if desc.kind == "embedding":
                x = module((tokens, position_ids))
            elif desc.kind == "transformer":
                kwargs: dict[str, Any] = {}
                if kv_caches is not None:
                    kwargs["kv_cache"] = kv_caches[layer_i]
                if attention_mask is not None:
                    kwargs["attention_mask"] = attention_mask
                x = module(x, position_ids, **kwargs)
                layer_i += 1
            elif desc.kind == "final_norm":
                x = module(x)
            else:
                if last_only:
                    x = x[-1:]
                logits = self._output(desc, module, x)
        if not self.is_last:
            dist.send(x.contiguous(), dst=self.state.pp_ranks[self.state.pp_rank + 1])
            return None
        return logits

    def _output(self, desc: LayerDesc, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        from megatron_ru.model.gpt import tied_output_logits
        if desc.tied_output:
            emb = self.layers[self._embedding_index] if self._embedding_index is not None else module
            logits = tied_output_logits(emb, hidden)
        else:
            logits = module(hidden)                              # [b, s, padded/tp]
        logits = logits.float()
        if self.state.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.state.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size]

    # ---- communication ----------------------------------------------------------------------
    def last_stage_source(self) -> int:
        """Global rank that decides for this replica: the last stage's TP rank 0."""
        for r in self.state.mp_ranks:
            c = self.state.layout.coord(r)
            if c.tp == 0 and c.pp == self.state.pp_size - 1:
                return r
        raise AssertionError("no last-stage rank in this model-parallel group")

    def is_source(self) -> bool:
        return dist.get_rank() == self.last_stage_source() if dist.is_initialized() else True

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the last stage's TP rank 0 holds it, on every rank of this replica (in place)."""
        if len(self.state.mp_ranks) > 1:
            dist.broadcast(t, src=self.last_stage_source(), group=self.state.mp_group)
        return t


def start_stage_runner(ns: Any, cfg: ModelConfig, vocab_size: int, dtype: torch.dtype) -> tuple[Any, StageRunner]:
    """The inference tools' start (generate, evaluate, compare_inits): the process group from ``ns``'s
    ``--distributed-backend`` and ``--distributed-timeout-minutes``, this rank's
    :class:`~megatron_ru.parallel.state.ParallelState` at ``--tensor-model-parallel-size`` ×
    ``--pipeline-model-parallel-size``, and its :class:`StageRunner` of the model (not loaded yet)."""
    from megatron_ru.parallel.env import init_distributed
    from megatron_ru.parallel.state import ParallelState

    init_distributed(ns.distributed_backend, ns.distributed_timeout_minutes)
    state = ParallelState.build(ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
                                timeout_minutes=ns.distributed_timeout_minutes)
    return state, StageRunner(cfg, vocab_size, state, dtype=dtype)
