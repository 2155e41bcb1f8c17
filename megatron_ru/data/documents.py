"""Documents packed back to back into one sample, separated by the end-of-document token (EOD).

Megatron's flags and meaning (``get_ltor_masks_and_position_ids``), computed here without a loop over the
documents: a document ends *with* its EOD token (the EOD belongs to the document it closes), the next one
starts at the token after it.

* ``--reset-position-ids``: position ids restart at 0 at each document's first token;
* ``--reset-attention-mask``: a token attends only to earlier tokens of its own document; the model builds
  that block-diagonal causal mask from the per-token document ids returned here
  (:func:`megatron_ru.model.transformer.document_causal_mask`);
* ``--eod-mask-loss``: the loss of every position whose *input* token is EOD is masked (its label, the
  first token of the next document, cannot be predicted from this one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def document_ids_and_positions(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, position ids), both int64 [b, s], of input tokens [b, s]: the document of token t
    is the number of EOD tokens before t; its position counts from its document's first token."""
    is_eod = tokens == eod
    ends = is_eod.long()
    document_ids = ends.cumsum(-1) - ends
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    # the next document starts after each EOD; a token's document starts at the last such start before it
    next_start = torch.where(is_eod, index + 1, torch.zeros_like(index))
    starts = torch.zeros_like(index)
    starts[..., 1:] = next_start[..., :-1]
    return document_ids, index - starts.cummax(-1).values


@dataclass(frozen=True)
class DocumentMasking:
    """What the batch of a run with Megatron's document flags carries besides tokens and labels."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def apply(self, tokens: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                                   Optional[torch.Tensor]]:
        """(position ids, document ids, loss mask) for input tokens [b, s]; None where the flag is off.
        With ``--reset-attention-mask`` the position ids are always given (0..s-1 without
        ``--reset-position-ids``): a pipeline stage receives them together with the document ids."""
        position_ids = document_ids = loss_mask = None
        if self.reset_position_ids or self.reset_attention_mask:
            document_ids, positions = document_ids_and_positions(tokens, self.eod)
            if self.reset_position_ids:
                position_ids = positions
            else:
                position_ids = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens).contiguous()
            if not self.reset_attention_mask:
                document_ids = None
        if self.eod_mask_loss:
            loss_mask = (tokens != self.eod).float()
        return position_ids, document_ids, loss_mask
