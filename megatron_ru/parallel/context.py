"""Context parallelism: one sample's sequence split over the ranks of a context-parallel (CP) group, its
attention computed exactly as one process computes it.

**Which tokens a rank holds.** The sequence is cut into 2 x CP equal chunks; CP rank r holds chunks r and
2 x CP - 1 - r (Megatron-LM's load balancing: under the causal rule a late chunk attends to more keys than an
early one, and each rank gets one of each). ``seq_length`` must be a multiple of 2 x CP. A token keeps its
place in the whole sample: its *token index* (0 .. s-1, what the causal rule and a sliding window compare),
its RoPE position and its document id (packed documents, ``--reset-attention-mask``) travel with it.

**Two exchanges**, the same result:

- **ring** (``--cp-comm-type p2p``): each rank keeps its queries and passes its keys/values around the
  group; a rank computes its queries against each block in turn and merges the partial results with their
  log-sum-exp. The backward is its own ring: the key/value blocks travel again with the gradients
  accumulated for them and arrive back at their owner after CP steps.
- **all-to-all** (``--cp-comm-type a2a``, DeepSpeed-Ulysses): an all-to-all turns sequence slices of all
  heads into all tokens of a slice of the heads; each rank attends over the whole sequence for its heads;
  a second all-to-all turns the result back. Heads per TP rank must be divisible by CP; key/value groups
  fewer than CP are repeated (CP divisible by them), as DeepSpeed and Megatron do for GQA.

**Memory that grows linearly with the sequence.** Both exchanges compute attention blockwise (:data:`TILE`
queries x :data:`TILE` keys at a time, merged by log-sum-exp; the backward recomputes each tile's
probabilities): no rank builds a sequence x sequence mask or score matrix, and tiles that the causal rule,
the window or the documents rule out entirely are skipped.

Masks are built from token indices and document ids, so a document that crosses chunk boundaries, an odd
document length and a row of queries that sees no key of a block all give the one-process result; a row
that sees no key at all (never the case under the causal rule: a token sees itself) gives zeros, not NaN.
Attention dropout is not supported with CP (refused at start-up by the caller).

Tensor layout: ``q`` [b, heads, s_local, d], ``k``/``v`` [b, groups, s_local, d] (heads = groups x r, head
i uses group i // r, as torch's SDPA with ``enable_gqa``), the local tokens in the order of
:func:`local_token_indices`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["local_token_indices", "split_sequence", "check_sequence", "check_a2a_heads", "ring_attention",
           "a2a_attention", "attention_reference", "context_attention", "enable_context_parallel", "COMM_TYPES"]

#: --cp-comm-type values that run here
COMM_TYPES = ("p2p", "a2a")
#: queries and keys per tile of the blockwise attention: whatever the sequence length, the scores held at once
#: are (heads x TILE x TILE) floats, and tiles in which no query sees a key are skipped
TILE = 512


def check_sequence(seq_length: int, cp_size: int) -> None:
    if seq_length % (2 * cp_size):
        raise ValueError(f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size = "
                         f"{2 * cp_size} (each CP rank holds two of 2 x CP equal chunks): use a sequence length "
                         f"that is a multiple of {2 * cp_size}")


def check_a2a_heads(heads_per_tp_rank: int, groups_per_tp_rank: int, cp_size: int) -> None:
    """The all-to-all exchange splits the heads of each TP rank over CP."""
    if heads_per_tp_rank % cp_size:
        raise ValueError(f"--cp-comm-type a2a splits the attention heads over the CP group: {heads_per_tp_rank} "
                         f"heads per tensor-parallel rank are not divisible by --context-parallel-size {cp_size}; "
                         "use a CP size that divides them, or --cp-comm-type p2p (no head rule)")
    if groups_per_tp_rank % cp_size and cp_size % groups_per_tp_rank:
        raise ValueError(f"--cp-comm-type a2a: {groups_per_tp_rank} key/value groups per tensor-parallel rank "
                         f"and --context-parallel-size {cp_size}: one must divide the other (fewer groups than "
                         "CP are repeated); use --cp-comm-type p2p otherwise")


def local_token_indices(seq_length: int, cp_size: int, cp_rank: int,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """The token indices (into the whole sample) that CP rank ``cp_rank`` holds, in its local order."""
    check_sequence(seq_length, cp_size)
    c = seq_length // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def split_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens of ``t`` (the whole sequence along ``dim``)."""
    if cp_size == 1:
        return t
    return t.index_select(dim, local_token_indices(t.shape[dim], cp_size, cp_rank, t.device))


