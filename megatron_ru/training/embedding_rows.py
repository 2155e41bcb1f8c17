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
  when the optimizer works on it (fp32, ZeRO 0), else through DeepSpeed's high-precision mapping
  (``safe_get/set_full_fp32_param``: bf16, ZeRO 1/2), before DeepSpeed copies the masters into the
  model's weights.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import EMBEDDING, OUTPUT_LAYER, canonical_named_parameters
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

ROW_PARAMS = (f"{EMBEDDING}.word_embeddings.weight", f"{OUTPUT_LAYER}.weight")


def new_rows_of(meta: Any, load: Optional[str]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` row ranges a checkpoint's vocabulary adaptation initialised."""
    record = getattr(meta, "vocab_adaptation", None) if meta is not None else None
    if not record or not record.get("new_rows"):
        raise ValueError(f"--train-embedding-rows new: the checkpoint in --load {load} records no vocabulary "
                         "adaptation (tools/adapt_vocab.py writes it); use --train-embedding-rows all")
    return [(int(a), int(b)) for a, b in record["new_rows"]]


class KeptRows:
    """The rows of this rank's embedding/output shards that must not change, and their values."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, vocab_size: int, new_rows: list[tuple[int, int]],
                 tp_rank: int) -> None:
        self.entries: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        trained = 0
        for name, p in canonical_named_parameters(model, cfg):
            if name not in ROW_PARAMS or id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            rows = p.shape[0]
            first = tp_rank * rows
            global_rows = torch.arange(first, first + rows)
            train = torch.zeros(rows, dtype=torch.bool)
            for a, b in new_rows:
                train |= (global_rows >= a) & (global_rows < min(b, vocab_size))
            keep = (~train).nonzero().flatten().to(p.device)
            trained += int(train.sum())
            if len(keep) == 0:
                continue
            values = p.detach()[keep].to(torch.float32).clone()
            mask = (~train).to(device=p.device, dtype=p.dtype).unsqueeze(1)
            p.register_hook(lambda g, m=mask: g * (1 - m).to(g.dtype))
            self.entries.append((p, keep, values))
        log_rank0(log, f"--train-embedding-rows new: {trained} rows train on this rank's shards; the others are "
                       f"kept as loaded")

    @torch.no_grad()
    def restore(self) -> None:
        """Put the kept rows' fp32 master values back (after an inner optimizer step)."""
        for p, keep, values in self.entries:
            if hasattr(p, "_hp_mapping") and p._hp_mapping is not None:
                from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
                full = safe_get_full_fp32_param(p)
                full[keep] = values.to(full.device)
                safe_set_full_fp32_param(p, full)
            else:
                p.data[keep] = values.to(p.dtype)


def restore_after_step(optimizer: torch.optim.Optimizer, kept: KeptRows) -> None:
    """Make ``optimizer.step`` put the kept rows back after every step it takes."""
    if not kept.entries:
        return
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        kept.restore()
        return out

    optimizer.step = step  # type: ignore[method-assign]
