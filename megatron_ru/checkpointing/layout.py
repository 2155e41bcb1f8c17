"""File names and layout arithmetic shared by the reader, the writer and the loader.

The layer format (``metadata.json`` ``"format": "megatron_ru.layers"``), written by training
(:mod:`~megatron_ru.checkpointing.saver`) and by :func:`~megatron_ru.checkpointing.writer.write_checkpoint` at
any TP and PP::

    iter_XXXXXXX/metadata.json                         CheckpointMeta + format + optimizer (common state)
    iter_XXXXXXX/layer_{j:02d}-model_{t:02d}-model_states.pt   {local name: TP shard t} of pipeline layer j
    iter_XXXXXXX/layer_{j:02d}-model_{t:02d}-optim_states.pt   {local name: {fp32, exp_avg, exp_avg_sq}}
                                                        (written by the tools), or, from a training run
    iter_XXXXXXX/optim_states-pp{p:02d}-tp{t:02d}-dp{d:03d}.pt  each rank's fragments: {canonical name:
                                                        {offset, fp32, exp_avg, exp_avg_sq}}

Layer ``j`` is the model description's entry ``j`` (0 = embedding, 1..N decoder layers, N + 1 final
norm, N + 2 output head; a tied head has no file). The layer files do not depend on PP or DP: a run at
any PP reads the layers its stage holds, and any DP size sets its ZeRO partitions from the TP shard (the
optimizer state of a training run's shard joined from its data-parallel ranks' fragments).
The model files are laid out like DeepSpeed's own pipeline layer files (same names, same keys).
"""
from __future__ import annotations

from typing import Optional

from megatron_ru.checkpointing.files import file_kind, rng_file_name
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import ParamSpec, parameter_specs
from megatron_ru.model.shards import padded_vocab_rows

LAYERS_FORMAT = "megatron_ru.layers"
#: the Adam moments a checkpoint carries per parameter, besides the fp32 master weight
OPTIM_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def layer_file(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def layer_optim_file(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-optim_states.pt"


def optim_fragment_file(pp_rank: int, tp_rank: int, dp_rank: int) -> str:
    """The optimizer state one rank of a training run holds (written by :mod:`megatron_ru.checkpointing.saver`)."""
    return f"optim_states-pp{pp_rank:02d}-tp{tp_rank:02d}-dp{dp_rank:03d}.pt"


def mp_model_file(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def specs_by_name(cfg: ModelConfig, vocab_size: int) -> dict[str, ParamSpec]:
    return {s.name: s for s in parameter_specs(cfg, vocab_size)}




def derive_layers_expected(cfg: ModelConfig, vocab_size: int, tp: int, pp: int, dp: int,
                           optimizer_fragments: Optional[int], has_optimizer: bool,
                           present: list[str]) -> dict[str, Optional[int]]:
    """The files of a layer-format checkpoint whose metadata.json lost its file list (sizes unknown: None):
    every layer's file per TP rank; the optimizer's (per rank fragments, or per layer files) when it has
    optimizer state; the RNG files of every rank when any is present (training writes them, the tools not)."""
    layers = sorted({s.layer_index for s in parameter_specs(cfg, vocab_size)})
    out: dict[str, Optional[int]] = {layer_file(j, t): None for j in layers for t in range(tp)}
    if has_optimizer and optimizer_fragments:
        out.update({optim_fragment_file(p, t, d): None for p in range(pp) for t in range(tp)
                    for d in range(optimizer_fragments)})
    elif has_optimizer:
        out.update({layer_optim_file(j, t): None for j in layers for t in range(tp)})
    if any(file_kind(n) == "rng" for n in present):
        out.update({rng_file_name(r): None for r in range(tp * pp * dp)})
    return out


def mp_rank_of(pp_rank: int, tp_rank: int, tp: int) -> int:
    """DeepSpeed's model-parallel rank of a (stage, TP rank): TP varies fastest."""
    return pp_rank * tp + tp_rank


def stage_of(layer: int, bounds: list[tuple[int, int]]) -> Optional[int]:
    for s, (start, stop) in enumerate(bounds):
        if start <= layer < stop:
            return s
    return None