def _allowed(q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc: Optional[torch.Tensor],
             k_doc: Optional[torch.Tensor], window: Optional[int]) -> torch.Tensor:
    """[b or 1, s, t] bool: query i may attend key j (causal by token index, same document, inside the window)."""
    diff = q_idx[:, None] - k_idx[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed = allowed & (diff < window)
    allowed = allowed.unsqueeze(0)
    if q_doc is not None:
        allowed = allowed & (q_doc[:, :, None] == k_doc[:, None, :])
    return allowed


def _acc(t: torch.Tensor) -> torch.Tensor:
    """The dtype attention accumulates in: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, g, r, s, d], k [b, g, t, d] -> masked scores [b, g, r, s, t] in fp32 (fp64 for fp64 inputs)."""
    s = torch.einsum("bgrsd,bgtd->bgrst", _acc(q), _acc(k)) * scale
    return s.masked_fill(~allowed[:, None, None], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _block(q, k, v, allowed, scale):
    """Attention of q over one key/value block: (out [b, g, r, s, d] fp32, lse [b, g, r, s]; -inf: no key)."""
    s = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.einsum("bgrst,bgtd->bgrsd", p, _acc(v)), lse


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    base = _finite(new)
    return (out * torch.exp(lse - base).unsqueeze(-1) + out_b * torch.exp(lse_b - base).unsqueeze(-1)), new


def _spans(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + TILE, n)) for i in range(0, n, TILE)]


