"""Choose trainable parameters: ``--train-only-embeddings`` and ``--freeze`` patterns.

``--train-only-embeddings`` is the first stage of adapting a model to a new language or
vocabulary: only the input embedding and the output layer learn. ``--freeze PATTERN ...``
freezes every parameter whose name matches one of the ``fnmatch`` patterns. Both run before the
optimizer is built, so frozen parameters get no optimizer state.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Sequence

import torch

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


def apply_freezing(model: torch.nn.Module, *, train_only_embeddings: bool = False,
                   freeze: Optional[Sequence[str]] = None) -> list[str]:
    """Set ``requires_grad=False`` on the chosen parameters; return the frozen names.

    A ``--freeze`` pattern matching nothing is an error (a typo would silently train everything)."""
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
    for pattern in freeze or ():
        hits = [(n, p) for n, p in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"--freeze pattern {pattern!r} matches no parameter; parameter names look like "
                             f"{_sample(n for n, _ in named)}")
        for name, p in hits:
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
