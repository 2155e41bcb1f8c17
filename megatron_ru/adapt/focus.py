"""FOCUS (Dobler & de Melo, EMNLP 2023, "Fast Overlapping Token Combinations Using Sparsemax"): each
new token is a sparse convex combination of the old rows of tokens that both vocabularies share,
chosen by similarity in a fastText space of the target language (:mod:`~megatron_ru.adapt.token_vectors`).

* overlapping tokens — new tokens whose text is one old token (``kept`` in the
  :class:`~megatron_ru.adapt.vocab_map.VocabMap`) and matched special tokens — keep their old rows;
* every other new token with a fastText vector: its cosine similarity to each overlapping token that
  has a vector, ``sparsemax(similarity / temperature)`` over those (weights ≥ 0 summing to 1, zero
  for all but the closest few; FOCUS's code uses the similarities as they are: temperature 1), and
  the new row is the weighted sum of those overlapping tokens' old rows;
* a new token without a vector (seen fewer than ``--focus-min-count`` times in the corpus):
  ``--focus-fallback mean``, the mean of its old pieces (our ``mean`` row; a token without pieces the
  mean of all old rows), or ``random``, a draw from N(mean, std) of the old rows per dimension, which
  is what FOCUS's code does.

The weights are computed once and serve both matrices, each from its own old rows.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_ru.data.token_text import TokenTexts
from megatron_ru.adapt.token_vectors import TokenVectors, VectorOptions, train_token_vectors
from megatron_ru.adapt.vocab_map import VocabMap
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

FALLBACKS = ("mean", "random")
#: new tokens whose similarities are computed at once (bounds a block's [rows, overlap] matrix)
_BLOCK = 1024


@dataclass(frozen=True)
class FocusOptions:
    vectors: VectorOptions
    temperature: float = 1.0
    fallback: str = "mean"


@dataclass
class FocusMap:
    """The rows FOCUS computes, as a vocabulary map: kept and special ids as in the original map, a FOCUS
    row's ``pieces`` the old ids of its overlapping neighbours with the sparsemax ``weights``, a row
    without a vector its own old pieces with equal weights."""

    vmap: VocabMap
    focus_ids: list[int]
    no_vector: list[int]
    basis: int
    options: FocusOptions
    vectors: TokenVectors

    def summary(self) -> dict[str, Any]:
        support = [len(self.vmap.pieces[i]) for i in self.focus_ids]
        v = self.options.vectors
        return {"corpus": v.corpus, "documents": self.vectors.documents, "corpus_tokens": self.vectors.tokens,
                "fasttext_seconds": round(self.vectors.seconds, 2), "dim": v.dim, "epochs": v.epochs,
                "min_count": v.min_count, "temperature": self.options.temperature,
                "fallback": self.options.fallback, "tokens_with_vector": len(self.vectors.ids),
                "overlap_with_vector": self.basis, "focus_rows": len(self.focus_ids),
                "no_vector_rows": len(self.no_vector),
                "mean_neighbours": sum(support) / len(support) if support else 0.0}


def sparsemax(z: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of each row of ``z`` onto the probability simplex (Martins & Astudillo,
    2016), as FOCUS computes it (the ``entmax`` package)."""
    from entmax import sparsemax as _sparsemax
    return _sparsemax(z, dim=-1)


