"""Token ids against the tokenizer's vocabulary: at start-up on a sample of each dataset, and on
every batch (one max).

A dataset built with another tokenizer than the one given for training is the likeliest data
mistake after changing tokenizers. Ids at or above the tokenizer's (unpadded) vocabulary size
either land in the padding rows of the embedding (zero vectors, masked in the loss: training
"works" on garbage) or overflow the loss; both must be an error naming the dataset, the id and
the vocabulary size.
"""
from __future__ import annotations

import os

import numpy as np

from megatron_ru.data.indexed_dataset import IndexedDataset

# Megatron-LM's and tools/preprocess_data.py's writers store token ids as uint16 (vocabulary
# under 65,500) or int32; uint8/int64 are accepted as unambiguous. Anything else in a header is a
# corrupt dtype code or a file that does not hold token ids.
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64))

SAMPLE_DOCUMENTS = 1024
SAMPLE_TOKENS = 1 << 20  # 2-4 MB per dataset read by every rank at start-up


def _fix(prefix: str, vocab_size: int) -> str:
    return (f"{os.path.basename(prefix)} was built with another tokenizer than the one given (vocabulary of "
            f"{vocab_size} ids): pass the tokenizer flags it was preprocessed with, or rebuild it with "
            f"tools/preprocess_data.py and this tokenizer")


def token_dtype_problem(ds: IndexedDataset, vocab_size: int) -> str | None:
    """Whether the dataset's token dtype can hold this vocabulary's ids and is one a token writer uses."""
    if ds.dtype not in TOKEN_DTYPES:
        return (f"--data-path {ds.prefix}: its index stores tokens as {ds.dtype}, which no tokenizer writer "
                f"produces (tools/preprocess_data.py and Megatron-LM write uint16 or int32): the dtype code in "
                f"{ds.prefix}.idx is corrupt or the file does not hold token ids; rebuild it with "
                f"tools/preprocess_data.py")
    top = int(np.iinfo(ds.dtype).max)
    if vocab_size - 1 > top:
        return (f"--data-path {ds.prefix}: tokens are stored as {ds.dtype} (ids up to {top}), too narrow for the "
                f"tokenizer's {vocab_size} ids; {_fix(ds.prefix, vocab_size)}")
    return None


def sampled_id_range(ds: IndexedDataset, max_documents: int = SAMPLE_DOCUMENTS,
                     max_tokens: int = SAMPLE_TOKENS) -> tuple[int, int] | None:
    """(smallest, largest) token id over up to ``max_documents`` documents spread evenly over the
    dataset (first and last included), reading at most ``max_tokens`` tokens; None if empty."""
    n = ds.num_documents
    if n <= 0:
        return None
    docs = np.unique(np.linspace(0, n - 1, num=min(n, max_documents)).round().astype(np.int64))
    per_doc = max(1, max_tokens // len(docs))
    lo, hi = None, None
    for d in docs:
        budget = per_doc
        for seq in range(int(ds.document_indices[d]), int(ds.document_indices[d + 1])):
            take = min(budget, int(ds.sequence_lengths[seq]))
            if take <= 0:
                continue
            tokens = ds.get(seq, 0, take)
            t_lo, t_hi = int(tokens.min()), int(tokens.max())
            lo = t_lo if lo is None else min(lo, t_lo)
            hi = t_hi if hi is None else max(hi, t_hi)
            budget -= take
            if budget <= 0:
                break
    return None if lo is None else (lo, hi)


def dataset_vocab_problems(ds: IndexedDataset, vocab_size: int) -> list[str]:
    """Start-up check of one dataset against the tokenizer's vocabulary size (unpadded)."""
    problem = token_dtype_problem(ds, vocab_size)
    if problem:
        return [problem]
    found = sampled_id_range(ds)
    if found is None:
        return []
    lo, hi = found
    if hi >= vocab_size:
        return [f"--data-path {ds.prefix}: token id {hi} is outside the tokenizer's vocabulary of {vocab_size} ids "
                f"(0..{vocab_size - 1}); {_fix(ds.prefix, vocab_size)}"]
    if lo < 0:
        return [f"--data-path {ds.prefix}: negative token id {lo}; the dtype code in {ds.prefix}.idx is corrupt or "
                f"the data is not token ids; rebuild it with tools/preprocess_data.py"]
    return []


def batch_token_error(prefix: str, bad_id: int, vocab_size: int, split: str) -> ValueError:
    """The error for an out-of-vocabulary id met in a batch during training."""
    return ValueError(f"{split} batch: token id {bad_id} from dataset {prefix} is outside the tokenizer's "
                      f"vocabulary of {vocab_size} ids (0..{vocab_size - 1}); {_fix(prefix, vocab_size)}")
