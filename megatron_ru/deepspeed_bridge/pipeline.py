"""DeepSpeed's pipeline: the model's plain layer list (:func:`megatron_ru.model.gpt.pipeline_layers`) as
``LayerSpec``/``TiedLayerSpec`` objects in a ``PipelineModule`` over our rank order, and DeepSpeed's
balanced partition of layers into stages (which :func:`megatron_ru.model.spec.stage_bounds` reproduces
for offline tools)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["is_pipeline_module", "layer_specs", "partition_balanced", "pipeline_module", "topology"]


def topology(state: Any) -> Any:
    """DeepSpeed's topology object for ``PipelineModule(topology=...)`` of a
    :class:`~megatron_ru.parallel.state.ParallelState`; the same rank order (TP fastest, then DP, then PP)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    return PipeModelDataParallelTopology(num_pp=state.pp_size, num_mp=state.tp_size, num_dp=state.dp_size)


def layer_specs(layers: Sequence[Any]) -> list[Any]:
    """Each :class:`~megatron_ru.model.gpt.PipelineLayer` as DeepSpeed's ``LayerSpec``, or ``TiedLayerSpec``
    when it shares a weight with another layer (its ``tied_key``)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    specs: list[Any] = []
    for layer in layers:
        if layer.tied_key is None:
            specs.append(LayerSpec(layer.cls, *layer.args, **layer.kwargs))
        else:
            specs.append(TiedLayerSpec(layer.tied_key, layer.cls, *layer.args, forward_fn=layer.forward_fn,
                                       tied_weight_attr=layer.tied_weight_attr, **layer.kwargs))
    return specs


def pipeline_module(layers: Sequence[Any], loss_fn: torch.nn.Module, state: Any, *, partition_method: str,
                    activation_checkpoint_interval: int = 0) -> torch.nn.Module:
    """This rank's stage of a ``PipelineModule`` over ``layers``, cut by ``partition_method``.

    Built without autograd: its constructor broadcasts a tied weight (the word embedding, to the last stage)
    from the first stage in place, and ``dist.broadcast`` on a parameter that requires a gradient is recorded
    as an in-place op that has no backward: every later backward pass then warns "c10d::broadcast_: an
    autograd kernel was not registered ... silently incorrect behavior". The broadcast only sets the starting
    value (the gradients of the two copies are summed by DeepSpeed's ``allreduce_tied_weight_gradients``), so
    nothing was wrong but the warning; tests/integration/test_train_layouts.py checks a tied model at PP 2
    against one process."""
    from deepspeed.pipe import PipelineModule
    with torch.no_grad():
        return PipelineModule(layers=layer_specs(layers), loss_fn=loss_fn, topology=topology(state),
                              partition_method=partition_method,
                              activation_checkpoint_interval=activation_checkpoint_interval)


def is_pipeline_module(model: torch.nn.Module) -> bool:
    from deepspeed.runtime.pipe.module import PipelineModule
    return isinstance(model, PipelineModule)


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """DeepSpeed's partition of layers with ``weights`` into ``num_parts`` stages: the ``num_parts + 1``
    boundaries (stage ``s`` holds layers ``[parts[s], parts[s + 1])``)."""
    from deepspeed.runtime import utils as ds_utils
    return list(ds_utils.partition_balanced(weights=list(weights), num_parts=num_parts))
