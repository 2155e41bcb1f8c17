"""Transformer block pieces: norms, rotary embeddings, attention, MLP, the layer.

Activations are [s, b, h] (Megatron's layout): sequence parallelism then splits dim 0.
Under sequence parallelism the norms and dropouts see [s/tp, b, h] shards and the
column-parallel inputs gather the sequence; the row-parallel outputs reduce-scatter it.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ru.config.linears import LINEARS
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.init import normal_init, scaled_std
from megatron_ru.model.kv_cache import LayerKVCache
from megatron_ru.model.lora import add_layer_adapters
from megatron_ru.model.rope import RopeSpec, apply_rotary, cached_cos_sin, rotary_cos_sin
from megatron_ru.model.spec import layer_prefix, split_heads
from megatron_ru.parallel import random as tp_random
from megatron_ru.parallel.context import context_attention
from megatron_ru.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_ru.parallel.mappings import copy_to_tensor_model_parallel_region, keep_collectives_out_of_compiled_graphs
from megatron_ru.parallel.utils import ProcessGroup, divide, group_size

try:  # apex's fused norms, when installed (GPU clusters); torch's own kernels otherwise
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine
    _HAVE_APEX = True
except Exception:  # noqa: BLE001 - any import failure means "not usable here"
    _HAVE_APEX = False

# SDPA shares key/value heads across query heads natively from torch 2.5 (no repeated copies)
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension. Its parameters are replicated on TP
    ranks; where each rank normalises different values (different tokens under sequence parallelism,
    different heads for the per-head query/key norms: ``split_input``), the weight passes through
    ``copy_to`` whose backward sums the partial gradients over TP ranks."""

    def __init__(self, hidden_size: int, normalization: str = "LayerNorm", eps: float = 1e-5, *,
                 tp_group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 split_input: bool = False, one_plus: bool = False) -> None:
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {normalization!r}")
        self.normalization = normalization
        self.eps = eps
        self.shape = (hidden_size,)
        self.tp_group = tp_group
        assert not sequence_parallel or group_size(tp_group) > 1, "sequence parallelism needs TP > 1"
        self.sequence_parallel = sequence_parallel
        self.sum_grad_over_tp = (sequence_parallel or split_input) and group_size(tp_group) > 1
        #: --apply-layernorm-1p: the scale is 1 + weight, the weight starting at 0 (Gemma's RMSNorm)
        self.one_plus = one_plus
        self.weight = nn.Parameter((torch.zeros if one_plus else torch.ones)(hidden_size, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
                     if normalization == "LayerNorm" else None)
        for p in self.parameters():
            p.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sum_grad_over_tp:
            weight = copy_to_tensor_model_parallel_region(weight, self.tp_group)
            bias = None if bias is None else copy_to_tensor_model_parallel_region(bias, self.tp_group)
        if self.one_plus:  # in fp32 and then the input's dtype, as Gemma computes (1 + w) * x_normed
            if bias is None:
                return F.rms_norm(x.float(), self.shape, 1.0 + weight.float(), self.eps).to(x.dtype)
            return F.layer_norm(x.float(), self.shape, 1.0 + weight.float(), bias.float(), self.eps).to(x.dtype)
        if _HAVE_APEX and x.is_cuda:
            if bias is None:
                return fused_rms_norm_affine(x, weight, self.shape, self.eps)
            return fused_layer_norm_affine(x, weight, bias, self.shape, self.eps)
        if bias is None:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, bias, self.eps)


