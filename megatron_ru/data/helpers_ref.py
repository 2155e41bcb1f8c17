"""Pure-Python/numpy reference of the C++ dataset-index helpers (csrc/helpers.cpp).

Same signatures and results as :mod:`megatron_ru.data.helpers`; tests compare the two on
random inputs. The spanning and boundary builders are written differently from the C++
loops on purpose (from global token positions with ``searchsorted``) so that the comparison
checks two independent derivations of the same contract, not one loop transcribed twice.

Vocabulary: ``sizes[d]`` is the token count of document ``d``; ``doc_idx`` is the stream of
documents over all epochs (shuffled); a row ``(p, o)`` of a sample index means "token ``o``
of document ``doc_idx[p]``".
"""
from __future__ import annotations

import numpy as np

from megatron_ru.data.helpers import index_dtype_for


def _stream_starts(sizes: np.ndarray, doc_idx: np.ndarray, index_dtype: type) -> np.ndarray:
    """starts[p] = tokens of the stream before position p (length len(doc_idx) + 1)."""
    limit = np.iinfo(index_dtype).max
    if len(doc_idx) >= limit:
        raise ValueError(f"doc_idx has {len(doc_idx)} entries, too many for this index dtype; use the int64 variant")
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    bad = np.flatnonzero((doc_idx < 0) | (doc_idx >= len(sizes)))
    if bad.size:
        p = int(bad[0])
        raise ValueError(f"doc_idx[{p}] = {doc_idx[p]} is not a document id (there are {len(sizes)} documents)")
    stream = sizes[doc_idx]
    if stream.size and (stream.min() < 0 or stream.max() >= limit):
        raise ValueError("a document size is outside what this index dtype holds; use the int64 variant")
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(stream, out=starts[1:])
    return starts


def _rows(starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(doc_idx position, offset) of global token positions (each inside a non-empty document)."""
    pos = np.searchsorted(starts, positions, side="right") - 1
    return np.stack([pos, positions - starts[pos]], axis=1)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, *, index_dtype: type | None = None) -> np.ndarray:
    """Megatron's spanning sample index: sample k covers global tokens k*S .. (k+1)*S.

    Row 0 is (0, 0); row k >= 1 is the document position and offset of global token
    ``k * seq_length``, the last token of sample k-1 and the first of sample k.
    """
    if seq_length <= 0 or num_epochs <= 0 or tokens_per_epoch <= 0:
        raise ValueError("seq_length, num_epochs and tokens_per_epoch must be positive")
    sizes = np.asarray(sizes, dtype=np.int64)
    if index_dtype is None:
        index_dtype = index_dtype_for(len(doc_idx), int(sizes.max()) if sizes.size else 0)
    starts = _stream_starts(sizes, doc_idx, index_dtype)
    if starts[-1] < num_epochs * tokens_per_epoch:
        raise ValueError(f"doc_idx holds {starts[-1]} tokens, fewer than num_epochs * tokens_per_epoch = "
                         f"{num_epochs * tokens_per_epoch}")
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=index_dtype)
    out[1:] = _rows(starts, np.arange(1, num_samples + 1, dtype=np.int64) * seq_length)
    return out


def global_boundaries(sizes: np.ndarray, doc_idx: np.ndarray, starts: np.ndarray,
                      boundary_ptr: np.ndarray, boundary_off: np.ndarray) -> np.ndarray:
    """Sorted global token positions of every boundary in the stream (inside its document)."""
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    counts = (boundary_ptr[1:] - boundary_ptr[:-1])[doc_idx]
    first = np.repeat(boundary_ptr[:-1][doc_idx], counts)
    # index of each boundary within its document's run: 0, 1, ... per stream position
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    offsets = boundary_off[first + within]
    pos = np.repeat(np.arange(len(doc_idx)), counts)
    keep = offsets < sizes[doc_idx][pos]
    return starts[pos[keep]] + offsets[keep]


def build_boundary_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                              boundary_ptr: np.ndarray, boundary_off: np.ndarray, *,
                              index_dtype: type | None = None) -> np.ndarray:
    """Every sample starts at a boundary; the next starts at the first boundary >= start + S.

    Samples are made while seq_length + 1 tokens remain from the start; the last row is where
    the next sample would start, or (len(doc_idx), 0) when no boundary is left.
    """
    if seq_length <= 0:
        raise ValueError("seq_length must be positive")
    sizes = np.asarray(sizes, dtype=np.int64)
    boundary_ptr = np.asarray(boundary_ptr, dtype=np.int64)
    boundary_off = np.asarray(boundary_off, dtype=np.int64)
    if len(boundary_ptr) != len(sizes) + 1:
        raise ValueError("boundary_ptr must have one entry per document plus one")
    if boundary_ptr[0] != 0 or boundary_ptr[-1] != len(boundary_off) or np.any(np.diff(boundary_ptr) < 0):
        raise ValueError("boundary_ptr must start at 0, be non-decreasing and end at len(boundary_off)")
    step = np.diff(boundary_off)
    same_doc = np.ones(len(step), dtype=bool)
    inner = boundary_ptr[1:-1]
    same_doc[inner[(inner > 0) & (inner < len(boundary_off))] - 1] = False
    if np.any((step < 0) & same_doc):
        raise ValueError("boundary offsets of a document are not ascending")
    if index_dtype is None:
        index_dtype = index_dtype_for(len(doc_idx), int(sizes.max()) if sizes.size else 0)
    starts = _stream_starts(sizes, doc_idx, index_dtype)
    total = int(starts[-1])
    bounds = global_boundaries(sizes, doc_idx, starts, boundary_ptr, boundary_off)
    chosen: list[int] = []
    k = 0
    while k < len(bounds) and bounds[k] + seq_length + 1 <= total:
        chosen.append(int(bounds[k]))
        k = int(np.searchsorted(bounds, bounds[k] + seq_length, side="left"))
    out = np.zeros((len(chosen) + 1, 2), dtype=index_dtype)
    if chosen:
        out[:-1] = _rows(starts, np.asarray(chosen, dtype=np.int64))
    out[-1] = _rows(starts, bounds[k:k + 1])[0] if k < len(bounds) else (len(doc_idx), 0)
    return out


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample i goes to argmax_d weight_d * max(i, 1) - taken_d."""
    weights = [float(w) for w in np.asarray(weights, dtype=np.float64)]
    if not 1 <= len(weights) <= 255:
        raise ValueError(f"blending needs 1 to 255 datasets, got {len(weights)}")
    if any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError("weights must be finite non-negative numbers")
    if size < 0:
        raise ValueError("size must be non-negative")
    taken = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - t for w, t in zip(weights, taken)]
        best = errors.index(max(errors))  # first maximum, like the C++ strict '>'
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index
