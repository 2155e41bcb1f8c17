"""``layout_shard`` (model/spec.py): a rank's part of a canonical tensor at a TP size, the vocabulary
matrices padded with zero rows; the loader's memory depends on it cutting before padding."""
import pytest
import torch

from megatron_ru.model.spec import ParamSpec, layout_shard
from megatron_ru.parallel.utils import shard_tensor


def _reference(spec, full, rows, tp, rank):
    """Pad the whole matrix, then split it: the definition."""
    if spec.vocab and rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))], dim=0)
    if spec.partition_dim is None or tp == 1:
        return full
    return shard_tensor(full, spec.partition_dim, rank, tp, spec.partition_stride)


def _spec():
    return ParamSpec(name="embedding.word_embeddings.weight", shape=(10, 4), layer_index=0, partition_dim=0,
                     partition_stride=1, vocab=True)


@pytest.mark.parametrize("rows,tp", [(12, 1), (12, 2), (12, 3), (12, 4), (16, 4), (10, 2), (24, 8)])
def test_vocab_rows_cut_then_padded_equal_padding_then_cutting(rows, tp):
    full = torch.arange(40, dtype=torch.float32).view(10, 4) + 1
    spec = _spec()
    for rank in range(tp):
        got = layout_shard(spec, full, rows, tp, rank)
        want = _reference(spec, full, rows, tp, rank)
        assert got.shape == want.shape and torch.equal(got, want), (rows, tp, rank)


def test_a_rank_wholly_in_the_padding_gets_zeros_and_no_copy_of_the_matrix():
    full = torch.ones(10, 4)
    spec = _spec()
    assert torch.equal(layout_shard(spec, full, 16, 4, 3), torch.zeros(4, 4))  # rows 12-15: all padding
    first = layout_shard(spec, full, 16, 4, 0)  # rows 0-3: a view of the file's tensor, not a copy
    assert first.data_ptr() == full.data_ptr()


def test_freed_memory_goes_back_to_the_system():
    """``release_freed_memory`` (the loader calls it per layer) runs malloc_trim on glibc; after many
    freed blocks below glibc's mmap threshold the resident set shrinks."""
    import platform

    from megatron_ru.utils.memory import release_freed_memory

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2 ** 20

    if platform.libc_ver()[0] != "glibc":
        assert release_freed_memory() is False
        return
    blocks = [torch.ones(2 ** 18) for _ in range(800)]  # 1 MiB each, 800 MiB: heap blocks, not mappings
    keep = blocks[::8]
    del blocks
    before = rss_mib()
    assert release_freed_memory() is True
    after = rss_mib()
    assert before - after > 300, (before, after)
    del keep


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("saved_tp,tp", [(1, 2), (2, 4), (1, 4), (2, 1), (4, 2), (4, 1), (2, 2)])
def test_a_shard_from_the_saved_shards_it_overlaps_equals_the_cut_of_the_whole(stride, saved_tp, tp):
    """What the reader's ``_reslice`` relies on: a part of one saved shard (TP a multiple of the saved one) or
    the join of consecutive saved shards (a divisor) is the cut of the whole tensor, for any partition stride."""
    from megatron_ru.parallel.utils import unshard_tensors
    full = torch.randn(stride * 8 * 3, 5)
    saved = [shard_tensor(full, 0, t, saved_tp, stride) for t in range(saved_tp)]
    for rank in range(tp):
        want = shard_tensor(full, 0, rank, tp, stride)
        if tp % saved_tp == 0:
            k = tp // saved_tp
            got = shard_tensor(saved[rank // k], 0, rank % k, k, stride)
        else:
            k = saved_tp // tp
            got = unshard_tensors(saved[rank * k: rank * k + k], 0, stride)
        assert torch.equal(got, want), (rank, stride, saved_tp, tp)
