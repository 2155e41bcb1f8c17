"""``layout_shard`` (model/shards.py): a rank's part of a canonical tensor at a TP size, the vocabulary
matrices padded with zero rows; the loader's memory depends on it cutting before padding."""
import pytest
import torch

from megatron_ru.model.spec import ParamSpec
from megatron_ru.model.shards import layout_shard
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


@pytest.mark.parametrize("stride,dim", [(1, 0), (2, 0), (3, 0), (1, 1)])
@pytest.mark.parametrize("saved_tp,tp", [(1, 2), (2, 4), (1, 4), (2, 1), (4, 2), (4, 1), (2, 2), (2, 3), (3, 2),
                                         (4, 3), (3, 4)])
def test_a_shard_from_the_saved_shards_it_overlaps_equals_the_cut_of_the_whole(stride, dim, saved_tp, tp):
    """``shard_from_saved`` (what the loader reads at another TP size) equals splitting the whole tensor, for
    any pair of TP sizes and any stride, and reads only the saved shards the rank's shard overlaps."""
    from megatron_ru.model.shards import shard_from_saved
    shape = [5, 5]
    shape[dim] = stride * 12 * 2
    full = torch.randn(*shape)
    spec = ParamSpec(name="w", shape=tuple(shape), layer_index=1, partition_dim=dim, partition_stride=stride)
    saved = [shard_tensor(full, dim, t, saved_tp, stride) for t in range(saved_tp)]
    for rank in range(tp):
        touched = set()

        def read(t):
            touched.add(t)
            return saved[t]
        got = shard_from_saved(spec, read, shape[dim], shape[dim], saved_tp, shape[dim], tp, rank)
        assert torch.equal(got, shard_tensor(full, dim, rank, tp, stride)), (rank, stride, saved_tp, tp)
        block = shape[dim] // stride // tp
        saved_block = shape[dim] // stride // saved_tp
        assert touched == set(range(rank * block // saved_block, ((rank + 1) * block - 1) // saved_block + 1))


@pytest.mark.parametrize("saved_rows,saved_tp,rows,tp", [(12, 2, 16, 4), (16, 4, 12, 2), (12, 3, 12, 2),
                                                         (16, 2, 24, 3), (10, 1, 12, 4), (24, 8, 10, 1)])
def test_vocabulary_rows_padded_differently_come_from_the_saved_shards(saved_rows, saved_tp, rows, tp):
    """A vocabulary matrix saved padded for one TP size and loaded at another padded differently: the real rows
    come from the saved shards, the padding rows are zeros, whatever the saved padding held."""
    from megatron_ru.model.shards import shard_from_saved
    full = torch.arange(40, dtype=torch.float32).view(10, 4) + 1
    spec = _spec()
    saved = [layout_shard(spec, full, saved_rows, saved_tp, t).clone() for t in range(saved_tp)]
    for s in saved:  # the saved padding rows hold garbage: they must not leak into the result
        s[(s == 0).all(dim=1)] = 7.0
    for rank in range(tp):
        got = shard_from_saved(spec, lambda t: saved[t], 10, saved_rows, saved_tp, rows, tp, rank)
        assert torch.equal(got, _reference(spec, full, rows, tp, rank)), (saved_rows, saved_tp, rows, tp, rank)