def _part(doc: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if doc is None else doc[:, a:b]


def _tiles(s: int, t: int, q_idx, k_idx, q_doc, k_doc, window):
    """The (query span, key span, allowed) tiles of an s x t block in which some query sees some key; the others
    (above the causal diagonal, outside the window, between different documents) are skipped."""
    for i0, i1 in _spans(s):
        for j0, j1 in _spans(t):
            allowed = _allowed(q_idx[i0:i1], k_idx[j0:j1], _part(q_doc, i0, i1), _part(k_doc, j0, j1), window)
            if bool(allowed.any()):
                yield (i0, i1), (j0, j1), allowed


def _attend(qg, k, v, q_idx, k_idx, q_doc, k_doc, window, scale):
    """Blockwise attention of qg [b, g, r, s, d] over k/v [b, g, t, d], one TILE x TILE tile at a time, merged
    by log-sum-exp: (out [b, g, r, s, d] fp32, lse [b, g, r, s]; -inf where a query sees no key)."""
    b, g, r, s, d = qg.shape
    out = qg.new_zeros((b, g, r, s, d), dtype=torch.promote_types(qg.dtype, torch.float32))
    lse = out.new_full((b, g, r, s), float("-inf"))
    for (i0, i1), (j0, j1), allowed in _tiles(s, k.shape[2], q_idx, k_idx, q_doc, k_doc, window):
        o, l = _block(qg[:, :, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], allowed, scale)
        out[:, :, :, i0:i1], lse[:, :, :, i0:i1] = _merge(out[:, :, :, i0:i1], lse[:, :, :, i0:i1], o, l)
    return out, lse


def _attend_backward(qg, k, v, dog, delta, lse, q_idx, k_idx, q_doc, k_doc, window, scale):
    """The gradients (dq [b, g, r, s, d], dk, dv [b, g, t, d]) that one key/value block contributes, given the
    output's gradient ``dog``, ``delta`` = (dout * out).sum(-1) and the log-sum-exp ``lse`` of the whole row
    (all blocks): the probabilities are recomputed tile by tile, never held for the whole block."""
    dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(k), torch.zeros_like(v)
    base = _finite(lse)
    for (i0, i1), (j0, j1), allowed in _tiles(qg.shape[3], k.shape[2], q_idx, k_idx, q_doc, k_doc, window):
        q_t, k_t, v_t, do_t = qg[:, :, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], dog[:, :, :, i0:i1]
        p = torch.exp(_scores(q_t, k_t, allowed, scale) - base[:, :, :, i0:i1].unsqueeze(-1))  # [b, g, r, s, t]
        dv[:, :, j0:j1] += torch.einsum("bgrst,bgrsd->bgtd", p, do_t)
        ds = p * (torch.einsum("bgrsd,bgtd->bgrst", do_t, v_t) - delta[:, :, :, i0:i1].unsqueeze(-1))
        dq[:, :, :, i0:i1] += torch.einsum("bgrst,bgtd->bgrsd", ds, k_t) * scale
        dk[:, :, j0:j1] += torch.einsum("bgrst,bgrsd->bgtd", ds, q_t) * scale
    return dq, dk, dv


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.reshape(b, groups, h // groups, s, d)


def _exchange(tensors: list[torch.Tensor], group: ProcessGroup) -> tuple[list[torch.Tensor], list]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's into new buffers."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _gather_docs(doc: Optional[torch.Tensor], group: ProcessGroup) -> Optional[list[torch.Tensor]]:
    if doc is None:
        return None
    docs = [torch.empty_like(doc) for _ in range(dist.get_world_size(group))]
    dist.all_gather(docs, doc.contiguous(), group=group)
    return docs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, seq_length, scale, window, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        docs = _gather_docs(doc, group)
        idx = [local_token_indices(seq_length, cp, j, q.device) for j in range(cp)]
        qg = _grouped(q, k.shape[1])
        out = lse = None
        kv = torch.stack([k, v])
        for step in range(cp):
            owner = (rank - step) % cp
            pending = _exchange([kv], group) if step < cp - 1 else None
            out_b, lse_b = _attend(qg, kv[0], kv[1], idx[rank], idx[owner], None if docs is None else docs[rank],
                                   None if docs is None else docs[owner], window, scale)
            out, lse = (out_b, lse_b) if out is None else _merge(out, lse, out_b, lse_b)
            if pending is not None:
                received, works = pending
                for w in works:
                    w.wait()
                kv = received[0]
        ctx.save_for_backward(q, k, v, out, lse, *([] if doc is None else [doc]))
        ctx.meta = (seq_length, scale, window, group, docs)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        seq_length, scale, window, group, docs = ctx.meta
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        idx = [local_token_indices(seq_length, cp, j, q.device) for j in range(cp)]
        groups = k.shape[1]
        qg, dog = _acc(_grouped(q, groups)), _acc(_grouped(dout, groups))
        delta = (dog * out).sum(-1)                                   # [b, g, r, s]
        dq = torch.zeros_like(qg)
        # the block travels in the model's dtype, as in the forward (upcast where used: the same values, half
        # the bytes in bf16); its gradient accumulates and travels in fp32
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(_acc(kv))
        for step in range(cp):
            owner = (rank - step) % cp
            kv_acc = _acc(kv)
            dq_b, dk_b, dv_b = _attend_backward(qg, kv_acc[0], kv_acc[1], dog, delta, lse, idx[rank], idx[owner],
                                                None if docs is None else docs[rank],
                                                None if docs is None else docs[owner], window, scale)
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
            # the block and its gradients go on to the next rank; after CP sends the gradients are home
            send = [kv, dkv] if step < cp - 1 else [dkv]
            received, works = _exchange(send, group)
            for w in works:
                w.wait()
            if step < cp - 1:
                kv, dkv = received
            else:
                dkv = received[0]
        return (dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, *, seq_length: int,
                   scale: float, document_ids: Optional[torch.Tensor] = None,
                   window: Optional[int] = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sample, its keys/values passed around ``group``.
    ``document_ids`` [b, s_local]: this rank's tokens' documents (None: one document). Returns [b, heads,
    s_local, d] in q's dtype."""
    if dist.get_world_size(group) == 1:
        return attention_reference(q, k, v, seq_length=seq_length, scale=scale, document_ids=document_ids,
                                   window=window)
    return _RingAttention.apply(q, k, v, document_ids, seq_length, scale, window, group)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``split_dim`` over the ranks of ``group`` and concatenate what they send along ``cat_dim``
    (in rank order). [b, H, s_local, d] with (1, 2): sequence slices of all heads -> [b, H / cp, cp x s_local, d],
    all tokens of this rank's heads; (2, 1) is the inverse, which is also the backward."""

    @staticmethod
    def forward(ctx, x, group, split_dim, cat_dim):
        ctx.args = (group, cat_dim, split_dim)
        return _all_to_all(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args), None, None, None


def _all_to_all(x: torch.Tensor, group: ProcessGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
    cp = dist.get_world_size(group)
    parts = [p.contiguous() for p in x.chunk(cp, dim=split_dim)]
    received = [torch.empty_like(parts[0]) for _ in range(cp)]
    dist.all_to_all(received, parts, group=group)
    return torch.cat(received, dim=cat_dim)


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, *, seq_length: int,
                  scale: float, document_ids: Optional[torch.Tensor] = None,
                  window: Optional[int] = None) -> torch.Tensor:
    """The same result as :func:`ring_attention` through two all-to-alls (DeepSpeed-Ulysses)."""
    cp = dist.get_world_size(group)
    if cp == 1:
        return attention_reference(q, k, v, seq_length=seq_length, scale=scale, document_ids=document_ids,
                                   window=window)
    heads, groups = q.shape[1], k.shape[1]
    check_a2a_heads(heads, groups, cp)
    if groups < cp:  # each rank needs the groups of its heads: repeat them so that they split evenly
        k, v = (t.repeat_interleave(cp // groups, dim=1) for t in (k, v))
    qh, kh, vh = (_AllToAll.apply(t, group, 1, 2) for t in (q, k, v))
    idx = torch.cat([local_token_indices(seq_length, cp, j, q.device) for j in range(cp)])
    docs = _gather_docs(document_ids, group)
    doc = None if docs is None else torch.cat(docs, dim=1)
    out = _Attention.apply(qh, kh, vh, idx, doc, window, scale)
    return _AllToAll.apply(out, group, 2, 1)


class _Attention(torch.autograd.Function):
    """Blockwise attention of one rank's heads over the whole sequence (the all-to-all's middle step): keeps
    q, k, v, the output and its log-sum-exp, never a sequence x sequence matrix."""

    @staticmethod
    def forward(ctx, q, k, v, idx, doc, window, scale):
        out, lse = _attend(_grouped(q, k.shape[1]), k, v, idx, idx, doc, doc, window, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (idx, doc, window, scale)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        idx, doc, window, scale = ctx.meta
        qg, dog = _acc(_grouped(q, k.shape[1])), _acc(_grouped(dout, k.shape[1]))
        dq, dk, dv = _attend_backward(qg, _acc(k), _acc(v), dog, (dog * out).sum(-1), lse, idx, idx, doc, doc,
                                      window, scale)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _masked_attention(q, k, v, allowed, scale):
    out, _ = _block(_grouped(q, k.shape[1]), k, v, allowed, scale)
    return out.reshape(q.shape).to(q.dtype)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_length: int, scale: float,
                        document_ids: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """One process, the whole sequence (q [b, heads, s, d] with s = ``seq_length``): the rule both exchanges
    reproduce."""
    idx = torch.arange(seq_length, device=q.device)
    return _masked_attention(q, k, v, _allowed(idx, idx, document_ids, document_ids, window), scale)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, comm_type: str, *,
                      scale: float, document_ids: Optional[torch.Tensor] = None,
                      window: Optional[int] = None) -> torch.Tensor:
    """The attention layer's entry: ``comm_type`` "p2p" (ring) or "a2a"; the sample's length is this rank's
    tokens x CP."""
    fn = {"p2p": ring_attention, "a2a": a2a_attention}.get(comm_type)
    if fn is None:
        raise ValueError(f"--cp-comm-type {comm_type!r}: one of {', '.join(COMM_TYPES)}")
    return fn(q, k, v, group, seq_length=q.shape[2] * dist.get_world_size(group), scale=scale,
              document_ids=document_ids, window=window)


def enable_context_parallel(model: torch.nn.Module, group: Optional[ProcessGroup], comm_type: str = "p2p") -> int:
    """Give every attention layer of ``model`` (a whole model or a pipeline stage) the CP group and exchange;
    returns how many. A group of one rank (or None) leaves the model as it is."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: one of {', '.join(COMM_TYPES)}")
    if group is None or dist.get_world_size(group) == 1:
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "cp_group") and hasattr(module, "linear_qkv"):
            module.cp_group, module.cp_comm_type = group, comm_type
            count += 1
    return count
