"""Choose trainable parameters: ``--train-only-embeddings`` and ``--freeze`` patterns.

``--train-only-embeddings`` is the first stage of adapting a model to a new language or
vocabulary: only the input embedding and the output layer learn. ``--freeze PATTERN ...``
freezes every parameter whose canonical name (docs/model.md) matches one of the ``fnmatch``
patterns, at any TP/PP. Both run before the
optimizer is built, so frozen parameters get no optimizer state.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.config.lora import is_adapter_parameter
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import EMBEDDING, OUTPUT_LAYER, canonical_named_parameters
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

#: canonical prefixes of the input embedding (word and position tables) and the output layer
EMBEDDING_PREFIXES: tuple[str, ...] = (EMBEDDING + ".", OUTPUT_LAYER + ".")


def is_embedding_or_output(canonical: str) -> bool:
    return canonical.startswith(EMBEDDING_PREFIXES)


def _matched_anywhere(counts: list[int], group: Any) -> list[int]:
    """Per-pattern match counts summed over ``group`` (the pipeline stages of one model replica)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1 or not counts:
        return counts
    t = torch.tensor(counts, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, group=group)
    return [int(x) for x in t.tolist()]


def apply_freezing(model: torch.nn.Module, cfg: ModelConfig, *, train_only_embeddings: bool = False,
                   freeze: Optional[Sequence[str]] = None, group: Any = None) -> list[str]:
    """Set ``requires_grad=False`` on the chosen parameters; return their canonical names.

    Patterns match canonical names (``decoder.layers.0.*``), whatever the layout: a
    ``PipelineModule``'s index-named parameters are translated first. A ``--freeze`` pattern matching
    nothing is an error (a typo would silently train everything); with a pipeline, pass its
    ``group``: a pattern must match on some stage, not on every one (collective over ``group``)."""
    named = list(canonical_named_parameters(model, cfg))
    frozen: list[str] = []
    if train_only_embeddings:
        for name, p in named:
            if not is_embedding_or_output(name):
                p.requires_grad_(False)
                frozen.append(name)
    patterns = list(freeze or ())
    hits_of = {pat: [(n, p) for n, p in named if fnmatch.fnmatchcase(n, pat)] for pat in patterns}
    totals = _matched_anywhere([len(hits_of[pat]) for pat in patterns], group)
    for pattern, total in zip(patterns, totals):
        if total == 0:
            raise ValueError(f"--freeze pattern {pattern!r} matches no parameter; patterns match the canonical "
                             f"parameter names (docs/model.md), which look like {_sample(n for n, _ in named)}")
        for name, p in hits_of[pattern]:
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(name)
    if not (train_only_embeddings or patterns):
        return frozen
    # a collective on every stage (same flags everywhere), whether or not this stage froze anything
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    (everywhere,) = _matched_anywhere([trainable], group)
    if frozen:
        log_rank0(log, f"froze {len(frozen)} parameter tensors; {trainable} trainable parameters on this rank")
    if everywhere == 0:
        raise ValueError(f"--freeze {' '.join(patterns)} leaves nothing to train in the whole model; freeze fewer "
                         "parameters")
    if trainable == 0:
        keep_optimizer_busy(named)
    return frozen


def apply_lora_freezing(model: torch.nn.Module, cfg: ModelConfig, group: Any = None) -> list[str]:
    """With adapters (``cfg.lora``): freeze every parameter except the adapters and the modules of
    ``--lora-modules-to-save``; a modules-to-save entry matching nothing on any pipeline stage is an
    error. Returns the frozen canonical names."""
    from megatron_ru.config.lora import modules_to_save_patterns
    spec = cfg.lora_spec
    if spec is None:
        return []
    named = list(canonical_named_parameters(model, cfg))
    patterns = modules_to_save_patterns(spec)
    hits = [[n for n, _ in named if fnmatch.fnmatchcase(n, pat)] for pat in patterns]
    totals = _matched_anywhere([len(h) for h in hits], group)
    for entry, total in zip(spec.modules_to_save, totals):
        if total == 0:
            raise ValueError(f"--lora-modules-to-save {entry!r} matches no parameter; use embedding, output_layer, "
                             f"final_layernorm or a pattern over canonical names like {_sample(n for n, _ in named)}")
    saved = {n for h in hits for n in h}
    frozen = []
    for name, p in named:
        train = is_adapter_parameter(name) or name in saved
        p.requires_grad_(train)
        if not train:
            frozen.append(name)
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    (everywhere,) = _matched_anywhere([trainable], group)
    log_rank0(log, f"LoRA: froze {len(frozen)} base parameter tensors; {trainable} trainable parameters on this rank "
                   f"(adapters{' and ' + ', '.join(spec.modules_to_save) if spec.modules_to_save else ''})")
    if everywhere == 0:
        raise ValueError("--lora-target-modules/--lora-modules-to-save leave nothing to train")
    if trainable == 0:
        keep_optimizer_busy(named)
    return frozen


#: set on the parameter :func:`keep_optimizer_busy` leaves in the optimizer (no weight decay, zero gradient)
ANCHOR_ATTR = "megatron_ru_anchor"


def keep_optimizer_busy(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """A pipeline stage with nothing to train (a middle stage under --train-only-embeddings at PP > 2,
    or a --freeze that covers it) still steps DeepSpeed's optimizer with the other stages: its
    smallest parameter stays in the optimizer with its gradient zeroed as it is produced and no weight
    decay, so Adam's update is exactly zero and the parameter bit-identical."""
    name, p = min(named, key=lambda item: item[1].numel())
    p.requires_grad_(True)
    setattr(p, ANCHOR_ATTR, True)
    p.register_hook(torch.zeros_like)
    log.info(f"nothing to train on this pipeline stage: {name} ({p.numel()} values) stays in the optimizer with a "
             f"zero gradient and no weight decay (it does not change)")


def _sample(names: Iterable[str], k: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")
