"""Start-up checks of the datasets named by ``--data-path`` against the rest of the configuration,
run with the other validation before any process group exists: every index opens and is
consistent, each split that samples are asked of receives documents holding tokens, and the
token ids fit the tokenizer's vocabulary. Only the ``.idx`` files and a sample of documents are
read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_ru.data.indexed_dataset import IndexedDataset
from megatron_ru.data.token_check import dataset_vocab_problems

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class DataBlend:
    """The resolved ``--data-path``: dataset prefixes and their weights (None: by token count)."""
    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]]


def split_document_ranges(num_documents: int, proportions: Sequence[float]) -> list[tuple[int, int]]:
    """Megatron's split: round each share of the documents, then shift to end at the total."""
    bounds = [0]
    for p in proportions:
        bounds.append(bounds[-1] + int(round(p * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [min(max(b - diff, 0), num_documents) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(proportions))]


def split_problems(ds: IndexedDataset, proportions: Sequence[float], split_flag: str,
                   num_samples: Sequence[int]) -> list[str]:
    """Each split that samples are asked of must receive documents, and they must hold tokens."""
    out = []
    lengths, doc_index = None, None
    for s, (start, end) in enumerate(split_document_ranges(ds.num_documents, proportions)):
        if num_samples[s] <= 0:
            continue
        name = SPLIT_NAMES[s]
        why = ("--eval-iters > 0 asks for validation samples" if name == "valid" else
               "training asks for samples" if name == "train" else f"{num_samples[s]} samples are asked of it")
        if end <= start:
            out.append(f"--split {split_flag}: the {name} split of {ds.prefix} receives no documents (its share of the "
                       f"{ds.num_documents} documents rounds to zero), but {why}; give the {name} split a larger "
                       f"share in --split" + (", or pass --eval-iters 0 to skip validation" if name == "valid" else "")
                       + ", or use a larger corpus")
            continue
        if lengths is None:
            lengths, doc_index = ds.sequence_lengths, ds.document_indices
        first, last = int(doc_index[start]), int(doc_index[end])
        if int(np.asarray(lengths[first:last]).sum(dtype=np.int64)) == 0:
            out.append(f"--split {split_flag}: the {name} split of {ds.prefix} (documents [{start}, {end})) holds no "
                       f"tokens; adjust --split or rebuild the dataset with tools/preprocess_data.py")
    return out


def data_problems(blend: DataBlend, proportions: Sequence[float], split_flag: str, num_samples: Sequence[int],
                  vocab_size: Optional[int]) -> list[str]:
    """Every problem of the datasets with this split, these sample counts and vocabulary."""
    out: list[str] = []
    weights = blend.weights or (1.0,) * len(blend.prefixes)
    for prefix, weight in zip(blend.prefixes, weights):
        try:
            ds = IndexedDataset.open(prefix)
        except (ValueError, OSError) as e:
            out.append(f"--data-path {prefix}: {e}")
            continue
        if weight > 0:
            out += split_problems(ds, proportions, split_flag, num_samples)
        if vocab_size is not None:
            out += dataset_vocab_problems(ds, vocab_size)
    return out
