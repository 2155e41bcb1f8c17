"""GPT/LLaMA decoder as a sequence of layers: embedding, N transformer layers, final norm,
output head — the same layer objects serve DeepSpeed's PipelineModule (via
:func:`pipeline_layers`) and the plain :class:`GPTModel` used when PP = 1.

Interfaces between layers: the embedding takes token ids [b, s] (or a tuple
``(tokens, position_ids)``) and returns hidden states [s, b, h] ([s/tp, b, h] with sequence
parallelism); the output head returns vocab-parallel logits [b, s, padded_vocab/tp];
:class:`GPTLoss` turns them and labels [b, s] (optionally ``(labels, loss_mask[, denominator])``) into the
mean loss over unmasked tokens. In a pipeline with packed documents (``--reset-position-ids``,
``--reset-attention-mask``) the stages pass ``(hidden, position_ids[, document_ids])`` tuples: the embedding
built with ``pipeline_carry=True`` forwards the ids it was given, each transformer layer passes them on, the
final norm drops them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ru.config.model import ModelConfig
from megatron_ru.model.init import normal_init
from megatron_ru.model.spec import EMBEDDING, OUTPUT_LAYER, TIED_KEY, WORD_EMBEDDINGS, LayerDesc, model_description
from megatron_ru.model.shards import padded_vocab_rows
from megatron_ru.model.transformer import (Norm, TransformerLayer, document_causal_mask, plan_recomputation,
                                          split_region_rng)
from megatron_ru.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ru.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, parallel_lm_logits
from megatron_ru.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_ru.parallel.utils import ProcessGroup, group_size



def _unpack_inputs(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(inputs, (tuple, list)):
        tokens = inputs[0]
        return tokens, (inputs[1] if len(inputs) > 1 else None)
    return inputs, None


class EmbeddingLayer(nn.Module):
    """Word (+ learned position) embeddings and embedding dropout. When embeddings are tied it
    also serves as the output head on the last stage (:func:`tied_output_logits`); built there
    with ``output_only=True`` it holds just the word embeddings (no unused position table)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, *, seed: int = 1234, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32, output_only: bool = False, pipeline_carry: bool = False) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.pipeline_carry = pipeline_carry
        # one source: the validated configuration allows sequence parallelism only with TP > 1
        assert not sequence_parallel or group_size(tp_group) > 1, "sequence parallelism needs TP > 1"
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size
        self.dropout = cfg.hidden_dropout
        self.output_only = output_only
        self.has_position_table = cfg.position_embedding_type == "learned_absolute"
        #: --scale-embeddings (Gemma): the embeddings times sqrt(hidden), that number rounded to their dtype
        self.scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None
        std = cfg.init_method_std
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_rows(cfg, vocab_size, group_size(tp_group)), cfg.hidden_size, tp_group=tp_group,
            init_method=normal_init(std, seed, f"{EMBEDDING}.{WORD_EMBEDDINGS}", valid_rows=vocab_size),
            device=device, dtype=dtype)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute" and not output_only:
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                    device=device, dtype=dtype)
            full = torch.empty(cfg.max_position_embeddings, cfg.hidden_size)
            normal_init(std, seed, f"{EMBEDDING}.position_embeddings.weight")(full)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(full)

    def forward(self, inputs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Hidden states [s, b, h]; with ``pipeline_carry`` and a tuple ``(tokens, position_ids[, document_ids])``,
        ``(hidden, position_ids[, document_ids])`` for the next layers."""
        tokens, position_ids = _unpack_inputs(inputs)
        if self.output_only and self.has_position_table:
            raise RuntimeError("this EmbeddingLayer was built output_only (last pipeline stage) and has no "
                               "position embeddings; use it through tied_output_logits")
        x = self.word_embeddings(tokens)                   # [b, s, h]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()                 # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        if self.training and self.dropout > 0:
            with split_region_rng(self.sequence_parallel):
                x = F.dropout(x, self.dropout, training=True)
        if self.pipeline_carry and isinstance(inputs, (tuple, list)):
            return (x, *inputs[1:])
        return x


def tied_output_logits(embedding: EmbeddingLayer, hidden: torch.Tensor) -> torch.Tensor:
    """Output head reusing the word embeddings (the tied output layer's ``forward_fn``)."""
    return parallel_lm_logits(hidden, embedding.word_embeddings.weight, embedding.tp_group,
                              embedding.sequence_parallel)


class OutputLayer(ColumnParallelLinear):
    """Untied output head: vocab-parallel logits [b, s, padded_vocab/tp] from [s, b, h]."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, *, seed: int = 1234, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg.hidden_size, padded_vocab_rows(cfg, vocab_size, group_size(tp_group)), tp_group=tp_group,
                         bias=False, sequence_parallel=sequence_parallel,
                         init_method=normal_init(cfg.init_method_std, seed, f"{OUTPUT_LAYER}.weight",
                                                 valid_rows=vocab_size),
                         device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return parallel_lm_logits(hidden, self.weight, self.tp_group, self.sequence_parallel)


class FinalNorm(Norm):
    """The decoder's final norm as a pipeline layer."""

    def __init__(self, cfg: ModelConfig, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 *, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, tp_group=tp_group,
                         sequence_parallel=sequence_parallel, device=device, dtype=dtype,
                         one_plus=cfg.apply_layernorm_1p)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        if isinstance(x, tuple):  # a pipeline's (hidden, position_ids[, document_ids]): the ids end here
            x = x[0]
        return super().forward(x)


class GPTLoss:
    """``loss_fn(logits, labels)`` -> mean cross-entropy over unmasked tokens. ``labels`` is
    [b, s] token ids, or ``(labels, loss_mask)`` with loss_mask [b, s] (1 = counts), or
    ``(labels, loss_mask, denominator)``: the masked sum divided by that scalar instead of the micro batch's
    unmasked count (``--calculate-per-token-loss``: the global batch's count, see
    :func:`megatron_ru.training.data.per_token_denominators`)."""

    def __init__(self, vocab_size: int, tp_group: ProcessGroup | None = None) -> None:
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self._compiled = None  # torch.compile'd loss for TP = 1 (--torch-compile); None: the reference

    def compile(self) -> None:
        """With TP = 1, compute the loss through ``torch.compile`` (:func:`mean_token_loss`): inductor fuses
        the fp32 log-softmax, the target pick and their backward into a few passes over the logits instead
        of materialising fp32 copies. With TP > 1 the vocabulary-parallel reference stays."""
        if group_size(self.tp_group) == 1:
            self._compiled = torch.compile(mean_token_loss, dynamic=False)

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        loss_mask = denominator = None
        if isinstance(labels, (tuple, list)):
            labels, loss_mask, *rest = labels
            denominator = rest[0] if rest else None
        if self._compiled is not None:
            return self._compiled(logits, labels, loss_mask, self.vocab_size, denominator)
        losses = vocab_parallel_cross_entropy(logits, labels, self.tp_group, self.vocab_size)
        return masked_mean(losses, loss_mask, denominator)


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor | None,
                denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``losses`` over unmasked positions; with ``denominator``, their sum divided by it."""
    if denominator is not None:
        total = losses.sum() if loss_mask is None else (losses * loss_mask.to(losses.dtype)).sum()
        return total / denominator.to(losses.dtype)
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp_min(1.0)


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None,
                    vocab_size: int, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of :class:`GPTLoss` for unsplit logits [b, s, padded_vocab] (TP = 1), written for
    ``torch.compile``: fp32 log-sum-exp over the real ``vocab_size`` columns minus the target's logit."""
    work = logits[..., :vocab_size].float()
    losses = torch.logsumexp(work, dim=-1) - work.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return masked_mean(losses, loss_mask, denominator)


@dataclass(frozen=True)
class PipelineLayer:
    """One entry of the pipeline's layer list: how to build the layer (``cls(*args, **kwargs)``), and for a
    layer sharing a weight with another, the key both share (``tied_key``), the shared attribute and the
    forward function used instead of the module's own. The DeepSpeed bridge turns these into its
    ``LayerSpec``/``TiedLayerSpec`` (:func:`megatron_ru.deepspeed_bridge.pipeline.layer_specs`)."""

    cls: type
    args: tuple
    kwargs: dict[str, Any]
    tied_key: str | None = None
    tied_weight_attr: str | None = None
    forward_fn: Callable[..., Any] | None = None

    def build(self) -> nn.Module:
        return self.cls(*self.args, **self.kwargs)


def layer_constructor(desc: LayerDesc, cfg: ModelConfig, vocab_size: int, tp_group: Any = None,
                      sequence_parallel: bool = False, *, seed: int = 1234, device: Optional[torch.device] = None,
                      dtype: torch.dtype = torch.float32, output_only: bool = False
                      ) -> tuple[type, tuple, dict[str, Any]]:
    """(class, args, kwargs) of the module of one description entry: what :func:`build_layer`
    calls and what a DeepSpeed ``LayerSpec`` is made of. ``output_only``: a tied output head on a
    stage without the input embedding (word embeddings only)."""
    common = dict(seed=seed, device=device, dtype=dtype)
    if desc.kind == "embedding" or desc.tied_output:
        return EmbeddingLayer, (cfg, vocab_size, tp_group, sequence_parallel), {**common, "output_only": output_only}
    if desc.kind == "transformer":
        return TransformerLayer, (cfg, desc.layer_number, tp_group, sequence_parallel), common
    if desc.kind == "final_norm":
        return FinalNorm, (cfg, tp_group, sequence_parallel), dict(device=device, dtype=dtype)
    if desc.kind == "output":
        return OutputLayer, (cfg, vocab_size, tp_group, sequence_parallel), common
    raise ValueError(f"unknown layer kind {desc.kind!r}")


def build_layer(desc: LayerDesc, cfg: ModelConfig, vocab_size: int, tp_group: Any = None,
                sequence_parallel: bool = False, **kwargs: Any) -> nn.Module:
    """The module of one description entry (its parameters carry the entry's canonical names
    relative to ``desc.prefix``); keyword arguments as :func:`layer_constructor`."""
    cls, args, kw = layer_constructor(desc, cfg, vocab_size, tp_group, sequence_parallel, **kwargs)
    return cls(*args, **kw)


def pipeline_layers(cfg: ModelConfig, vocab_size: int, tp_group: ProcessGroup | None = None,
                    sequence_parallel: bool = False, *, seed: int = 1234, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> list[PipelineLayer]:
    """The model description (:func:`megatron_ru.model.spec.model_description`) as the pipeline's layer
    list: [embedding, layer 0 .. N-1, final norm, output head]. With tied embeddings the first and last
    share ``word_embeddings.weight`` under the key ``"embed"`` (on a separate last stage the output head
    is built ``output_only``). Cut into stages by
    :func:`megatron_ru.deepspeed_bridge.pipeline.pipeline_module` with ``loss_fn=GPTLoss(...)`` and
    ``partition_method="type:TransformerLayer"``."""
    layers: list[PipelineLayer] = []
    for desc in model_description(cfg):
        # DeepSpeed builds a tied module from the first spec a stage owns: with one stage that is
        # the full embedding, on a separate last stage the word-embeddings-only output head
        cls, args, kwargs = layer_constructor(desc, cfg, vocab_size, tp_group, sequence_parallel, seed=seed,
                                              device=device, dtype=dtype, output_only=desc.tied_output)
        if desc.kind == "embedding":
            kwargs = {**kwargs, "pipeline_carry": True}
        if desc.kind == "embedding" and cfg.tied_embeddings:
            layers.append(PipelineLayer(cls, args, kwargs, TIED_KEY, WORD_EMBEDDINGS))
        elif desc.tied_output:
            layers.append(PipelineLayer(cls, args, kwargs, TIED_KEY, WORD_EMBEDDINGS, tied_output_logits))
        else:
            layers.append(PipelineLayer(cls, args, kwargs))
    return layers


def _attach(root: nn.Module, prefix: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted canonical ``prefix`` under ``root`` (``decoder.layers.3``
    -> ``root.decoder.layers[3]``), creating the containers on the way."""
    *path, last = prefix.split(".")
    node = root
    for part, nxt in zip(path, path[1:] + [last]):
        if not hasattr(node, part):
            node.add_module(part, nn.ModuleList() if nxt.isdigit() else nn.Module())
        node = getattr(node, part)
    if last.isdigit():
        assert isinstance(node, nn.ModuleList) and len(node) == int(last), f"layers out of order at {prefix}"
        node.append(module)
    else:
        node.add_module(last, module)


class GPTModel(nn.Module):
    """The whole model in one pipeline stage (PP = 1), built from the model description: every
    parameter is registered under its canonical name (``embedding.word_embeddings.weight``,
    ``decoder.layers.{i}...``, ``decoder.final_layernorm.*``, ``output_layer.weight``)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, *, seed: int = 1234, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_rows(cfg, vocab_size, group_size(tp_group))
        self.descriptions = model_description(cfg)
        for desc in self.descriptions:
            if not desc.tied_output:
                _attach(self, desc.prefix, build_layer(desc, cfg, vocab_size, tp_group, sequence_parallel,
                                                       seed=seed, device=device, dtype=dtype))
        if OUTPUT_LAYER not in self._modules:
            self.output_layer = None  # tied: the output head reuses the word embeddings
        self.loss_fn = GPTLoss(vocab_size, tp_group)
        plan_recomputation(list(self.decoder.layers), cfg)

    def forward(self, tokens: torch.Tensor, labels: Any = None,
                position_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel logits [b, s, padded_vocab/tp], or the mean loss when ``labels`` is given (a tensor
        or :class:`GPTLoss`'s tuple). ``document_ids`` [b, s]: attention within each packed document."""
        x = self.embedding((tokens, position_ids))
        if self.decoder.layers and self.decoder.layers[0].self_attention.cp_group is not None:
            for layer in self.decoder.layers:  # context parallelism: the layers' attention takes the documents
                x = layer(x, position_ids, document_ids=document_ids)
        else:
            # built once for all layers, additive in the activations' dtype (see document_causal_mask)
            mask = None if document_ids is None else document_causal_mask(document_ids, x.dtype)
            for layer in self.decoder.layers:
                x = layer(x, position_ids, attention_mask=mask)
        x = self.decoder.final_layernorm(x)
        if self.output_layer is None:
            logits = tied_output_logits(self.embedding, x)
        else:
            logits = self.output_layer(x)
        if labels is None:
            return logits
        return self.loss_fn(logits, labels if loss_mask is None else (labels, loss_mask))
