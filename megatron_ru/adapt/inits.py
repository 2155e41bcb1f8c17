"""Every way of initialising a new vocabulary's rows that the anchors offer (ADAPTATION.md), on one
:class:`~megatron_ru.adapt.vocab_map.VocabMap`.

Kept tokens (the text is one old token) and matched special tokens keep their old rows under every
method except ``random-all``; the others ("new rows") get:

* ``mean`` — the mean of the old pieces' rows (the published ruadapt method; Nemotron's ``uniform``);
* ``weighted-mean`` — piece *k* weighs 1/(k+1), whitespace-only pieces a tenth of that;
* ``char-weighted`` — weights proportional to each piece's length in characters;
* ``max-char`` — the row of the longest piece (the first of equally long ones);
* ``mean-all`` — the mean of all old rows;
* ``mean-target`` — the mean of the old rows of tokens in the target script (``target_pattern``,
  Cyrillic by default; all old rows when none matches);
* ``hf-default`` — drawn from a multivariate normal with the old rows' mean and 1e-9 times their
  covariance (transformers' ``resize_token_embeddings(mean_resizing=True)``);
* ``random`` — N(0, std of the old rows); ``random-all`` — the same for every row, kept ones too;
* ``focus`` — FOCUS: a sparsemax-weighted sum of the old rows of the overlapping tokens nearest in a
  fastText space of the target language (:mod:`megatron_ru.adapt.focus`; needs its ``FocusMap``).

A token with no piece (or whose pieces average to zero) gets the mean of all old rows under the
piece-based methods. ``input_norm_correction`` rescales the new *input* rows to the median L2 norm
of the old input rows (Nemotron's correction; output rows are deliberately left alone: inflated
output norms make a model over-predict the new tokens).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from megatron_ru.adapt.vocab_map import VocabMap

if TYPE_CHECKING:
    from megatron_ru.adapt.focus import FocusMap

PIECE_METHODS = ("mean", "weighted-mean", "char-weighted", "max-char")
#: methods that need a target-language corpus (``--focus-corpus``)
CORPUS_METHODS = ("focus",)
METHODS = PIECE_METHODS + ("mean-all", "mean-target", "hf-default", "random", "random-all") + CORPUS_METHODS
TARGET_PATTERN = "[а-яёА-ЯЁ]"


def _chars(b: Optional[bytes]) -> int:
    return 0 if not b else sum(1 for x in b if not 0x80 <= x <= 0xBF)


def piece_vocab_map(vmap: VocabMap, method: str, old_pieces: Sequence[Optional[bytes]]) -> VocabMap:
    """``vmap`` with the piece weights of ``method`` (one of PIECE_METHODS)."""
    if method in ("mean", "weighted-mean"):
        return vmap
    weights: list[list[float]] = []
    pieces: list[list[int]] = []
    for i, ids in enumerate(vmap.pieces):
        if vmap.kind[i] != "pieces":
            weights.append([1.0] * len(ids))
            pieces.append(ids)
            continue
        lengths = [max(1, _chars(old_pieces[j])) for j in ids]
        if method == "char-weighted":
            total = float(sum(lengths))
            weights.append([n / total for n in lengths])
            pieces.append(ids)
        else:  # max-char
            k = max(range(len(ids)), key=lambda j: (lengths[j], -j))
            weights.append([1.0])
            pieces.append([ids[k]])
    return VocabMap(vmap.old_size, vmap.new_size, list(vmap.kind), pieces, weights)


def target_rows(old_pieces: Sequence[Optional[bytes]], pattern: str = TARGET_PATTERN) -> list[int]:
    """Old ids whose text holds a character of the target script."""
    rx = re.compile(pattern)
    return [i for i, b in enumerate(old_pieces) if b and rx.search(b.decode("utf-8", errors="ignore"))]


@torch.no_grad()
def init_rows(old: torch.Tensor, vmap: VocabMap, method: str, old_pieces: Sequence[Optional[bytes]], *,
              seed: int = 1234, target_pattern: str = TARGET_PATTERN,
              focus: Optional["FocusMap"] = None) -> tuple[torch.Tensor, list[int]]:
    """The ``vmap.new_size`` rows of ``method`` from ``old`` (≥ ``vmap.old_size`` rows), in ``old``'s
    dtype, and the ids that got the mean of all old rows because they had no usable piece. ``focus``
    (:func:`megatron_ru.adapt.focus.build_focus`, built on ``vmap``) is what ``method`` focus needs."""
    if method not in METHODS:
        raise ValueError(f"unknown initialisation {method!r}; choose one of {', '.join(METHODS)}")
    if method == "focus":
        if focus is None:
            raise ValueError("the focus initialisation needs --focus-corpus (target-language text for its "
                             "fastText vectors)")
        from megatron_ru.adapt.focus import focus_rows
        return focus_rows(old, focus, seed)
    if method in PIECE_METHODS:
        m = piece_vocab_map(vmap, method, old_pieces)
        return m.convert_with_fallbacks(old, weighted=method != "mean")
    new, fallbacks = vmap.convert_with_fallbacks(old)
    old64 = old[:vmap.old_size].to(torch.float64)
    ids = list(range(vmap.new_size)) if method == "random-all" else vmap.new_ids()
    if not ids:
        return new, fallbacks
    idx = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    h = old.shape[1]
    if method == "mean-all":
        rows = old64.mean(0).expand(len(ids), h)
    elif method == "mean-target":
        target = target_rows(old_pieces[:vmap.old_size], target_pattern) or list(range(vmap.old_size))
        rows = old64[torch.tensor(target)].mean(0).expand(len(ids), h)
    elif method == "hf-default":
        mean = old64.mean(0)
        centered = old64 - mean
        cov = centered.T @ centered / vmap.old_size
        try:
            chol = torch.linalg.cholesky(1e-9 * cov)
            rows = mean + torch.randn((len(ids), h), generator=gen, dtype=torch.float64) @ chol.T
        except RuntimeError:  # not positive definite: transformers falls back to the mean too
            rows = mean.expand(len(ids), h)
    else:  # random, random-all
        rows = torch.randn((len(ids), h), generator=gen, dtype=torch.float64) * float(old64.std())
    new[idx] = rows.to(old.dtype)
    return new, fallbacks


@torch.no_grad()
def correct_input_norms(new: torch.Tensor, old: torch.Tensor, ids: Sequence[int], old_size: int) -> torch.Tensor:
    """``new`` with rows ``ids`` rescaled to the median L2 norm of ``old``'s first ``old_size`` rows."""
    if not ids:
        return new
    target = old[:old_size].to(torch.float64).norm(dim=1).median()
    idx = torch.tensor(list(ids), dtype=torch.long)
    rows = new[idx].to(torch.float64)
    norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    out = new.clone()
    out[idx] = (rows / norms * target).to(new.dtype)
    return out
