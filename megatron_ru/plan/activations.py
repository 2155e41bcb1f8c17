"""Bytes one rank keeps for backward, per transformer layer and per micro batch, and the
activation/logit buffers of a pipeline stage.

The per-layer count follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): every tensor autograd saves in the forward of one layer, adapted
to what *our* layers (megatron_ru/model/transformer.py) save. For a GPT layer on CUDA (LayerNorm,
GELU, dropout, PyTorch's fused SDPA) it is exactly the paper's ``sbh(10 + 24/t)`` bytes without
its ``5as/h`` term: the fused attention kernels keep the log-sum-exp instead of the s x s scores.
Per tensor (``T = s*b`` tokens, ``e`` bytes per activation element, ``t`` = TP, ``/t_sp`` = divided
by TP only with sequence parallelism, ``m`` bytes per dropout-mask element):

* LN1 input ``e*T*h/t_sp`` (+ statistics; RMSNorm without a fused kernel also keeps its normalised
  output), LN1 output as the QKV input ``e*T*h`` (gathered, i.e. whole, under SP: our
  ColumnParallelLinear saves the gathered input),
* the fused QKV output ``e*T*(a+2g)*d/t`` (q, k, v are views of it; RoPE adds rotated q and k and
  the cos/sin tables), the attention output ``e*T*a*d/t`` (also the projection's input) and the
  log-sum-exp ``4*b*(a/t)*s``; the math attention path instead keeps a scaled q, k^T, the softmax
  ``e*b*(a/t)*s^2``, its dropout mask and the dropped probabilities and a copy as projection input,
* the attention dropout mask is not stored by the fused kernels (RNG state only),
* residual dropout masks ``m*T*h/t_sp`` (x2), LN2 input ``e*T*h/t_sp``, LN2 output ``e*T*h``,
* MLP: fc1 output ``e*T*f1/t`` (GELU input) and GELU output ``e*T*f/t``; SwiGLU keeps the fused
  [gate; up] output ``e*T*2f/t``, silu(gate) and the product (``e*T*f/t`` each).

``--recompute-granularity selective`` keeps everything but what the core attention saves inside (its inputs
q, k, v and the projection's input stay): the math path's s x s tensors, or the fused kernels' log-sum-exp.
``--recompute-granularity full`` keeps only each layer's input ``e*T*h/t_sp`` (plus, during the
backward, one layer's full set, rebuilt). Dropout masks are ``bool`` on CUDA (``m = 1``) and of the
input dtype on CPU (composite dropout). Checked on CPU with ``saved_tensors_hooks`` in
tests/integration/test_plan_activations.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ru.config.model import ModelConfig
from megatron_ru.plan.layout import Layout


@dataclass(frozen=True)
class Runtime:
    """What the device's kernels keep: ``attention`` "fused" (flash / memory-efficient SDPA) or
    "math" (the s x s scores kept; in fp32 on CPU for 16-bit inputs), dropout masks of 1 byte (CUDA)
    or of the dtype (CPU), norms as :func:`_norm_bytes`."""
    device: str = "cuda"
    attention: str = "fused"

    @classmethod
    def for_device(cls, device: str, cfg: ModelConfig) -> "Runtime":
        if device == "cuda":
            return cls("cuda", "fused")
        # torch's CPU SDPA takes its flash kernel only without attention dropout
        return cls(device, "math" if cfg.attention_dropout > 0 else "fused")

    def mask_bytes(self, e: int) -> int:
        return 1 if self.device == "cuda" else e


def _norm_bytes(cfg: ModelConfig, tokens: int, h: int, e: int, rt: Runtime) -> int:
    """Everything one norm saves, its input included. CUDA (fused kernels): the input and fp32
    statistics. CPU: LayerNorm keeps statistics of the input dtype; the composite RMSNorm works in
    fp32 and keeps the (upcast) input, the fp32 rstd and the fp32 normalised tensor."""
    if rt.device == "cuda":
        return e * tokens * h + (8 if cfg.normalization == "LayerNorm" else 4) * tokens
    if cfg.normalization == "LayerNorm":
        return e * tokens * h + 2 * e * tokens
    return 4 * tokens * h + 4 * tokens + 4 * tokens * h


def _one_plus_w(cfg: ModelConfig, width: int) -> int:
    """--apply-layernorm-1p: the fp32 (1 + w) a norm computes and its product keeps."""
    return 4 * width if cfg.apply_layernorm_1p else 0


def layer_terms(cfg: ModelConfig, layout: Layout, rt: Runtime, local: bool | None = None) -> dict[str, int]:
    """Bytes one rank saves in the forward of one transformer layer for one micro batch, by tensor
    group (no recomputation). ``local``: a sliding-window layer (its attention keeps an s x s mask);
    None: the largest layer of the model (local if any is)."""
    if local is None:
        local = any(cfg.layer_is_local(i) for i in range(cfg.num_layers or 0))
    s, b, t = layout.rank_tokens, layout.micro_batch, layout.tp
    h, a, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    f = cfg.resolved_ffn_hidden_size
    e = layout.param_bytes
    m = rt.mask_bytes(e)
    T = s * b
    sp = t if layout.sequence_parallel else 1
    T_sp = T // sp
    qw, kw = a * d // t, g * d // t
    out: dict[str, int] = {}
    n_norms = 4 if cfg.sandwich_norm else 2   # Gemma's post-attention and post-MLP norms (their inputs too)
    out["norms"] = n_norms * (_norm_bytes(cfg, T_sp, h, e, rt) + _one_plus_w(cfg, h))
    out["norm_outputs"] = 2 * e * T * h                                        # QKV and fc1 inputs
    attn = e * T * (qw + 2 * kw)                                               # fused QKV output
    if cfg.position_embedding_type == "rope":
        attn += e * T * (qw + kw) + 2 * e * s * d                              # rotated q, k; cos, sin
    if layout.recompute == "selective":
        # the core attention recomputed: its inputs q, k, v (above) and the projection's input stay, nothing of
        # what the kernel saves inside (log-sum-exp; the math path's scores, softmax, dropout mask)
        attn += e * T * qw
    elif rt.attention == "fused" or layout.cp > 1:
        # (CP: the blockwise attention keeps the same two; its key/value block in flight is counted below)
        attn += e * T * qw + 4 * b * (a // t) * s                              # output, log-sum-exp
    else:
        scores = b * (a // t) * s * s
        # the math path works in fp32 on CPU for 16-bit inputs: it keeps fp32 copies of q, k, v (not the
        # QKV output) and fp32 scores
        w = 4 if (e == 2 and rt.device != "cuda") else e
        if w != e:
            attn = 3 * w * T * qw if cfg.position_embedding_type != "rope" else attn - e * T * (qw + 2 * kw) + 3 * w * T * qw
        else:
            attn += 2 * e * T * qw                                             # q*scale, k^T
        attn += e * T * qw + w * scores                                        # proj input, softmax
        if cfg.attention_dropout > 0:
            attn += (m if w == e else w) * scores + w * scores                 # mask, dropped probs
    if cfg.qk_layernorm:
        # one norm over the head size per query head and per key head (the query's input a copy; the key's a
        # view of the QKV output, except where a 16-bit input is upcast)
        qn = _norm_bytes(cfg, T * (a // t), d, e, rt) + _one_plus_w(cfg, d)
        kn = _norm_bytes(cfg, T * (g // t), d, e, rt) + _one_plus_w(cfg, d)
        if rt.device != "cuda" and e == 4:
            kn -= e * T * kw
        attn += qn + kn
    if local and cfg.sliding_window is not None and s > cfg.sliding_window and layout.cp == 1:
        attn += e * s * s                                                      # the window's additive mask
    if layout.cp > 1 and layout.cp_comm == "p2p":
        attn += 2 * e * T * kw                                                 # the ring's block in flight
    out["attention"] = attn
    out["dropout_masks"] = 2 * m * T_sp * h if cfg.hidden_dropout > 0 else 0
    if cfg.gated_mlp:
        out["mlp"] = e * T * (2 * f // t) + 2 * e * T * (f // t)
    else:
        out["mlp"] = 2 * e * T * (f // t)
    return out


def layer_bytes(cfg: ModelConfig, layout: Layout, rt: Runtime, local: bool | None = None) -> int:
    """Bytes one layer keeps per micro batch until its backward (its input only with recomputation);
    ``local`` as :func:`layer_terms` (a stage counts every layer as the model's largest)."""
    if layout.recompute == "full":
        return recompute_input_bytes(cfg, layout)
    return sum(layer_terms(cfg, layout, rt, local).values())


def recompute_input_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """What a recomputed chunk keeps: its input (a 1/TP part of it with --distribute-saved-activations)."""
    e = layout.param_bytes
    sp = layout.tp if layout.sequence_parallel else 1
    whole = e * layout.rank_tokens * layout.micro_batch * cfg.hidden_size // sp
    if layout.distribute_saved_activations and layout.tp > 1 and not layout.sequence_parallel:
        return -(-whole // layout.tp)
    return whole


def stage_layer_bytes(cfg: ModelConfig, layout: Layout, rt: Runtime, n_layers: int) -> tuple[int, int]:
    """(bytes the ``n_layers`` transformer layers of one stage keep per micro batch until their backward, the
    largest set one backward rebuilds at a time): full recomputation in Megatron's uniform chunks (each chunk's
    input; a chunk of layers rebuilt) or block (the first layers' inputs, the others' whole activations)."""
    full_layer = sum(layer_terms(cfg, layout, rt).values())
    if layout.recompute != "full" or n_layers == 0:
        return n_layers * layer_bytes(cfg, layout, rt), 0
    n = layout.recompute_num_layers
    if layout.recompute_method == "block":
        k = min(n, n_layers)
        return k * recompute_input_bytes(cfg, layout) + (n_layers - k) * full_layer, full_layer if k else 0
    chunks = -(-n_layers // n)
    return chunks * recompute_input_bytes(cfg, layout), min(n, n_layers) * full_layer


def embedding_bytes(cfg: ModelConfig, layout: Layout, rt: Runtime) -> int:
    """The embedding layer's saved tensors per micro batch: token ids (int64) and the dropout mask."""
    e = layout.param_bytes
    T = layout.rank_tokens * layout.micro_batch
    sp = layout.tp if layout.sequence_parallel else 1
    ids = 8 * T * (2 if layout.tp > 1 else 1)  # ids, and the masked local ids of a vocab-parallel lookup
    if cfg.position_embedding_type == "learned_absolute":
        ids += 8 * layout.rank_tokens              # the position ids of the position-table lookup
    mask = rt.mask_bytes(e) * T * cfg.hidden_size // sp if cfg.hidden_dropout > 0 else 0
    return ids + mask


def final_norm_bytes(cfg: ModelConfig, layout: Layout, rt: Runtime) -> int:
    e = layout.param_bytes
    T = layout.rank_tokens * layout.micro_batch
    sp = layout.tp if layout.sequence_parallel else 1
    return _norm_bytes(cfg, T // sp, cfg.hidden_size, e, rt) + _one_plus_w(cfg, cfg.hidden_size)


def logits_bytes(cfg: ModelConfig, layout: Layout, padded_vocab: int) -> dict[str, int]:
    """The output head of one micro batch: its saved (gathered) input, the vocab-parallel logits,
    the fp32 softmax the cross-entropy keeps (plus target bookkeeping), and the backward's fp32
    gradient with its cast to the activation dtype (none in fp32). Without a pipeline the logits are freed
    when the cross-entropy has made its softmax, before the backward makes the gradient: the head holds
    ``head_input + softmax + max(logits, logit_grads)`` at once; a pipeline's last stage keeps them
    (:func:`head_peak_bytes`)."""
    e = layout.param_bytes
    T = layout.rank_tokens * layout.micro_batch
    vt = padded_vocab // layout.tp
    return {"head_input": e * T * cfg.hidden_size, "logits": e * T * vt, "softmax": 4 * T * vt + 9 * T,
            "logit_grads": (4 + (e if e != 4 else 0)) * T * vt}


def head_peak_bytes(parts: dict[str, int], pipeline: bool = False) -> int:
    """The most the output head holds at once (:func:`logits_bytes`' parts): in the forward the logits next to
    the softmax made from them, in the backward the softmax next to the gradient made from it. ``pipeline``: the
    last stage of a DeepSpeed pipeline, whose buffers keep the stage's output (the logits) until its backward."""
    if pipeline:
        return parts["head_input"] + parts["softmax"] + parts["logits"] + parts["logit_grads"]
    return parts["head_input"] + parts["softmax"] + max(parts["logits"], parts["logit_grads"])
