"""Train/valid/test datasets from a :class:`DataConfig`: split each dataset, then blend.

Each ``--data-path`` dataset's documents are split by ``--split`` (Megatron's rounding), a
:class:`GPTDataset` is built per split with Megatron's 0.5 % over-request when blending, and
the splits are blended with the ``--data-path`` weights (or token counts when no weights are
given). Datasets of weight 0 are left out of the blend.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from megatron_ru.config.data import DataConfig, parse_data_path, parse_split
from megatron_ru.data.blended import BlendedDataset, samples_per_dataset
from megatron_ru.data.checks import DataBlend, data_problems, split_document_ranges
from megatron_ru.data.gpt_dataset import GPTDataset
from megatron_ru.data.indexed_dataset import IndexedDataset
from megatron_ru.utils.logging import RANK0, get_logger
from megatron_ru.utils import cli

log = get_logger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def dataset_sizes(train_iters: int, global_batch: int, eval_interval: int, eval_iters: int) -> tuple[int, int, int]:
    """Samples each split must provide (train, valid, test): every iteration's global batch, and
    ``eval_iters`` global batches per evaluation (one every ``eval_interval`` iterations and one at the end)."""
    eval_runs = (train_iters // eval_interval + 1) if eval_interval > 0 else 1
    return (train_iters * global_batch, eval_runs * eval_iters * global_batch, 0)


def _split_dataset(indexed: IndexedDataset, split: int, doc_range: tuple[int, int], num_samples: int,
                   cfg: DataConfig, seed: int, is_builder_rank: bool,
                   barrier: Optional[Callable[[], None]]) -> Optional[GPTDataset]:
    if num_samples == 0 and doc_range[1] <= doc_range[0]:
        return None
    return GPTDataset(indexed, doc_range, num_samples, cfg.seq_length, seed, name=SPLIT_NAMES[split],
                      sample_start=cfg.sample_start, cache_dir=cfg.data_cache_path,
                      is_builder_rank=is_builder_rank, barrier=barrier)


def build_train_valid_test_datasets(data_cfg: DataConfig, blend: Optional[DataBlend], split: Sequence[float],
                                    train_val_test_num_samples: tuple[int, int, int], seed: int, *,
                                    is_builder_rank: bool, barrier: Optional[Callable[[], None]],
                                    blend_per_split: Optional[Sequence[Optional[DataBlend]]] = None
                                    ) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets; each has ``len`` and ``[i] -> {"tokens": int64[seq_length + 1]}``,
    or is None when its split has no documents and no samples were asked of it.

    ``blend`` is cut into the splits by ``split``; ``blend_per_split`` (--train/valid/test-data-path) gives each
    split its own datasets, all of whose documents it reads (None: that split has none). Both are resolved and
    checked once, before this is called (by ``parse_arguments``, or :func:`resolve_data` for direct use):
    nothing is re-validated here."""
    nums = [int(n) for n in train_val_test_num_samples]
    if blend_per_split is not None:
        return tuple(None if b is None or nums[s] == 0 else  # type: ignore[return-value]
                     _build_split(s, b, None, nums[s], data_cfg, seed, is_builder_rank, barrier)
                     for s, b in enumerate(blend_per_split))
    assert blend is not None
    if len(blend.prefixes) == 1:  # no blending: each split's dataset, also one without samples asked of it
        ds = _open(blend, data_cfg)[0]
        return tuple(_split_dataset(ds, s, r, nums[s], data_cfg, seed, is_builder_rank, barrier)  # type: ignore
                     for s, r in enumerate(split_document_ranges(ds.num_documents, split)))
    return tuple(None if nums[s] == 0 else  # type: ignore[return-value]
                 _build_split(s, blend, split, nums[s], data_cfg, seed, is_builder_rank, barrier) for s in range(3))


def _open(blend: DataBlend, data_cfg: DataConfig) -> list[IndexedDataset]:
    indexed = [IndexedDataset.open(p) for p in blend.prefixes]
    if data_cfg.mmap_warmup:
        for ds in indexed:  # touch every page of the index arrays once
            _ = (int(ds.sequence_lengths.sum(dtype=np.int64)), int(ds.sequence_pointers.sum()),
                 int(ds.document_indices.sum()))
    return indexed


