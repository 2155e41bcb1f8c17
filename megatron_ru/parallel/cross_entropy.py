"""Cross-entropy over vocab-parallel logits, without ever gathering the full vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. The softmax
normaliser is built from two all-reduces of per-token scalars (max, sum of exp) and the
target logit from a third, so communication is O(tokens), not O(tokens × vocab).
Columns at or beyond ``vocab_size`` (padding added to make the vocabulary divisible by
``--make-vocab-size-divisible-by`` × TP) are excluded from the softmax, so the loss and its
gradient do not depend on how much padding a layout needed. Computed in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ru.parallel.utils import ProcessGroup, group_rank, group_size


def _all_reduce_(t: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> None:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        rank = group_rank(group)
        per_rank = logits.shape[-1]
        start = rank * per_rank
        work = logits.float()
        # padded vocabulary entries: never a valid prediction, excluded from max and softmax
        valid = per_rank if vocab_size is None else max(0, min(per_rank, vocab_size - start))
        if valid == per_rank:
            logits_max = work.max(dim=-1).values
        elif valid > 0:
            logits_max = work[..., :valid].max(dim=-1).values
        else:
            logits_max = work.new_full(work.shape[:-1], float("-inf"))
        _all_reduce_(logits_max, dist.ReduceOp.MAX, group)
        work = work - logits_max.unsqueeze(-1)             # a new tensor: the input stays intact
        if valid < per_rank:
            work[..., valid:] = float("-inf")

        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce_(target_logit, dist.ReduceOp.SUM, group)

        exp = work.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce_(sum_exp, dist.ReduceOp.SUM, group)
        loss = torch.log(sum_exp) - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target), the onehot living on one rank only;
        # a new tensor, so the saved softmax survives a retain_graph re-run
        grad = softmax * grad_loss.unsqueeze(-1)
        hit = (outside.to(grad.dtype) - 1.0) * grad_loss
        grad.scatter_add_(-1, local_target.unsqueeze(-1), hit.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp_group: ProcessGroup | None = None,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [...] from vocab-parallel ``logits`` [..., padded_vocab/tp] and global
    ``target`` ids [...]. ``vocab_size`` (the unpadded size) masks padded columns out."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not match: "
                         f"expected logits of shape target.shape + (vocab/tp,)")
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size)
