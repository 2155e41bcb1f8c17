"""Exact parameter counts one rank holds, per pipeline stage, from the model description
(:func:`megatron_ru.model.spec.parameter_specs`) and DeepSpeed's partition
(:func:`megatron_ru.model.spec.stage_bounds`).

Counts are per rank of a stage (one tensor-parallel shard): a parameter split by TP holds
``numel / tp`` elements (vocabulary matrices padded to ``--make-vocab-size-divisible-by`` x TP
first), a replicated one (norms, row-parallel biases, position table) its whole size. With tied
embeddings and PP > 1 the word embeddings live on the first stage (with the position table) and
again on the last stage (DeepSpeed's TiedLayerSpec, built there without the position table).

:func:`stage_tensors` also keeps the order in which the stage's module yields its parameters
(DeepSpeed registers a pipeline's tied modules before its layers): DeepSpeed flattens the
optimizer's parameter groups in that order, which decides where data-parallel partitions cut.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.lora import is_adapter_parameter
from megatron_ru.config.model import ModelConfig
from megatron_ru.model import spec as model_spec
from megatron_ru.model.shards import padded_vocab_rows


@dataclass(frozen=True)
class TensorInfo:
    """One parameter tensor as one rank holds it."""
    name: str
    numel: int
    ndim: int
    trainable: bool
    vocab: bool


@dataclass(frozen=True)
class StageParams:
    """One rank's parameters of one stage: ``total`` elements, of which ``trainable`` get gradients
    and optimizer state, ``embedding`` are vocabulary rows (word embeddings / output layer)."""
    total: int
    trainable: int
    embedding: int
    tied_copy: int = 0
    """elements of the last stage's copy of the tied word embeddings (PP > 1, tied)"""


def _local_numel(p: model_spec.ParamSpec, rows: int, tp: int) -> int:
    shape = list(p.shape)
    if p.vocab:
        shape[0] = rows
    n = math.prod(shape)
    if p.partition_dim is not None and tp > 1:
        if shape[p.partition_dim] % tp:
            raise ValueError(f"{p.name}: dimension {p.partition_dim} ({shape[p.partition_dim]}) is not divisible "
                             f"by --tensor-model-parallel-size {tp}")
        n //= tp
    return n


def _trainable_rule(cfg: ModelConfig):
    """Which canonical names get gradients: all, or with LoRA the adapters and ``--lora-modules-to-save``
    (as :func:`megatron_ru.training.freeze.apply_lora_freezing`)."""
    spec = cfg.lora_spec
    if spec is None:
        return lambda name: True
    from megatron_ru.config.lora import modules_to_save_patterns
    patterns = modules_to_save_patterns(spec)
    return lambda name: is_adapter_parameter(name) or any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def stage_tensors(cfg: ModelConfig, vocab_size: int, tp: int, pp: int) -> list[list[TensorInfo]]:
    """The parameter tensors one rank of each pipeline stage holds, in its module's order."""
    rows = padded_vocab_rows(cfg, vocab_size, tp)
    descs = model_spec.model_description(cfg)
    bounds = model_spec.stage_bounds(cfg, pp) if pp > 1 else [(0, len(descs))]
    trainable = _trainable_rule(cfg)

    def infos(specs: list[model_spec.ParamSpec]) -> list[TensorInfo]:
        return [TensorInfo(p.name, _local_numel(p, rows, tp), len(p.shape), trainable(p.name), p.vocab)
                for p in specs]

    out = []
    for start, stop in bounds:
        tied: list[TensorInfo] = []
        layers: list[TensorInfo] = []
        for j in range(start, stop):
            desc = descs[j]
            if desc.tied_output and start > 0:
                # the tied head on a stage without the embedding: word embeddings only
                tied += infos([p for p in model_spec.layer_parameter_specs(descs[0], cfg, vocab_size) if p.vocab])
            elif desc.kind == "embedding" and cfg.tied_embeddings and pp > 1:
                tied += infos(model_spec.layer_parameter_specs(desc, cfg, vocab_size))
            else:
                layers += infos(model_spec.layer_parameter_specs(desc, cfg, vocab_size))
        # a PipelineModule registers its tied modules before its layers
        out.append(tied + layers)
    return out


def stage_params(cfg: ModelConfig, vocab_size: int, tp: int, pp: int) -> list[StageParams]:
    """:class:`StageParams` of one rank of each pipeline stage."""
    out = []
    for s, tensors in enumerate(stage_tensors(cfg, vocab_size, tp, pp)):
        tied = sum(t.numel for t in tensors if t.vocab) if (s > 0 and cfg.tied_embeddings) else 0
        out.append(StageParams(total=sum(t.numel for t in tensors),
                               trainable=sum(t.numel for t in tensors if t.trainable),
                               embedding=sum(t.numel for t in tensors if t.vocab), tied_copy=tied))
    return out


def stage_param_counts(cfg: ModelConfig, vocab_size: int, tp: int, pp: int) -> list[int]:
    """Parameters one rank of each pipeline stage holds (vocabulary padding included; tied
    embeddings counted on both the first and the last stage, as DeepSpeed holds them)."""
    return [s.total for s in stage_params(cfg, vocab_size, tp, pp)]


def total_param_count(cfg: ModelConfig, vocab_size: Optional[int]) -> int:
    """The model's parameters once (canonical, unpadded vocabulary, a tied matrix once)."""
    return sum(math.prod(p.shape) for p in model_spec.parameter_specs(cfg, vocab_size or 1))