def _build_split(s: int, blend: DataBlend, split: Optional[Sequence[float]], num_samples: int, data_cfg: DataConfig,
                 seed: int, is_builder_rank: bool, barrier: Optional[Callable[[], None]]) -> Any:
    """Split ``s``'s dataset of ``num_samples`` from ``blend``: each dataset's share of documents by ``split``
    (None: all of them), blended by the weights (token counts when none; weight 0 left out)."""
    indexed = _open(blend, data_cfg)
    ranges = [split_document_ranges(ds.num_documents, split)[s] if split is not None else (0, ds.num_documents)
              for ds in indexed]
    if len(indexed) == 1:
        return _split_dataset(indexed[0], s, ranges[0], num_samples, data_cfg, seed, is_builder_rank, barrier)
    weights = list(blend.weights) if blend.weights is not None else [float(ds.num_tokens) for ds in indexed]
    keep = [d for d, w in enumerate(weights) if w > 0]
    if len(keep) < len(indexed) and (split is None or s == 0):  # said once per blend
        log.info("%s: leaving out datasets of weight 0: %s", "--data-path" if split is not None else
                 f"--{SPLIT_NAMES[s]}-data-path", ", ".join(blend.prefixes[d] for d in range(len(indexed))
                                                             if d not in keep), extra=RANK0)
    per = samples_per_dataset([weights[d] for d in keep], num_samples)
    parts = [_split_dataset(indexed[d], s, ranges[d], n, data_cfg, seed, is_builder_rank, barrier)
             for d, n in zip(keep, per)]
    return BlendedDataset(parts, [weights[d] for d in keep], num_samples, name=SPLIT_NAMES[s])


def resolve_data(data_cfg: DataConfig, train_val_test_num_samples: Sequence[int],
                 vocab_size: Optional[int] = None) -> tuple[DataBlend, tuple[float, float, float]]:
    """Validate ``data_cfg`` with these sample counts (and vocabulary) and resolve it, for callers
    without ``parse_arguments`` (the index-cache CLI below, tests): one ValueError lists every
    problem."""
    problems = data_cfg.problems()
    if not problems:
        prefixes, weights = parse_data_path(list(data_cfg.data_path or []))
        blend = DataBlend(tuple(prefixes), None if weights is None else tuple(weights))
        split = tuple(parse_split(data_cfg.split))
        problems = data_problems(blend, split, data_cfg.split, train_val_test_num_samples, vocab_size)
    if problems:
        raise ValueError("invalid data configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    return blend, split  # type: ignore[return-value]


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    """Build (or check) the index cache ahead of a job, e.g. on a login node, and describe it:

        python -m megatron_ru.data.builder --data-path 0.7 ru_text_document 0.3 en_text_document \\
            --seq-length 2048 --train-samples 1000000 --valid-samples 10000 --data-cache-path /shared/cache
    """
    import argparse

    from megatron_ru.config.base import accept_negative_numbers, add_config_arguments, from_namespace
    parser = accept_negative_numbers(cli.ArgumentParser(
        description="Build the GPT dataset index cache and describe the datasets."))
    add_config_arguments(parser, DataConfig)
    parser.add_argument("--train-samples", type=int, required=True)
    parser.add_argument("--valid-samples", type=int, default=0)
    parser.add_argument("--test-samples", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234, help="Same as the training --seed.")
    ns = parser.parse_args(argv)
    cfg = from_namespace(DataConfig, ns)
    nums = (ns.train_samples, ns.valid_samples, ns.test_samples)
    blend, split = resolve_data(cfg, nums)
    datasets = build_train_valid_test_datasets(cfg, blend, split, nums, ns.seed, is_builder_rank=True, barrier=None)
    lines = []
    for split, ds in zip(SPLIT_NAMES, datasets):
        if ds is None:
            lines.append(f"{split}: none")
            continue
        parts = ds.datasets if isinstance(ds, BlendedDataset) else [ds]
        desc = "; ".join(f"{p.indexed.prefix} docs {p.doc_idx.size // max(p.num_epochs, 1)} x {p.num_epochs} epoch(s), "
                         f"{len(p)} samples" + (f", {100 * p.skipped_share:.2f}% skipped" if p.skipped_share is not None else "")
                         for p in parts)
        lines.append(f"{split}: {len(ds)} samples of {cfg.seq_length + 1} tokens ({desc})")
    for line in lines:
        cli.emit(line)
    return lines


if __name__ == "__main__":
    main()
