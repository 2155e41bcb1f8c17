"""MegatronPretrainingSampler: rank partition, exact resume, tails, errors."""
from __future__ import annotations

import itertools

import pytest

from megatron_ru.data.sampler import MegatronPretrainingSampler


def _streams(total, consumed, mbs, dp, drop_last=True):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]


@pytest.mark.parametrize("total,mbs,dp", [(100, 2, 4), (37, 3, 2), (12, 1, 1), (50, 4, 3)])
def test_ranks_partition_consecutive_slots(total, mbs, dp):
    streams = _streams(total, 0, mbs, dp)
    steps = len(streams[0])
    assert steps == total // (mbs * dp) and all(len(s) == steps for s in streams)
    flat = [i for step in range(steps) for r in range(dp) for i in streams[r][step]]
    assert flat == list(range(steps * mbs * dp))  # every sample once, in order, ranks interleaved
    for r in range(dp):
        assert len(MegatronPretrainingSampler(total, 0, mbs, r, dp)) == steps


@pytest.mark.parametrize("total,mbs,dp", [(100, 2, 4), (61, 3, 2), (40, 1, 5)])
def test_resume_at_any_step_is_the_exact_tail(total, mbs, dp):
    slot = mbs * dp
    full = _streams(total, 0, mbs, dp)
    for step in range(len(full[0]) + 1):
        resumed = _streams(total, step * slot, mbs, dp)
        for r in range(dp):
            assert resumed[r] == full[r][step:]


@pytest.mark.parametrize("consumed", range(0, 30))
def test_resume_at_any_consumed_count_continues_the_sample_stream(consumed):
    # a consumed count that is not a whole slot (e.g. after changing DP size): the global
    # stream restarts at exactly that sample, slots counted from there (Megatron's behaviour)
    total, mbs, dp = 30, 2, 3
    streams = _streams(total, consumed, mbs, dp)
    flat = [i for step in zip(*streams) for batch in step for i in batch]
    slots = (total - consumed) // (mbs * dp)
    assert flat == list(range(consumed, consumed + slots * mbs * dp))


def test_keep_last_partial_batch():
    streams = _streams(11, 0, 2, 2, drop_last=False)  # slots [0..3] [4..7] + tail 8, 9, 10
    assert streams[0] == [[0, 1], [4, 5], [8, 9]]
    assert streams[1] == [[2, 3], [6, 7], [10]]
    assert [len(MegatronPretrainingSampler(11, 0, 2, r, 2, drop_last=False)) for r in (0, 1)] == [3, 3]
    streams = _streams(9, 0, 2, 2, drop_last=False)  # tail is only sample 8: rank 1 gets nothing
    assert streams[1] == [[2, 3], [6, 7]] and streams[0][-1] == [8]
    assert [len(MegatronPretrainingSampler(9, 0, 2, r, 2, drop_last=False)) for r in (0, 1)] == [3, 2]


def test_consumed_equal_total_yields_nothing():
    assert list(MegatronPretrainingSampler(8, 8, 2, 0, 2)) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_samples=0), "no samples"),
    (dict(consumed_samples=11), "consumed_samples=11 is outside"),
    (dict(micro_batch_size=0), "--micro-batch-size"),
    (dict(dp_rank=2), "rank 2 is not in"),
])
def test_errors(kwargs, match):
    args = dict(total_samples=10, consumed_samples=0, micro_batch_size=1, dp_rank=0, dp_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MegatronPretrainingSampler(**args)


def test_works_as_a_torch_batch_sampler():
    import torch
    data = list(range(100, 120))
    sampler = MegatronPretrainingSampler(20, 4, 2, 1, 2)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    got = [b.tolist() for b in itertools.islice(loader, 3)]
    assert got == [[106, 107], [110, 111], [114, 115]]
