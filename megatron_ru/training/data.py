"""Training/validation batches from the GPT datasets, resumable at any consumed-sample count.

Sizes follow Megatron: train = train_iters × global batch; validation = (train_iters //
eval_interval + 1) × eval_iters × global batch. The test split is not read by training (no
samples are asked of it), so ``--split 98,2,0`` is fine. The sampler
splits each global batch into micro batches per data-parallel rank; every TP rank and every
pipeline stage of one data-parallel rank reads the same samples (they are cheap memory-mapped
reads), so no broadcast is needed. Position in the data = consumed samples, stored in checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from megatron_ru.data.documents import DocumentMasking
from megatron_ru.utils.processes import start_time

if TYPE_CHECKING:
    from megatron_ru.flags.arguments import Arguments


class SampleDataset(Protocol):
    """What the loop reads: GPT, blended and vocabulary-checked datasets alike."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]: ...


@dataclass
class Batch:
    tokens: torch.Tensor   # [b, s] inputs
    labels: torch.Tensor   # [b, s] next tokens
    #: packed documents (:class:`~megatron_ru.data.documents.DocumentMasking`), each [b, s]; None when off
    position_ids: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    #: --calculate-per-token-loss: the scalar the micro batch's masked loss sum is divided by
    loss_denominator: Optional[torch.Tensor] = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        return Batch(*(None if t is None else fn(t) for t in (
            self.tokens, self.labels, self.position_ids, self.document_ids, self.loss_mask, self.loss_denominator)))

    def to(self, device: torch.device) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "Batch":
        """Page-locked copies (the DataLoader calls this with ``pin_memory=True``), so that :meth:`to` a GPU
        is an asynchronous copy that overlaps the previous step instead of a host-blocking one."""
        return self._map(lambda t: t.pin_memory())

    def model_inputs(self) -> Any:
        """The first pipeline stage's input: ``tokens``, or ``(tokens, position_ids[, document_ids])``."""
        if self.position_ids is None:
            return self.tokens
        return (self.tokens, self.position_ids) + (() if self.document_ids is None else (self.document_ids,))

    def loss_targets(self) -> Any:
        """The loss's ``labels`` argument (:class:`~megatron_ru.model.gpt.GPTLoss`): ``labels``, or
        ``(labels, loss_mask[, denominator])``."""
        if self.loss_mask is None and self.loss_denominator is None:
            return self.labels
        mask = self.loss_mask if self.loss_mask is not None else torch.ones_like(self.labels, dtype=torch.float32)
        return (self.labels, mask) + (() if self.loss_denominator is None else (self.loss_denominator,))

    def for_context_parallel(self, cp_size: int, cp_rank: int) -> "Batch":
        """This context-parallel rank's tokens of the micro batch (:mod:`megatron_ru.parallel.context`: chunks
        ``cp_rank`` and ``2 x cp_size - 1 - cp_rank`` of each sample), each with its position and document
        (positions made explicit: RoPE needs a token's place in the sample). The loss's denominator is the
        whole micro batch's, divided by CP: the CP ranks' losses then average (as the gradients do over
        DP x CP) to the micro batch's mean, and a rank whose tokens are all masked adds 0, not NaN."""
        if cp_size == 1:
            return self
        from megatron_ru.parallel.context import split_sequence
        b, s = self.tokens.shape
        if self.loss_denominator is not None:
            denominator = self.loss_denominator / cp_size
        else:
            count = torch.tensor(float(self.labels.numel())) if self.loss_mask is None else \
                self.loss_mask.to(torch.float32).sum().clamp_min(1.0)
            denominator = (count / cp_size).to(torch.float32)
        positions = self.position_ids if self.position_ids is not None else \
            torch.arange(s, device=self.tokens.device).expand(b, s)

        def split(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else split_sequence(t, 1, cp_size, cp_rank)
        return Batch(split(self.tokens), split(self.labels), split(positions), split(self.document_ids),
                     split(self.loss_mask), denominator.to(self.tokens.device))

    def scored_tokens(self) -> int:
        """Tokens whose loss counts."""
        return self.labels.numel() if self.loss_mask is None else int(self.loss_mask.sum().item())


def collate(samples: list[dict[str, np.ndarray]], documents: Optional[DocumentMasking] = None) -> Batch:
    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))
    inputs = tokens[:, :-1].contiguous()
    batch = Batch(inputs, tokens[:, 1:].contiguous())
    if documents is not None and documents.active:
        batch.position_ids, batch.document_ids, batch.loss_mask = documents.apply(inputs)
    return batch


