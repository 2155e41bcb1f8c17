"""GPT pretraining samples of ``seq_length + 1`` tokens over an :class:`IndexedDataset`.

``dataset[i]`` is ``{"tokens": np.ndarray[int64] of length seq_length + 1}``; the training side
takes ``tokens[:-1]`` as input and ``tokens[1:]`` as labels.

Units. A *document* is one entry of the ``.idx`` document index (with ``--split-paragraphs``
it holds several sequences, its paragraphs; otherwise exactly one sequence). Documents are
what gets split (train/valid/test), shuffled and concatenated; inside a document the
sequences are read in order. For datasets with one sequence per document (Megatron's
preprocessing) this is exactly Megatron-LM's GPT dataset.

Index construction (Megatron-LM's, ``megatron/data/gpt_dataset.py``):

* ``num_epochs`` = the fewest passes over the split whose tokens give ``num_samples``
  samples: the smallest E with ``(E * tokens_per_epoch - 1) // seq_length >= num_samples``.
* ``doc_idx``: the split's document ids repeated E times and shuffled as one array by
  ``np.random.RandomState(seed)``. When the last epoch would be used for less than 80 % of
  its samples it is shuffled separately ("separate last epoch"), so that the samples drawn
  from it do not displace the full epochs' samples.
* ``sample_idx`` (C++, csrc/helpers.cpp): row k = (position in doc_idx, token offset) of
  the start of sample k; in the default mode consecutive samples share one token (the last
  label of one is the first input of the next), exactly like Megatron.
* ``shuffle_idx``: permutation of the samples by the same RNG; with a separate last epoch the
  samples of the first E-1 epochs and those of the last epoch are permuted separately and
  concatenated. ``len(dataset)`` is the number of built samples (>= the requested count).

Boundary-start mode (``--sample-start document|paragraph``): every sample starts at a
document (or paragraph) start; it reads ``seq_length + 1`` tokens across boundaries like the
default mode, and the next sample starts at the first boundary at or after its token
``seq_length`` (where the default mode would start it). Tokens between that point and the
next boundary are never an input; their share is logged when the index is built and kept as
``dataset.skipped_share``. Epochs are added until the requested samples exist. With E > 1
epochs, doc_idx is always the first E-1 epochs shuffled together followed by the last epoch
shuffled alone (the sample count per epoch is only known after building), and the samples
that start in the last epoch are shuffled apart when fewer than 80 % of an epoch's samples
are needed from it (Megatron's rule, on sample counts).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from megatron_ru.config.data import SAMPLE_START_MODES
from megatron_ru.data import helpers, helpers_ref
from megatron_ru.data.cache import IndexCache, dataset_fingerprint, default_cache_dir, get_or_build
from megatron_ru.data.indexed_dataset import IndexedDataset
from megatron_ru.utils.logging import RANK0, get_logger

log = get_logger(__name__)

INDEX_VERSION = 2  # bump when the construction changes: it is part of the cache key


@dataclass
class GPTIndices:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    num_epochs: int
    skipped_share: float | None = None  # boundary-start modes only


@dataclass
class DocumentLayout:
    """Per-document token counts and, for boundary-start modes, boundary offsets (CSR)."""
    sizes: np.ndarray          # int64[num_documents]
    boundary_ptr: np.ndarray   # int64[num_documents + 1]
    boundary_off: np.ndarray   # int64[...] token offsets inside each document, ascending

    @classmethod
    def from_lengths(cls, sequence_lengths: np.ndarray, document_indices: np.ndarray,
                     sample_start: str) -> "DocumentLayout":
        doc_first = np.asarray(document_indices, dtype=np.int64)
        sizes = document_sizes(sequence_lengths, doc_first)
        if sample_start == "paragraph":
            seq_start = np.zeros(len(sequence_lengths) + 1, dtype=np.int64)
            np.cumsum(sequence_lengths, out=seq_start[1:])
            doc_of_seq = np.repeat(np.arange(len(sizes)), np.diff(doc_first))
            offsets = seq_start[:-1] - seq_start[doc_first[:-1]][doc_of_seq]
            return cls(sizes, doc_first.copy(), offsets)
        # "document" (and unused for "any"): one boundary per document, at its start
        return cls(sizes, np.arange(len(sizes) + 1, dtype=np.int64), np.zeros(len(sizes), np.int64))


def document_sizes(sequence_lengths: np.ndarray, document_indices: np.ndarray) -> np.ndarray:
    """Tokens per document (int64), without a per-sequence temporary."""
    doc_first = np.asarray(document_indices, dtype=np.int64)
    sizes = np.zeros(len(doc_first) - 1, dtype=np.int64)
    # reduceat over the starts of non-empty documents only: each sums up to the next such start,
    # which is exactly its own sequences (documents in between hold none)
    nonempty = doc_first[:-1] < doc_first[1:]
    if nonempty.any():
        sizes[nonempty] = np.add.reduceat(np.asarray(sequence_lengths), doc_first[:-1][nonempty], dtype=np.int64)
    return sizes


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E >= 1 with (E * tokens_per_epoch - 1) // seq_length >= num_samples (Megatron's loop)."""
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    """Megatron's rule: shuffle the last epoch apart when under 80 % of its samples are used."""
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - from_full_epochs < int(0.80 * per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    dtype = np.int32 if len(documents) * num_epochs < np.iinfo(np.int32).max and (
        len(documents) == 0 or documents.max() < np.iinfo(np.int32).max) else np.int64
    if not separate_last or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def skipped_token_share(layout: DocumentLayout, doc_idx: np.ndarray, sample_idx: np.ndarray, seq_length: int) -> float:
    """Share of the tokens from the first sample's start to the last sample's input end that no
    sample uses as input (boundary-start modes)."""
    n = len(sample_idx) - 1
    if n < 2:
        return 0.0
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(layout.sizes[np.asarray(doc_idx, dtype=np.int64)], out=starts[1:])
    g = starts[sample_idx[:n, 0].astype(np.int64)] + sample_idx[:n, 1]
    span = int(g[-1] - g[0]) + seq_length
    return float(span - n * seq_length) / span


def build_gpt_indices(layout: DocumentLayout, documents: np.ndarray, num_samples: int, seq_length: int,
                      seed: int, sample_start: str = "any", *, use_cpp: bool = True) -> GPTIndices:
    """doc_idx, sample_idx and shuffle_idx for ``documents`` (see the module docstring)."""
    impl: Any = helpers if use_cpp else helpers_ref
    documents = np.asarray(documents)
    tokens_per_epoch = int(layout.sizes[documents].sum()) if len(documents) else 0
    if tokens_per_epoch <= 0:
        raise ValueError(f"the {len(documents)} documents selected hold no tokens; nothing to sample from")
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    if sample_start == "any":
        separate = separate_last_epoch(epochs, tokens_per_epoch, seq_length, num_samples)
        rng = np.random.RandomState(seed)
        doc_idx = build_doc_idx(documents, epochs, rng, separate)
        sample_idx = impl.build_sample_idx(layout.sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
        total = len(sample_idx) - 1
        first = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
        return GPTIndices(doc_idx, sample_idx, build_shuffle_idx(first, total, rng), epochs)
    if sample_start not in SAMPLE_START_MODES:
        raise ValueError(f"--sample-start {sample_start!r}: choose one of {', '.join(SAMPLE_START_MODES)}")
    while True:  # boundary starts skip tokens, so the sample count per epoch is only known after building
        rng = np.random.RandomState(seed)
        doc_idx = build_doc_idx(documents, epochs, rng, epochs > 1)
        sample_idx = impl.build_boundary_sample_idx(layout.sizes, doc_idx, seq_length,
                                                    layout.boundary_ptr, layout.boundary_off)
        made = len(sample_idx) - 1
        if made >= num_samples:
            break
        epochs += max(1, math.ceil((num_samples - made) * epochs / made)) if made else epochs
    first = made
    if epochs > 1:  # Megatron's rule on sample counts: samples starting in the first E-1 epochs
        from_full = int(np.searchsorted(sample_idx[:made, 0], (epochs - 1) * len(documents)))
        if num_samples - from_full < int(0.80 * from_full / (epochs - 1)):
            first = from_full
    shuffle_idx = build_shuffle_idx(first, made, rng)
    share = skipped_token_share(layout, doc_idx, sample_idx, seq_length)
    return GPTIndices(doc_idx, sample_idx, shuffle_idx, epochs, share)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``document_range`` of ``indexed``.

    Indices are built on the builder rank, cached under ``cache_dir`` (default: next to the
    data) and loaded by every rank after ``barrier`` (see :mod:`megatron_ru.data.cache`).
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, *, name: str = "train", sample_start: str = "any",
                 cache_dir: str | None = None, is_builder_rank: bool = True,
                 barrier: Callable[[], None] | None = None) -> None:
        # --seq-length, --sample-start and the split (documents holding tokens) were validated with
        # the configuration (megatron_ru/data/checks.py); these are the caller's invariants
        start, end = (int(x) for x in document_range)
        assert 0 <= start < end <= indexed.num_documents and seq_length > 0 and num_samples >= 0, \
            (name, indexed.prefix, document_range, seq_length, num_samples)
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        self.sample_start = sample_start
        # per-document sizes are all that reading needs; boundaries are only built with the index
        self.doc_sizes = document_sizes(indexed.sequence_lengths, indexed.document_indices)
        description = {"kind": "gpt", "version": INDEX_VERSION, "data": dataset_fingerprint(indexed.prefix),
                       "documents": [start, end], "num_samples": int(num_samples), "seq_length": int(seq_length),
                       "seed": int(seed), "sample_start": sample_start}
        cache = IndexCache(cache_dir or default_cache_dir(indexed.prefix),
                           f"{_basename(indexed.prefix)}-{name}", description)

        def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            t0 = time.perf_counter()
            layout = DocumentLayout.from_lengths(indexed.sequence_lengths, indexed.document_indices, sample_start)
            idx = build_gpt_indices(layout, np.arange(start, end), num_samples, seq_length, seed, sample_start)
            meta = {"num_epochs": idx.num_epochs, "skipped_share": idx.skipped_share,
                    "seconds": round(time.perf_counter() - t0, 3)}
            log.info("built %s indices for %s: %d samples (%d asked) over %d epoch(s) of documents [%d, %d) in %.2f s",
                     name, indexed.prefix, len(idx.shuffle_idx), num_samples, idx.num_epochs, start, end, meta["seconds"])
            return {"doc_idx": idx.doc_idx, "sample_idx": idx.sample_idx, "shuffle_idx": idx.shuffle_idx}, meta

        def check(entry: IndexCache, arrays: dict[str, np.ndarray]) -> None:
            _check_cached_indices(entry, arrays, indexed.num_documents)

        arrays, meta, _ = get_or_build(cache, build, is_builder_rank=is_builder_rank, barrier=barrier, check=check)
        self.cache_stem = cache.stem
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]
        self.num_epochs = int(meta["num_epochs"])
        self.skipped_share: float | None = meta.get("skipped_share")
        if self.skipped_share is not None:
            log.info("%s (%s): --sample-start %s skips %.2f%% of the tokens (never an input)", name,
                     indexed.prefix, sample_start, 100.0 * self.skipped_share, extra=RANK0)

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {n} samples")
        row = int(self.shuffle_idx[idx])
        pos, offset = int(self.sample_idx[row, 0]), int(self.sample_idx[row, 1])
        return {"tokens": self._read(pos, offset, self.seq_length + 1)}

    def _read(self, pos: int, offset: int, count: int) -> np.ndarray:
        """``count`` tokens of the document stream from (doc_idx position, offset)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            doc = int(self.doc_idx[pos])
            take = min(count - filled, int(self.doc_sizes[doc]) - offset)
            if take > 0:
                self._read_document(doc, offset, out[filled:filled + take])
                filled += take
            pos, offset = pos + 1, 0
        return out

    def _read_document(self, doc: int, offset: int, dest: np.ndarray) -> None:
        """Tokens ``offset:offset+len(dest)`` of document ``doc``, read sequence by sequence."""
        first, last = int(self.indexed.document_indices[doc]), int(self.indexed.document_indices[doc + 1])
        lengths = self.indexed.sequence_lengths
        seq = first
        if last - first > 1:  # find the paragraph holding the offset
            ends = np.cumsum(lengths[first:last], dtype=np.int64)
            k = int(np.searchsorted(ends, offset, side="right"))
            seq, offset = first + k, offset - (int(ends[k - 1]) if k else 0)
        done = 0
        while done < len(dest):
            assert seq < last, "read past the end of a document"
            take = min(len(dest) - done, int(lengths[seq]) - offset)
            dest[done:done + take] = self.indexed.get(seq, offset, take)
            done += take
            seq, offset = seq + 1, 0


def _check_cached_indices(cache: IndexCache, arrays: dict[str, np.ndarray], num_documents: int) -> None:
    """Shapes and value ranges of indices read from the cache (one pass over each array), so that a
    damaged file is an error naming it now, not an IndexError (or another document's tokens) later."""
    expected = {"doc_idx": 1, "sample_idx": 2, "shuffle_idx": 1}
    for name, ndim in expected.items():
        a = arrays.get(name)
        if a is None or a.ndim != ndim or (name == "sample_idx" and (a.shape[1] != 2 or a.shape[0] < 1)):
            raise cache.damaged(cache.path(name), f"shape {None if a is None else list(a.shape)}")
    doc_idx, sample_idx, shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]
    bounds = {"doc_idx": (doc_idx, num_documents), "sample_idx": (sample_idx[:, 0], len(doc_idx) + 1),
              "shuffle_idx": (shuffle_idx, len(sample_idx) - 1)}
    for name, (values, limit) in bounds.items():
        if len(values) and (int(values.min()) < 0 or int(values.max()) >= max(limit, 1)):
            raise cache.damaged(cache.path(name), f"values outside [0, {limit})")


def _basename(prefix: str) -> str:
    return os.path.basename(prefix.rstrip("/")) or "data"