def document_causal_mask(document_ids: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[b, 1, s, s]: query i sees key j <= i of the same document. ``document_ids`` [b, s] never decrease
    along a sample (:func:`megatron_ru.data.documents.document_ids_and_positions`). ``dtype`` bool: True = may
    attend; a floating dtype: the additive form (0 or -inf) that SDPA takes as it is. SDPA turns a bool mask
    into that form itself, in every layer, and keeps each copy for the backward pass; one additive mask
    shared by the layers is kept once."""
    s = document_ids.shape[-1]
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)          # [b, s, s]
    allowed = (same & torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()).unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class _LastDocumentMask:
    """The additive mask of the last ``document_ids`` tensor seen: the transformer layers of a pipeline stage
    receive the same tensor for one micro batch and share one mask (held while that tensor lives)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._mask: torch.Tensor | None = None

    def __call__(self, document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = self._key
        if (key is not None and key[0]() is document_ids and key[1] == document_ids._version and key[2] == dtype
                and self._mask is not None):
            return self._mask
        self._mask = document_causal_mask(document_ids, dtype)
        self._key = (weakref.ref(document_ids), document_ids._version, dtype)
        return self._mask


_last_document_mask = _LastDocumentMask()


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                    causal: bool, gqa: bool, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v (scale 1/sqrt(d) unless --softmax-scale) with attention dropout (drawn
    from the TP stream: heads differ per rank)."""
    with split_region_rng(dropout > 0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              **({"enable_gqa": True} if gqa else {}),
                                              **({"scale": scale} if scale is not None else {}))


def split_region_rng(active: bool) -> contextlib.AbstractContextManager:
    """Dropout on activations that differ between TP ranks draws from the TP stream."""
    return tp_random.get_rng_tracker().fork() if active else contextlib.nullcontext()


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, split over TP ranks by query group.

    linear_qkv's output rows are packed per query group, Megatron style:
    ``[q_0 .. q_{r-1}, k, v]`` for group 0, then group 1, ... (r = heads / groups), so a
    contiguous TP shard holds whole groups with their keys and values.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, seed: int, device: torch.device | None, dtype: torch.dtype) -> None:
        super().__init__()
        prefix = layer_prefix(layer_number) + ".self_attention."
        tp = group_size(tp_group)
        self.head_dim = cfg.head_dim
        self.groups_per_rank = divide(cfg.query_groups, tp, "--num-query-groups over tensor-parallel size")
        self.heads_per_group = divide(cfg.num_attention_heads, cfg.query_groups,
                                      "--num-attention-heads over --num-query-groups")
        local = cfg.layer_is_local(layer_number)   # --sliding-window, every layer or all but each N-th
        self.rope = RopeSpec.from_config(cfg, local=local) if cfg.position_embedding_type == "rope" else None
        self.dropout = cfg.attention_dropout
        self.sliding_window = cfg.sliding_window if local else None
        self.softmax_scale = cfg.softmax_scale
        self.recompute_core = cfg.recompute_granularity == "selective"
        #: context parallelism (:func:`megatron_ru.parallel.context.enable_context_parallel`): the CP group and
        #: exchange ("p2p" ring or "a2a"); None: this rank holds whole sequences
        self.cp_group: ProcessGroup | None = None
        self.cp_comm_type = "p2p"
        qkv, proj = LINEARS["linear_qkv"], LINEARS["linear_proj"]
        std = cfg.init_method_std
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                      device=device, dtype=dtype)
        self.linear_qkv = ColumnParallelLinear(qkv.in_features(cfg), qkv.out_features(cfg),
                                               init_method=normal_init(std, seed, prefix + "linear_qkv.weight"),
                                               **{**common, "bias": cfg.add_qkv_bias_effective})
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # per head, before RoPE; each TP rank holds other heads: gradients summed over TP
            head_norm = dict(normalization=cfg.normalization, eps=cfg.norm_epsilon, tp_group=tp_group,
                             device=device, dtype=dtype, split_input=True, one_plus=cfg.apply_layernorm_1p)
            self.q_layernorm = Norm(self.head_dim, **head_norm)
            self.k_layernorm = Norm(self.head_dim, **head_norm)
        self.linear_proj = RowParallelLinear(
            proj.in_features(cfg), proj.out_features(cfg), input_is_parallel=True,
            init_method=normal_init(scaled_std(std, cfg.num_layers), seed, prefix + "linear_proj.weight"),
            **common)
        add_layer_adapters(cfg, layer_number, "linear_qkv", self.linear_qkv, seed=seed,
                           groups_local=self.groups_per_rank, heads_per_group=self.heads_per_group)
        add_layer_adapters(cfg, layer_number, "linear_proj", self.linear_proj, seed=seed)

    def rope_tables(self, seq_length: int, device: torch.device, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos/sin tables of positions 0..seq_length-1 (None without RoPE), cached."""
        if self.rope is None:
            return None
        return cached_cos_sin(self.rope, seq_length, torch.device(device), dtype)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                kv_cache: LayerKVCache | None = None, attention_mask: torch.Tensor | None = None,
                rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``position_ids`` [s] or [b, s] (default: the s positions after any cached ones);
        ``kv_cache``: this layer's cache for incremental decoding (this step's keys/values are
        appended, attention covers all cached);
        ``attention_mask`` bool, broadcastable to [b, heads, s, s_k], True = may attend, or its additive
        form in q's dtype (0 / -inf; :func:`document_causal_mask`) (replaces the causal rule; needed for
        left-padded batches and packed documents). With ``--sliding-window`` W, attention never
        reaches a key W or more positions (cache slots) back, mask or not. ``rope_tables``: (cos, sin) of
        :meth:`rope_tables` for positions 0..s-1, which a compiled layer passes in (``position_ids`` None)."""
        qkv = self.linear_qkv(x)                           # [s, b, groups/tp * (r + 2) * d]
        s, b = qkv.shape[:2]
        r, d = self.heads_per_group, self.head_dim
        q, k, v = split_heads(qkv, self.groups_per_rank, r, d)  # [s, b, heads/tp, d], k/v [s, b, groups/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rope is not None and rope_tables is not None:
            cos, sin = (t.to(q.dtype) for t in rope_tables)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.rope is not None:
            positions = position_ids
            if positions is None:  # after cached tokens, this step continues their positions
                past = kv_cache.length if kv_cache is not None else 0
                positions = torch.arange(past, past + s, device=x.device)
            cos, sin = rotary_cos_sin(positions, self.rope.inv_freq(x.device), q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))   # [b, heads, s, d]
        if self.cp_group is not None:
            # this rank's tokens of each sample; the layer passes their document ids (int64) in the mask's place
            if kv_cache is not None:
                raise RuntimeError("incremental decoding (a KV cache) runs without context parallelism")
            if attention_mask is not None and (attention_mask.is_floating_point() or attention_mask.dtype == torch.bool):
                raise RuntimeError("under context parallelism attention takes document ids, not a mask")
            out = context_attention(q, k, v, self.cp_group, self.cp_comm_type, document_ids=attention_mask,
                                    scale=self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5,
                                    window=self.sliding_window)
            return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)                   # [b, groups/tp, s_k, d]
        s_k = k.shape[2]
        mask, causal = attention_mask, attention_mask is None
        window = self.sliding_window
        if window is not None and s_k > window:
            # query i (position s_k - s + i) sees only the last `window` keys up to itself (transformers:
            # q - k < window); a given mask is narrowed to the window too, never widened beyond it
            band = torch.ones(s, s_k, dtype=torch.bool, device=x.device).triu(diagonal=s_k - s - window + 1)
            if mask is None:
                mask = band.tril(diagonal=s_k - s)
            else:
                mask = mask & band if mask.dtype == torch.bool else mask.masked_fill(~band, float("-inf"))
            causal = False
        elif mask is None and s_k != s:  # cached keys before these queries: query i sees keys <= s_k - s + i
            mask = torch.ones(s, s_k, dtype=torch.bool, device=x.device).tril(diagonal=s_k - s)
            causal = False
        dropout = self.dropout if self.training else 0.0
        gqa = r > 1 and _SDPA_HAS_GQA  # SDPA repeats the key/value heads itself; older torch: repeat them here
        if r > 1 and not gqa:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        if self.recompute_core and self.training and torch.is_grad_enabled() and kv_cache is None:
            # --recompute-granularity selective: the core attention's saved tensors (the math path's s x s scores,
            # softmax, dropout mask) are rebuilt in backward from q, k, v; the dropout draws are replayed
            out = tp_random.checkpoint(_core_attention, q, k, v, mask, dropout, causal, gqa, self.softmax_scale)
        else:
            out = _core_attention(q, k, v, mask, dropout, causal, gqa, self.softmax_scale)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads/tp * d]
        return self.linear_proj(out)


class MLP(nn.Module):
    """h -> ffn -> h with GELU, or SwiGLU / GeGLU (tanh GELU) with linear_fc1 holding [gate; up] (split per TP
    rank with stride 2 so every rank owns matching gate and up rows)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, seed: int, device: torch.device | None, dtype: torch.dtype) -> None:
        super().__init__()
        prefix = layer_prefix(layer_number) + ".mlp."
        fc1, fc2 = LINEARS["linear_fc1"], LINEARS["linear_fc2"]
        self.gate = "silu" if cfg.swiglu else "gelu_tanh" if cfg.geglu else None
        std = cfg.init_method_std
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                      device=device, dtype=dtype)
        self.linear_fc1 = ColumnParallelLinear(fc1.in_features(cfg), fc1.out_features(cfg),
                                               partition_stride=fc1.stride(cfg),
                                               init_method=normal_init(std, seed, prefix + "linear_fc1.weight"),
                                               **common)
        self.linear_fc2 = RowParallelLinear(
            fc2.in_features(cfg), fc2.out_features(cfg), input_is_parallel=True,
            init_method=normal_init(scaled_std(std, cfg.num_layers), seed, prefix + "linear_fc2.weight"),
            **common)
        add_layer_adapters(cfg, layer_number, "linear_fc1", self.linear_fc1, seed=seed)
        add_layer_adapters(cfg, layer_number, "linear_fc2", self.linear_fc2, seed=seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.gate is not None:
            gate, up = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.gate == "silu" else F.gelu(gate, approximate="tanh")) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))). Input and output
    [s, b, h] ([s/tp, b, h] under sequence parallelism)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, *, seed: int = 1234, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layer_number = layer_number
        assert not sequence_parallel or group_size(tp_group) > 1, "sequence parallelism needs TP > 1"
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        #: how this layer is recomputed in training (:func:`plan_recomputation` sets it for a stage): "none",
        #: "alone" (its own checkpoint), "lead" (the first of a chunk: checkpoints ``_chunk``, itself and the
        #: layers after it) or "member" (computed by its chunk's lead: passes its input through)
        self.recompute_role = "alone" if cfg.recompute else "none"
        self._chunk: tuple["TransformerLayer", ...] = ()
        #: --distribute-saved-activations: the checkpointed input split across this TP group
        self._distribute_group = tp_group if cfg.distribute_saved_activations and group_size(tp_group) > 1 else None
        norm = dict(normalization=cfg.normalization, eps=cfg.norm_epsilon, tp_group=tp_group,
                    sequence_parallel=sequence_parallel, device=device, dtype=dtype, one_plus=cfg.apply_layernorm_1p)
        parts = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, seed=seed, device=device, dtype=dtype)
        self.input_layernorm = Norm(cfg.hidden_size, **norm)
        self.self_attention = Attention(cfg, layer_number, **parts)
        # --sandwich-norm (Gemma 2/3): the attention and MLP outputs normalised before their residual adds
        self.post_self_attn_layernorm = Norm(cfg.hidden_size, **norm) if cfg.sandwich_norm else None
        self.pre_mlp_layernorm = Norm(cfg.hidden_size, **norm)
        self.mlp = MLP(cfg, layer_number, **parts)
        self.post_mlp_layernorm = Norm(cfg.hidden_size, **norm) if cfg.sandwich_norm else None
        self._compiled = None  # torch.compile'd _forward (--torch-compile); None: eager

    def compile_forward(self) -> None:
        """Run the block through ``torch.compile`` (inductor fuses the norms, RoPE, SwiGLU and the residual
        adds around the matmuls; tensor-parallel collectives stay eager graph breaks). Incremental decoding
        (a KV cache) keeps the eager path."""
        keep_collectives_out_of_compiled_graphs()
        self._compiled = torch.compile(self._forward, dynamic=False)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        with split_region_rng(self.sequence_parallel):
            return F.dropout(x, self.hidden_dropout, training=True)

    def _forward(self, x: torch.Tensor, position_ids: torch.Tensor | None,
                 kv_cache: LayerKVCache | None = None, attention_mask: torch.Tensor | None = None,
                 rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), position_ids, kv_cache=kv_cache,
                                   attention_mask=attention_mask, rope_tables=rope_tables)
        if self.post_self_attn_layernorm is not None:
            attn = self.post_self_attn_layernorm(attn)
        x = x + self._dropout(attn)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        return x + self._dropout(mlp)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...], position_ids: torch.Tensor | None = None, *,
                kv_cache: LayerKVCache | None = None, attention_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``kv_cache``/``attention_mask``: incremental decoding (see :meth:`Attention.forward`).
        ``document_ids`` [b, s]: attention stays inside each packed document (:func:`document_causal_mask`).
        In a pipeline ``x`` may be the tuple ``(hidden, position_ids[, document_ids])`` that the embedding
        passes on; the same tuple comes out, with this layer's hidden states."""
        if isinstance(x, tuple):
            hidden, positions, *rest = x
            out = self.forward(hidden, positions, document_ids=rest[0] if rest else None)
            return (out, *x[1:])
        if self.self_attention.cp_group is not None:
            # context parallelism: the CP attention builds its masks from token indices and these documents
            if attention_mask is not None:
                raise RuntimeError("under context parallelism pass document_ids, not attention_mask")
            attention_mask = document_ids
        elif document_ids is not None and attention_mask is None:
            attention_mask = _last_document_mask(document_ids, x.dtype)
        elif document_ids is not None:
            attention_mask = attention_mask & document_causal_mask(document_ids)
        run, tables = self._forward, None
        if self._compiled is not None and kv_cache is None:
            run = self._compiled
            if position_ids is None:  # the tables as inputs of the graph, not computed in it
                tp = self.self_attention.linear_qkv.tp_size if self.sequence_parallel else 1
                tables = self.self_attention.rope_tables(x.shape[0] * tp, x.device, x.dtype)
        role = self.recompute_role if self.training and torch.is_grad_enabled() and kv_cache is None else "none"
        if role == "member":
            return x  # its chunk's lead ran it
        if role == "lead":
            run = self._run_chunk
        elif role != "alone":
            return run(x, position_ids, kv_cache, attention_mask, tables)
        if self._distribute_group is not None:
            return tp_random.distributed_checkpoint(run, self._distribute_group, x, position_ids, None,
                                                    attention_mask, tables)
        return tp_random.checkpoint(run, x, position_ids, None, attention_mask, tables)

    def _run_chunk(self, x: torch.Tensor, position_ids: torch.Tensor | None, kv_cache: None,
                   attention_mask: torch.Tensor | None, tables: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> torch.Tensor:
        for layer in self._chunk:
            x = (layer._compiled or layer._forward)(x, position_ids, None, attention_mask, tables)
        return x


def plan_recomputation(layers: list[TransformerLayer], cfg: ModelConfig) -> None:
    """Set how the transformer layers of one pipeline stage (in order) are recomputed, Megatron's way
    (:attr:`ModelConfig.recompute_plan`): ``uniform`` N: chunks of N layers from the stage's first, each
    keeping only its input (the last chunk may be shorter); ``block`` N: the first N layers one by one, the
    others keep all their activations; no full recomputation: none (selective recomputation is inside the
    attention). Every way computes the same losses and gradients; the forward draws its random numbers
    in the same order."""
    method, n = cfg.recompute_plan
    for i, layer in enumerate(layers):
        layer._chunk = ()
        if method == "block":
            layer.recompute_role = "alone" if i < n else "none"
        elif method == "uniform" and n == 1:
            layer.recompute_role = "alone"
        elif method == "uniform":
            lead = i - i % n
            layer.recompute_role = "lead" if i == lead else "member"
            if i == lead:
                layer._chunk = tuple(layers[lead:lead + n])
        else:
            layer.recompute_role = "none"
