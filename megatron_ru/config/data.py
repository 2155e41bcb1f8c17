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


#: the keys of --per-split-data-args-path's JSON, in split order
SPLIT_KEYS = ("train", "valid", "test")


def parse_data_path(tokens: list[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, weights) from ``--data-path`` tokens (or another flag's of the same syntax, named ``flag`` in
    errors); weights is None for prefixes alone."""
    if not tokens:
        raise ValueError(f"{flag} is required: give dataset prefixes (e.g. 'corpus_text_document') "
                         "or weight/prefix pairs ('0.7 ru_text_document 0.3 en_text_document')")
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        return list(tokens), None
    if len(tokens) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise ValueError(f"{flag} {' '.join(tokens)!r}: mix of weights and prefixes; give either prefixes "
                         f"alone or weight/prefix pairs, e.g. '{flag} 0.7 ru_text_document 0.3 en_text_document'")
    weights = [float(t) for t in tokens[0::2]]
    if any(w < 0 or w != w or w == float("inf") for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag} weights {weights} must be finite, non-negative and not all zero")
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
    data_args_path: Optional[str] = arg(
        None, "A file holding --data-path's tokens (weights and prefixes separated by white space), for blends too "
              "long for a command line (Megatron-LM's flag; exclusive with --data-path).")
    train_data_path: Optional[list[str]] = arg(
        None, "The training datasets, as --data-path (weights and prefixes): every document of them trains; "
              "--split is not used. With --valid-data-path and --test-data-path, instead of --data-path "
              "(Megatron's separate per-split data).")
    valid_data_path: Optional[list[str]] = arg(
        None, "The validation datasets, as --data-path; all their documents (no --split). Without it and with "
              "--train-data-path there is no validation.")
    test_data_path: Optional[list[str]] = arg(
        None, "The test datasets, as --data-path (training reads no test samples; accepted and checked).")
    per_split_data_args_path: Optional[str] = arg(
        None, "A JSON file with keys train, valid, test, each --train/valid/test-data-path's tokens (a list or one "
              "white-space separated string): Megatron-LM's flag, exclusive with those three.")
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

    @property
    def per_split(self) -> bool:
        """Separate datasets per split (--train/valid/test-data-path or --per-split-data-args-path)."""
        return self.per_split_data_args_path is not None or any(
            p is not None for p in (self.train_data_path, self.valid_data_path, self.test_data_path))

    def data_path_tokens(self) -> list[str]:
        """--data-path's tokens, or those of the --data-args-path file (OSError when it cannot be read)."""
        if self.data_args_path is not None:
            with open(self.data_args_path, encoding="utf-8") as f:
                return f.read().split()
        return list(self.data_path or [])

    def split_path_tokens(self) -> list[Optional[list[str]]]:
        """The train, valid and test tokens of the per-split data (None: that split has none); a ValueError or
        OSError names a --per-split-data-args-path file that cannot be read or lacks a key."""
        if self.per_split_data_args_path is None:
            return [None if p is None else list(p) for p in (self.train_data_path, self.valid_data_path,
                                                             self.test_data_path)]
        import json
        where = f"--per-split-data-args-path {self.per_split_data_args_path}"
        with open(self.per_split_data_args_path, encoding="utf-8") as f:
            try:
                record = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict) or not all(k in record for k in SPLIT_KEYS):
            raise ValueError(f"{where}: expected a JSON object with the keys {', '.join(SPLIT_KEYS)} (each a list of "
                             f"weights and prefixes, or one string of them)")
        out: list[Optional[list[str]]] = []
        for key in SPLIT_KEYS:
            v = record[key]
            tokens = v.split() if isinstance(v, str) else v
            if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
                raise ValueError(f"{where}: {key!r} must be a list of strings or one string (got {v!r})")
            out.append(tokens or None)
        return out

    def _source_problems(self) -> list[str]:
        """Exactly one way to name the data (Megatron-LM's exclusions)."""
        ways = [name for name, given in (
            ("--data-path", self.data_path is not None), ("--data-args-path", self.data_args_path is not None),
            ("--train/valid/test-data-path", any(p is not None for p in (self.train_data_path, self.valid_data_path,
                                                                          self.test_data_path))),
            ("--per-split-data-args-path", self.per_split_data_args_path is not None),
            ("--mock-data", self.mock_data)) if given]
        if ways == ["--data-path", "--mock-data"]:
            return ["--mock-data trains on synthetic tokens and --data-path on a dataset: give one of them"]
        if len(ways) > 1:
            return [f"{' and '.join(ways)} each name the training data: give one of them"]
        return []

    def problems(self) -> list[str]:
        out: list[str] = self._source_problems()
        if out:
            return out
        flags_and_tokens: list[tuple[str, list[str]]] = []
        try:
            if self.per_split:
                names = ("--train-data-path", "--valid-data-path", "--test-data-path")
                tokens = self.split_path_tokens()
                if tokens[0] is None:
                    out.append(f"{'--per-split-data-args-path has no train datasets' if self.per_split_data_args_path else '--valid-data-path or --test-data-path without --train-data-path'}: "
                               "training needs --train-data-path (or use --data-path with --split)")
                flags_and_tokens = [(n, t) for n, t in zip(names, tokens) if t is not None]
            elif not self.mock_data:
                flags_and_tokens = [("--data-path", self.data_path_tokens())]
        except (ValueError, OSError) as exc:
            out.append(str(exc) if isinstance(exc, ValueError) else
                       f"{self.data_args_path or self.per_split_data_args_path}: cannot be read ({exc})")
        for flag, tokens in flags_and_tokens:
            try:
                prefixes, _ = parse_data_path(tokens, flag)
            except ValueError as exc:
                out.append(str(exc))
                continue
            for prefix in prefixes:
                missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.exists(p)]
                if missing:
                    out.append(f"{flag}: dataset {prefix!r} not found ({', '.join(missing)} missing); "
                               "give the prefix written by tools/preprocess_data.py, without .bin/.idx")
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
