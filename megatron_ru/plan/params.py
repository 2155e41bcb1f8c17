"""Exact parameter counts one rank holds, per pipeline stage, from the model description
(:func:`megatron_ru.model.spec.parameter_specs`) and DeepSpeed's partition
(:func:`megatron_ru.model.spec.stage_bounds`).

Counts are per rank of a stage (one tensor-parallel shard): a parameter split by TP holds
``numel / tp`` elements (vocabulary matrices padded to ``--make-vocab-size-divisible-by`` x TP
first), a replicated one (norms, row-parallel biases, position table) its whole size. With tied
embeddings and PP > 1 the word embeddings live on the first stage (with the position table) and
again on the last stage (DeepSpeed's TiedLayerSpec, built there without the position table).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import spec as model_spec


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


@dataclass(frozen=True)
class StageParams:
    """One rank's parameters of one stage: ``total`` elements, of which ``trainable`` get gradients
    and optimizer state, ``embedding`` are vocabulary rows (word embeddings / output layer)."""
    total: int
    trainable: int
    embedding: int
    tied_copy: int = 0
    """elements of the last stage's copy of the tied word embeddings (PP > 1, tied)"""


def _trainable(p: model_spec.ParamSpec, cfg: ModelConfig) -> bool:
    spec = cfg.lora_spec
    if spec is None:
        return True
    if ".lora." in p.name:
        return True
    from megatron_ru.config.lora import modules_to_save_patterns
    return any(fnmatch.fnmatchcase(p.name, pat) for pat in modules_to_save_patterns(spec))


def stage_params(cfg: ModelConfig, vocab_size: int, tp: int, pp: int) -> list[StageParams]:
    """:class:`StageParams` of one rank of each pipeline stage (LoRA: only adapters and
    ``--lora-modules-to-save`` are trainable, as :func:`megatron_ru.training.freeze.apply_lora_freezing`)."""
    rows = model_spec.padded_vocab_rows(cfg, vocab_size, tp)
    descs = model_spec.model_description(cfg)
    bounds = model_spec.stage_bounds(cfg, pp) if pp > 1 else [(0, len(descs))]
    out = []
    for start, stop in bounds:
        total = trainable = embedding = tied = 0
        indices = range(start, stop)
        for j in indices:
            specs = model_spec.layer_parameter_specs(descs[j], cfg, vocab_size)
            if descs[j].tied_output and 0 not in indices:
                # the tied head on a stage without the embedding: DeepSpeed builds word embeddings only
                specs = [p for p in model_spec.layer_parameter_specs(descs[0], cfg, vocab_size) if p.vocab]
                tied = sum(_local_numel(p, rows, tp) for p in specs)
            for p in specs:
                n = _local_numel(p, rows, tp)
                total += n
                embedding += n if p.vocab else 0
                trainable += n if _trainable(p, cfg) else 0
        out.append(StageParams(total, trainable, embedding, tied))
    return out


def stage_param_counts(cfg: ModelConfig, vocab_size: int, tp: int, pp: int) -> list[int]:
    """Parameters one rank of each pipeline stage holds (vocabulary padding included; tied
    embeddings counted on both the first and the last stage, as DeepSpeed holds them)."""
    return [s.total for s in stage_params(cfg, vocab_size, tp, pp)]


def total_param_count(cfg: ModelConfig, vocab_size: Optional[int]) -> int:
    """The model's parameters once (canonical, unpadded vocabulary, a tied matrix once)."""
    return sum(math.prod(p.shape) for p in model_spec.parameter_specs(cfg, vocab_size or 1))
