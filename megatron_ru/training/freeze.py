"""Choose trainable parameters: ``--train-only-embeddings`` and ``--freeze`` patterns.

``--train-only-embeddings`` is the first stage of adapting a model to a new language or
vocabulary: only the input embedding and the output layer learn. ``--freeze PATTERN ...``
freezes every parameter whose name matches one of the ``fnmatch`` patterns. Both run before the
optimizer is built, so frozen parameters get no optimizer state.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

#: name fragments of the input embedding and the output layer (GPTModel and PipelineModule names)
EMBEDDING_MARKERS: tuple[str, ...] = ("embed", "word_embeddings", "output_layer", "lm_head")


def is_embedding_or_output(name: str) -> bool:
    return any(marker in name for marker in EMBEDDING_MARKERS)


def _embedding_and_output_params(model: torch.nn.Module) -> set[int]:
    """ids of the parameters of our embedding/output layers, found by type (pipeline stages name
    their layers by index, e.g. ``6.weight``), else by name."""
    from megatron_ru.model.gpt import EmbeddingLayer, OutputLayer
    found = {id(p) for m in model.modules() if isinstance(m, (EmbeddingLayer, OutputLayer)) for p in m.parameters()}
    found |= {id(p) for n, p in model.named_parameters() if is_embedding_or_output(n)}
    return found


def _matched_anywhere(counts: list[int], group: Any) -> list[int]:
    """Per-pattern match counts summed over ``group`` (the pipeline stages of one model replica)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1 or not counts:
        return counts
    t = torch.tensor(counts, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, group=group)
    return [int(x) for x in t.tolist()]


def apply_freezing(model: torch.nn.Module, *, train_only_embeddings: bool = False,
                   freeze: Optional[Sequence[str]] = None, group: Any = None) -> list[str]:
    """Set ``requires_grad=False`` on the chosen parameters; return the frozen names.

    A ``--freeze`` pattern matching nothing is an error (a typo would silently train everything);
    with a pipeline, pass its ``group``: a pattern must match on some stage, not on every one
    (collective over ``group``)."""
    named = list(model.named_parameters())
    frozen: list[str] = []
    if train_only_embeddings:
        keep = _embedding_and_output_params(model)
        for name, p in named:
            if id(p) not in keep:
                p.requires_grad_(False)
                frozen.append(name)
        if len(frozen) == len(named):
            raise ValueError("--train-only-embeddings found no embedding/output parameter (names containing "
                             f"{', '.join(EMBEDDING_MARKERS)}); parameter names: {_sample(n for n, _ in named)}")
    patterns = list(freeze or ())
    hits_of = {pat: [(n, p) for n, p in named if fnmatch.fnmatchcase(n, pat)] for pat in patterns}
    totals = _matched_anywhere([len(hits_of[pat]) for pat in patterns], group)
    for pattern, total in zip(patterns, totals):
        if total == 0:
            raise ValueError(f"--freeze pattern {pattern!r} matches no parameter; parameter names look like "
                             f"{_sample(n for n, _ in named)}")
        for name, p in hits_of[pattern]:
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(name)
    if frozen:
        trainable = sum(p.numel() for _, p in named if p.requires_grad)
        log_rank0(log, f"froze {len(frozen)} parameter tensors; {trainable} trainable parameters on this rank")
    return frozen


def _sample(names: Iterable[str], k: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")