def focus_weights(queries: torch.Tensor, basis: torch.Tensor,
                  temperature: float) -> list[tuple[list[int], list[float]]]:
    """Per row of ``queries``: the rows of ``basis`` with a nonzero weight in ``sparsemax(cosine /
    temperature)`` and those weights (float64)."""
    q = queries.to(torch.float64)
    b = basis.to(torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    b = b / b.norm(dim=1, keepdim=True)
    out: list[tuple[list[int], list[float]]] = []
    for start in range(0, q.shape[0], _BLOCK):
        w = sparsemax(q[start:start + _BLOCK] @ b.T / temperature)
        for row in w:
            nz = row.nonzero().flatten()
            out.append((nz.tolist(), row[nz].tolist()))
    return out


def build_focus_map(vmap: VocabMap, vectors: TokenVectors, options: FocusOptions) -> FocusMap:
    """FOCUS's rows for ``vmap``'s new ids from the token ``vectors`` of the new vocabulary."""
    row_of = {i: k for k, i in enumerate(vectors.ids)}
    norms = torch.from_numpy(vectors.vectors).to(torch.float64).norm(dim=1) if len(vectors.ids) else torch.zeros(0)
    has = {i for i in vectors.ids if float(norms[row_of[i]]) > 0}
    overlap = [i for i, k in enumerate(vmap.kind) if k in ("kept", "special") and i in has]
    new = vmap.new_ids()
    focus_ids = [i for i in new if i in has] if overlap else []
    if new and not overlap:
        log.warning(f"FOCUS: no token shared by the two vocabularies occurs in --focus-corpus {options.vectors.corpus} "
                    f"often enough (--focus-min-count {options.vectors.min_count}) to have a fastText vector: every "
                    f"new row gets --focus-fallback {options.fallback}")
    chosen = set(focus_ids)
    no_vector = [i for i in new if i not in chosen]
    pieces = [list(p) for p in vmap.pieces]
    weights = [list(w) for w in vmap.weights] if vmap.weights else [[1.0] * len(p) for p in pieces]
    kind = list(vmap.kind)
    for i in no_vector:
        weights[i] = [1.0 / len(pieces[i]) for _ in pieces[i]]
    if focus_ids:
        mat = torch.from_numpy(vectors.vectors)
        basis = mat[[row_of[i] for i in overlap]]
        old_of = [vmap.pieces[i][0] for i in overlap]
        for i, (cols, w) in zip(focus_ids, focus_weights(mat[[row_of[i] for i in focus_ids]], basis,
                                                          options.temperature)):
            kind[i], pieces[i], weights[i] = "pieces", [old_of[c] for c in cols], w
    return FocusMap(vmap=VocabMap(vmap.old_size, vmap.new_size, kind, pieces, weights), focus_ids=focus_ids,
                    no_vector=no_vector, basis=len(overlap), options=options, vectors=vectors)


def build_focus(vmap: VocabMap, tokenizer: Any, texts: TokenTexts, options: FocusOptions) -> FocusMap:
    """fastText vectors of ``tokenizer``'s tokens on the corpus, then :func:`build_focus_map`."""
    return build_focus_map(vmap, train_token_vectors(tokenizer, texts, options.vectors), options)


@torch.no_grad()
def focus_rows(old: torch.Tensor, fmap: FocusMap, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The new matrix by FOCUS from ``old`` (each matrix from its own old rows), and the ids that got the
    mean of all old rows."""
    new, fallbacks = fmap.vmap.convert_with_fallbacks(old, weighted=True)
    if fmap.options.fallback == "random" and fmap.no_vector:
        old64 = old[:fmap.vmap.old_size].to(torch.float64)
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(fmap.no_vector), old.shape[1]), generator=gen, dtype=torch.float64)
        new[torch.tensor(fmap.no_vector)] = (old64.mean(0) + noise * old64.std(0)).to(old.dtype)
        drawn = set(fmap.no_vector)
        fallbacks = [i for i in fallbacks if i not in drawn]
    return new, fallbacks


def add_focus_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FOCUS (--init focus; docs/adaptation.md)")
    g.add_argument("--focus-corpus", default=None, metavar="PATH",
                   help="target-language text for FOCUS's fastText vectors: JSONL (.jsonl/.json, --focus-json-keys) "
                        "or plain text (one document per line); tokenized with the new tokenizer")
    g.add_argument("--focus-json-keys", nargs="+", default=["text"], help="keys of --focus-corpus whose text is used")
    g.add_argument("--focus-dim", type=int, default=300, help="fastText vector size")
    g.add_argument("--focus-epochs", type=int, default=3, help="fastText epochs over the corpus")
    g.add_argument("--focus-min-count", type=int, default=1,
                   help="a token seen fewer times has no vector and gets --focus-fallback")
    g.add_argument("--focus-temperature", type=float, default=1.0,
                   help="similarities are divided by it before sparsemax: lower keeps fewer, closer neighbours")
    g.add_argument("--focus-fallback", choices=FALLBACKS, default="mean",
                   help="rows of new tokens without a fastText vector: mean of their old pieces, or random "
                        "(N(mean, std) of the old rows per dimension, as FOCUS's code)")


def focus_options(args: argparse.Namespace, needed: bool, what: str) -> Optional[FocusOptions]:
    """The FOCUS options of ``args`` when ``needed`` (``what`` names the flag that asks for FOCUS), else
    None; every problem in one ValueError naming its flag."""
    if not needed:
        return None
    problems = []
    if not args.focus_corpus:
        problems.append(f"{what} needs --focus-corpus PATH: target-language text (JSONL or plain text) to train "
                        "the fastText vectors FOCUS picks neighbours by")
    elif not os.path.isfile(args.focus_corpus):
        problems.append(f"--focus-corpus {args.focus_corpus}: no such file")
    for flag, value in (("--focus-dim", args.focus_dim), ("--focus-epochs", args.focus_epochs),
                        ("--focus-min-count", args.focus_min_count)):
        if value < 1:
            problems.append(f"{flag} {value}: must be at least 1")
    if not args.focus_temperature > 0:
        problems.append(f"--focus-temperature {args.focus_temperature}: must be above 0")
    if problems:
        raise ValueError("; ".join(problems))
    vectors = VectorOptions(corpus=args.focus_corpus, json_keys=tuple(args.focus_json_keys), dim=args.focus_dim,
                            epochs=args.focus_epochs, min_count=args.focus_min_count)
    return FocusOptions(vectors=vectors, temperature=args.focus_temperature, fallback=args.focus_fallback)