def document_masking(args: "Arguments", eod: int) -> Optional[DocumentMasking]:
    """The run's document flags (None when none is given)."""
    d = args.data
    documents = DocumentMasking(eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    return documents if documents.active else None


def per_token_denominators(batches: list[Batch], global_tokens: float, dp_size: int) -> list[Batch]:
    """``--calculate-per-token-loss``: each of this step's micro batches divides its masked loss sum by
    ``global_tokens / (micro batches x dp_size)`` (``global_tokens``: the unmasked tokens of the whole global
    batch). DeepSpeed averages the micro batches' losses and gradients over the accumulation steps and the
    data-parallel ranks, so the step's loss and gradient are those of the sum over all tokens divided by
    ``global_tokens``: Megatron-LM's per-token loss."""
    share = torch.tensor(max(global_tokens, 1.0) / (len(batches) * dp_size), dtype=torch.float32)
    for b in batches:
        b.loss_denominator = share.to(b.tokens.device)
    return batches


def validation_pass_samples(prefixes: Sequence[str], split: Sequence[float], seq_length: int) -> int:
    """Samples in one pass over the validation split of every dataset in ``prefixes`` (Megatron's
    count per epoch: ``(tokens - 1) // seq_length``; the index files only)."""
    from megatron_ru.data.checks import split_document_ranges
    from megatron_ru.data.indexed_dataset import IndexedDataset
    total = 0
    for prefix in prefixes:
        ds = IndexedDataset.open(prefix)
        start, end = split_document_ranges(ds.num_documents, split)[1]
        if end <= start:
            continue
        first, last = int(ds.document_indices[start]), int(ds.document_indices[end])
        tokens = int(np.asarray(ds.sequence_lengths[first:last], dtype=np.int64).sum())
        total += max(0, (tokens - 1) // seq_length)
    return total


def cap_eval_iters(args: "Arguments") -> None:
    """Make one evaluation read the validation split at most once: ``--eval-iters`` × global batch
    samples beyond it would read the same documents again (a 6-document split read 49 times) at a
    cost, without a better estimate. Lowers ``args.training.eval_iters`` (never below 1), with a
    one-line notice; every rank computes the same from the same index files."""
    t = args.training
    blend, split = args.blend, args.split
    if args.split_blends is not None:  # the validation datasets' documents, all of them
        blend, split = args.split_blends[1], (0.0, 1.0, 0.0)
    if t.eval_iters == 0 or blend is None or split is None:
        return
    prefixes = [p for d, p in enumerate(blend.prefixes) if blend.weights is None or blend.weights[d] > 0]
    one_pass = validation_pass_samples(prefixes, split, args.data.seq_length)
    wanted = t.eval_iters * args.global_batch_size
    if wanted <= one_pass:
        return
    capped = max(1, one_pass // args.global_batch_size)
    if capped >= t.eval_iters:
        return
    from megatron_ru.utils.logging import RANK0, get_logger
    get_logger(__name__).info(
        f"--eval-iters {t.eval_iters} asks {wanted:,} validation samples per evaluation, but the validation "
        f"split holds {one_pass:,} (one pass at --seq-length {args.data.seq_length}): evaluating {capped} "
        f"iteration(s) of {args.global_batch_size} samples each time (give --eval-iters {capped} or less, or a "
        f"larger validation share in --split, to silence this)", extra=RANK0)
    t.eval_iters = capped


class VocabCheckedDataset:
    """A train/valid dataset whose batches :func:`micro_batches` checks against the tokenizer's
    vocabulary (one max per batch; ids beyond it would silently train on padding rows)."""

    def __init__(self, dataset: Any, vocab_size: int, split: str) -> None:
        self.dataset, self.vocab_size, self.split = dataset, vocab_size, split

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return self.dataset[idx]

    def source(self, idx: int) -> str:
        """The prefix of the dataset that sample ``idx`` comes from."""
        ds = self.dataset
        if hasattr(ds, "dataset_index"):  # a blend: the component dataset of this sample
            ds = ds.datasets[int(ds.dataset_index[idx])]
        return ds.indexed.prefix

    def check(self, batch: Batch, indices: list[int]) -> None:
        tokens = batch.tokens
        top = max(int(tokens.max()), int(batch.labels[:, -1].max()))
        if top < self.vocab_size:
            return
        from megatron_ru.data.token_check import batch_token_error
        for idx in indices:
            sample = np.asarray(self[idx]["tokens"])
            if int(sample.max()) >= self.vocab_size:
                raise batch_token_error(self.source(idx), int(sample.max()), self.vocab_size, self.split)
        raise batch_token_error("?", top, self.vocab_size, self.split)


class MockDataset:
    """``--mock-data``: ``num_samples`` samples of ``seq_length + 1`` ids uniform in ``[0, vocab_size)``, sample ``i``
    of split ``split`` drawn by a generator seeded with ``(seed, split, i)``: the same at any layout and resume."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: int) -> None:
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split = seed, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, self.split, int(idx)))
        return {"tokens": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


def build_datasets(args: "Arguments", is_builder_rank: bool, barrier: Optional[Callable[[], None]],
                   vocab_size: Optional[int] = None
                   ) -> tuple[Optional[SampleDataset], Optional[SampleDataset], Optional[SampleDataset]]:
    """(train, valid, test); with ``vocab_size`` train and valid are :class:`VocabCheckedDataset`."""
    from megatron_ru.data.builder import build_train_valid_test_datasets, dataset_sizes
    cap_eval_iters(args)
    sizes = dataset_sizes(args.train_iters, args.global_batch_size, args.training.eval_interval,
                          args.training.eval_iters)
    if args.data.mock_data:
        vocab = vocab_size if vocab_size is not None else args.built_tokenizer().vocab_size
        return tuple(MockDataset(n, args.data.seq_length, vocab, args.training.seed, split)  # type: ignore[return-value]
                     for split, n in enumerate(sizes))
    train, valid, test = build_train_valid_test_datasets(args.data, args.blend, args.split or (1.0, 0.0, 0.0), sizes,
                                                         args.training.seed, is_builder_rank=is_builder_rank,
                                                         barrier=barrier, blend_per_split=args.split_blends)
    if vocab_size is not None:
        train = VocabCheckedDataset(train, vocab_size, "train") if train is not None else None
        valid = VocabCheckedDataset(valid, vocab_size, "valid") if valid is not None else None
    return train, valid, test


def micro_batches(dataset: Optional[SampleDataset], consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int, device: torch.device, num_workers: int = 0,
                  documents: Optional[DocumentMasking] = None) -> Optional[Iterator[Batch]]:
    """Endless-enough iterator of this rank's micro batches starting after ``consumed_samples``
    (None when there is no dataset, e.g. no validation split); ``documents``: the position ids, document
    ids and loss mask of packed documents, computed in the loader's workers."""
    if dataset is None or len(dataset) == 0:
        return None
    from megatron_ru.data.sampler import MegatronPretrainingSampler
    sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                         micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    # its own generator: creating a loader iterator draws a seed, which must not shift the global
    # RNG stream that dropout uses (a resumed run creates its loaders at a different point)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=functools.partial(collate, documents=documents), generator=torch.Generator().manual_seed(0),
                                         pin_memory=device.type == "cuda",
                                         # a worker ends with its rank, however the rank ends
                                         worker_init_fn=functools.partial(_worker_started, os.getpid(),
                                                                          start_time(os.getpid())))
    if isinstance(dataset, VocabCheckedDataset):
        # the loader yields batches in the sampler's order, so the second pass names each batch's samples
        return (_checked(dataset, batch, indices).to(device) for batch, indices in zip(loader, iter(sampler)))
    return (batch.to(device) for batch in loader)


def _worker_started(rank_pid: int, rank_start: Optional[str], worker_id: int) -> None:
    from megatron_ru.utils.processes import end_with_parent
    end_with_parent(rank_pid, rank_start)


def _checked(dataset: VocabCheckedDataset, batch: Batch, indices: list[int]) -> Batch:
    dataset.check(batch, indices)
    return batch


def pipeline_items(batches: Iterable[Batch]) -> Iterator[tuple[Any, Any]]:
    """(inputs, labels) tuples as DeepSpeed's pipeline engine reads them (:meth:`Batch.model_inputs`,
    :meth:`Batch.loss_targets`)."""
    for b in batches:
        yield b.model_inputs(), b.loss_targets()
