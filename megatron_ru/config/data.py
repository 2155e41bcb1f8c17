"""Data configuration: datasets and blend weights, split, sample construction, index cache.

``--data-path`` takes Megatron's syntax: prefixes alone (``corpus_text_document``, blended
by token count when several) or weight/prefix pairs (``0.7 ru_text_document 0.3
en_text_document``). A prefix names the ``<prefix>.bin``/``<prefix>.idx`` pair written by
tools/preprocess_data.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg

SAMPLE_START_MODES = ("any", "document", "paragraph")


def parse_data_path(tokens: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, weights) from ``--data-path`` tokens; weights is None for prefixes alone."""
    if not tokens:
        raise ValueError("--data-path is required: give dataset prefixes (e.g. 'corpus_text_document') "
                         "or weight/prefix pairs ('0.7 ru_text_document 0.3 en_text_document')")
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        return list(tokens), None
    if len(tokens) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise ValueError(f"--data-path {' '.join(tokens)!r}: mix of weights and prefixes; give either prefixes "
                         "alone or weight/prefix pairs, e.g. '--data-path 0.7 ru_text_document 0.3 en_text_document'")
    weights = [float(t) for t in tokens[0::2]]
    if any(w < 0 or w != w or w == float("inf") for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights {weights} must be finite, non-negative and not all zero")
    return list(tokens[1::2]), weights


def parse_split(split: str) -> list[float]:
    """Megatron's ``--split``: up to three comma- (or slash-) separated proportions, normalized."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three numbers like '969,30,1' (train,valid,test)") from None
    if len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: give at most three non-negative proportions with a positive sum, "
                         "like '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


@dataclass
class DataConfig:
    """Data: datasets, blending, split, sample construction, index cache."""

    data_path: Optional[list[str]] = arg(
        None, "Dataset prefixes (without .bin/.idx), optionally as weight/prefix pairs for blending: "
              "'0.7 ru_text_document 0.3 en_text_document'. Prefixes alone are blended by token count.")
    split: str = arg("969,30,1", "Train,valid,test proportions of each dataset's documents (Megatron syntax).")
    data_cache_path: Optional[str] = arg(
        None, "Directory for the cached sample indices (.npy), shared by all nodes. Default: "
              "'index-cache/' next to the data when writable, else a directory under the system temp dir.")
    seq_length: int = arg(1024, "Tokens per training sample (each sample reads seq-length + 1 tokens).")
    sample_start: str = arg(
        "any", "Where samples may start: 'any' token (Megatron: samples span documents back to back), or "
               "only at a 'document' or 'paragraph' start (the tokens skipped to reach the next boundary "
               "are reported when the index is built).", choices=SAMPLE_START_MODES)
    mock_data: bool = arg(False, "Synthetic tokens instead of --data-path, for throughput runs (Megatron-LM's "
                                 "flag): every sample is seq-length + 1 ids drawn uniformly from the vocabulary by a "
                                 "generator seeded with --seed and the sample's index, so any layout and a resume "
                                 "read the same samples.")
    reset_position_ids: bool = arg(
        False, "Documents packed into one sample (separated by the tokenizer's end-of-document token) restart "
               "their position ids at 0 after each EOD (Megatron's flag).")
    reset_attention_mask: bool = arg(
        False, "Tokens attend only within their own document of a packed sample: a block-diagonal causal mask "
               "that ends each document with its EOD token (Megatron's flag).")
    eod_mask_loss: bool = arg(
        False, "Mask the loss at positions whose input token is the end-of-document token (Megatron's flag).")
    num_workers: int = arg(2, "DataLoader worker processes per rank.")
    mmap_warmup: bool = arg(False, "Read the dataset indices once at start-up to warm the page cache.")

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.mock_data and self.data_path:
            out.append("--mock-data trains on synthetic tokens and --data-path on a dataset: give one of them")
        try:
            prefixes, _ = parse_data_path(list(self.data_path or [])) if not self.mock_data else ([], None)
            for prefix in prefixes:
                missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.exists(p)]
                if missing:
                    out.append(f"--data-path: dataset {prefix!r} not found ({', '.join(missing)} missing); "
                               "give the prefix written by tools/preprocess_data.py, without .bin/.idx")
        except ValueError as exc:
            out.append(str(exc))
        try:
            parse_split(self.split)
        except ValueError as exc:
            out.append(str(exc))
        if self.seq_length < 1:
            out.append(f"--seq-length must be >= 1 (got {self.seq_length})")
        if self.num_workers < 0:
            out.append(f"--num-workers must be >= 0 (got {self.num_workers})")
        if self.sample_start not in SAMPLE_START_MODES:
            out.append(f"--sample-start must be one of {', '.join(SAMPLE_START_MODES)} (got {self.sample_start!r})")
        if self.data_cache_path and os.path.exists(self.data_cache_path) and not os.path.isdir(self.data_cache_path):
            out.append(f"--data-cache-path {self.data_cache_path!r} exists and is not a directory")
        return out
