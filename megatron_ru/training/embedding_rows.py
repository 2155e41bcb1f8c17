"""``--train-embedding-rows new``: only the vocabulary rows an adaptation initialised learn.

``tools/adapt_vocab.py`` records the rows it initialised with the checkpoint
(``CheckpointMeta.vocab_adaptation["new_rows"]``). With ``--train-only-embeddings
--train-embedding-rows new`` the input embedding and the output layer train on those rows only;
every other row (the kept vocabulary, and the padding rows of the layout) stays bit-identical:

* their gradient is zeroed as it is produced (a tensor hook), so Adam's moments for them stay zero
  and its update is exactly zero — at every precision and ZeRO stage, and the gradient norm counts
  the trained rows only;
* AdamW's decoupled weight decay would still shrink them (``p *= 1 - lr·wd`` touches every row), so
  after each inner optimizer step their fp32 master values are put back: on the parameter itself
  when the optimizer works on it (fp32, ZeRO 0), else in this rank's fragment of DeepSpeed's fp32
  master partition (``_hp_mapping``: bf16, ZeRO 1/2), before DeepSpeed copies the masters into the
  model's weights — a local copy, no communication.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.deepspeed_bridge.masters import after_inner_step, fp32_master_fragment
from megatron_ru.model.spec import VOCAB_WEIGHTS, canonical_named_parameters
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)


def new_rows_of(meta: Any, load: Optional[str]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges a checkpoint's vocabulary adaptation initialised."""
    record = getattr(meta, "vocab_adaptation", None) if meta is not None else None
    if not record or not record.get("new_rows"):
        raise ValueError(f"--train-embedding-rows new: the checkpoint in --load {load} records no vocabulary "
                         "adaptation (tools/adapt_vocab.py writes it); use --train-embedding-rows all")
    return [(int(a), int(b)) for a, b in record["new_rows"]]


class KeptRows:
    """The values of this rank's embedding/output shards that must not change: for each, the fp32
    tensor the optimizer updates (the parameter itself, or this rank's fragment of DeepSpeed's fp32
    master partition), the flat positions of kept values in it, and those values as loaded."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, vocab_size: int, new_rows: list[tuple[int, int]],
                 tp_rank: int) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        trained = 0
        for name, p in canonical_named_parameters(model, cfg):
            if name not in VOCAB_WEIGHTS or id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            rows = p.shape[0]
            global_rows = torch.arange(tp_rank * rows, (tp_rank + 1) * rows)
            train = torch.zeros(rows, dtype=torch.bool)
            for a, b in new_rows:
                train |= (global_rows >= a) & (global_rows < min(b, vocab_size))
            trained += int(train.sum())
            if bool(train.all()):
                continue
            trained_rows = train.to(device=p.device, dtype=p.dtype).unsqueeze(1)
            p.register_hook(lambda g, m=trained_rows: g * m)
            keep = (~train).unsqueeze(1).expand(p.shape).reshape(-1)     # per flat element
            target, start = fp32_master_fragment(p)
            if target is None or target.numel() == 0:
                continue
            idx = keep[start:start + target.numel()].nonzero().flatten().to(target.device)
            if len(idx):
                self.entries.append((target, idx, target[idx].clone()))
        log_rank0(log, f"--train-embedding-rows new: {trained} rows train on this rank's shards; the others are "
                       f"kept as loaded")

    @torch.no_grad()
    def restore(self) -> None:
        """Put the kept values back into the fp32 masters (after an inner optimizer step, before
        DeepSpeed copies the masters into the model's weights); local, no communication."""
        for target, idx, values in self.entries:
            target[idx] = values


def restore_after_step(engine: Any, kept: KeptRows) -> None:
    """Make the engine's inner optimizer put the kept rows back after every step it takes."""
    if kept.entries:
        after_inner_step(engine, kept.restore)
