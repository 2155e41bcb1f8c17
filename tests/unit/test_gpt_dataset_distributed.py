"""Index build on real gloo ranks: rank 0 builds and caches, the others wait and load it."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from megatron_ru.config.data import DataConfig
from tests.dist_utils import run_distributed
from test_gpt_dataset import write_corpus

pytestmark = pytest.mark.slow


def _rank(rank: int, world_size: int, prefix: str, cache_dir: str):
    import torch.distributed as dist

    from megatron_ru.data import gpt_dataset
    from megatron_ru.data.builder import build_train_valid_test_datasets, resolve_data
    builds = []
    real = gpt_dataset.build_gpt_indices

    def counting(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)
    gpt_dataset.build_gpt_indices = counting
    cfg = DataConfig(data_path=[prefix], split="90,10,0", seq_length=16, data_cache_path=cache_dir,
                     sample_start="paragraph")
    blend, split = resolve_data(cfg, (200, 20, 0))
    train, valid, test = build_train_valid_test_datasets(cfg, blend, split, (200, 20, 0), seed=7,
                                                         is_builder_rank=(rank == 0), barrier=dist.barrier)
    digest = hashlib.sha256()
    for ds in (train, valid):
        for i in range(len(ds)):
            digest.update(ds[i]["tokens"].tobytes())
    return len(builds), digest.hexdigest(), test is None


def test_builder_rank_builds_once_and_every_rank_reads_the_same_samples(tmp_path):
    rng = np.random.default_rng(0)
    write_corpus(str(tmp_path / "c"), [list(rng.integers(1, 30, size=3)) for _ in range(60)])
    results = run_distributed(_rank, world_size=2, args=(str(tmp_path / "c"), str(tmp_path / "cache")), timeout=120)
    assert [r[0] for r in results] == [2, 0]  # train + valid built on rank 0 only
    assert results[0][1] == results[1][1]
    assert all(r[2] for r in results)
