"""The one description of the model: an ordered, named list of layers and the canonical name,
full shape and tensor-parallel split of every parameter.

Everything that needs to know what the model is made of reads it from here: :class:`GPTModel`
(PP = 1) and the DeepSpeed ``PipelineModule`` specs (PP > 1) are both built from
:func:`model_description` (by :func:`megatron_ru.model.gpt.build_layer`, next to the layer classes; this
module imports none of them); initialisation seeds, ``--freeze`` patterns,
``--train-only-embeddings``, checkpoint conversion and resharding use the canonical names of
:func:`parameter_specs` / :func:`canonical_name`. A new architecture detail (a new parameter, a
new split) is added to the layer classes and to :func:`_layer_params` below — nowhere else. The
linear layers (path, split, sizes, fused parts and their Hugging Face modules) are the table of
``config/linears.py``; :class:`PartLayout` says where each fused part's rows are.

Canonical names are megatron-core's and do not depend on TP or PP::

    embedding.word_embeddings.weight                      [V, h]   vocab rows, split on dim 0
    decoder.layers.{i}.self_attention.linear_qkv.weight   [(nq + 2 ng) d, h]   split on dim 0
    ...
    output_layer.weight                                   [V, h]   (untied only)

Canonical full tensors hold exactly ``V`` vocabulary rows (the model's vocabulary); the padding to
``--make-vocab-size-divisible-by`` x TP belongs to a layout (:func:`megatron_ru.model.shards.padded_vocab_rows`,
next to the rest of the shard arithmetic).

In a pipeline, layer ``j`` of the description is DeepSpeed's layer ``j``: 0 = embedding,
1..N = decoder layer j - 1, N + 1 = final norm, N + 2 = output head; its module parameters are
named ``{j}.<local name>`` (tied embeddings: ``tied_modules.embed.<local name>`` on both ends).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from megatron_ru.config.linears import LINEARS
from megatron_ru.config.model import ModelConfig

EMBEDDING = "embedding"
FINAL_NORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer"
TIED_KEY = "embed"
WORD_EMBEDDINGS = "word_embeddings.weight"
#: canonical names of the two matrices with a row per vocabulary entry
WORD_EMBEDDING_WEIGHT = f"{EMBEDDING}.{WORD_EMBEDDINGS}"
OUTPUT_WEIGHT = f"{OUTPUT_LAYER}.weight"
VOCAB_WEIGHTS = (WORD_EMBEDDING_WEIGHT, OUTPUT_WEIGHT)

KINDS = ("embedding", "transformer", "final_norm", "output")


def layer_prefix(layer_number: int) -> str:
    """Canonical prefix of decoder layer ``layer_number`` (0-based)."""
    return f"decoder.layers.{layer_number}"


@dataclass(frozen=True)
class LayerDesc:
    """One entry of the model description. ``index`` is also the DeepSpeed pipeline layer index."""
    index: int
    kind: str
    prefix: str
    layer_number: Optional[int] = None

    @property
    def tied_output(self) -> bool:
        return self.kind == "output" and self.prefix == EMBEDDING


@dataclass(frozen=True)
class ParamSpec:
    """A canonical parameter: full shape (``V`` rows for the vocabulary matrices), the pipeline layer
    that holds it, and how tensor parallelism splits it (``partition_dim`` None = replicated)."""
    name: str
    shape: tuple[int, ...]
    layer_index: int
    partition_dim: Optional[int] = None
    partition_stride: int = 1
    vocab: bool = False

    @property
    def local_name(self) -> str:
        """The name inside its layer module (``self_attention.linear_qkv.weight``)."""
        return local_name_of(self.name)


def model_description(cfg: ModelConfig) -> list[LayerDesc]:
    """[embedding, decoder layers 0..N-1, final norm, output head]; ``descs[j].index == j``."""
    n = cfg.num_layers
    descs = [LayerDesc(0, "embedding", EMBEDDING)]
    descs += [LayerDesc(i + 1, "transformer", layer_prefix(i), i) for i in range(n)]
    descs.append(LayerDesc(n + 1, "final_norm", FINAL_NORM))
    descs.append(LayerDesc(n + 2, "output", EMBEDDING if cfg.tied_embeddings else OUTPUT_LAYER))
    return descs


def _layer_params(desc: LayerDesc, cfg: ModelConfig, vocab_size: int) -> list[tuple[str, tuple[int, ...], Optional[int], int, bool]]:
    """(local name, full shape, partition dim, stride, vocab) of the parameters of one layer."""
    h = cfg.hidden_size
    if desc.kind == "embedding":
        out = [(WORD_EMBEDDINGS, (vocab_size, h), 0, 1, True)]
        if cfg.position_embedding_type == "learned_absolute":
            out.append(("position_embeddings.weight", (cfg.max_position_embeddings, h), None, 1, False))
        return out
    if desc.kind == "output":
        return [] if desc.tied_output else [("weight", (vocab_size, h), 0, 1, True)]
    norm = [("weight", (h,), None, 1, False)] + ([("bias", (h,), None, 1, False)]
                                                  if cfg.normalization == "LayerNorm" else [])
    if desc.kind == "final_norm":
        return norm
    qkv, proj, fc1, fc2 = (LINEARS[k] for k in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    bias = cfg.add_bias_linear
    out = [("input_layernorm." + n, s, dim, st, v) for n, s, dim, st, v in norm]
    out += _linear_params(qkv, cfg, cfg.add_qkv_bias_effective)
    if cfg.qk_layernorm:  # one weight of head size for all heads: replicated, every TP rank's heads use it
        d = cfg.head_dim
        head_norm = [("weight", (d,), None, 1, False)] + ([("bias", (d,), None, 1, False)]
                                                           if cfg.normalization == "LayerNorm" else [])
        out += [(f"self_attention.{which}_layernorm.{n}", s, dim, st, v)
                for which in ("q", "k") for n, s, dim, st, v in head_norm]
    out += _linear_params(proj, cfg, bias)
    if cfg.sandwich_norm:
        out += [("post_self_attn_layernorm." + n, s, dim, st, v) for n, s, dim, st, v in norm]
    out += [("pre_mlp_layernorm." + n, s, dim, st, v) for n, s, dim, st, v in norm]
    out += _linear_params(fc1, cfg, bias)
    out += _linear_params(fc2, cfg, bias)
    if cfg.sandwich_norm:
        out += [("post_mlp_layernorm." + n, s, dim, st, v) for n, s, dim, st, v in norm]
    return out + _adapter_params(desc, cfg)


def _linear_params(lin: Any, cfg: ModelConfig, bias: bool) -> list[tuple[str, tuple[int, ...], Optional[int], int, bool]]:
    """Weight (and bias) of one linear layer: column-parallel layers split their output rows (with the
    layer's stride), row-parallel ones their input columns (their bias is replicated)."""
    rows, cols, stride = lin.out_features(cfg), lin.in_features(cfg), lin.stride(cfg)
    out = [(f"{lin.path}.weight", (rows, cols), 0 if lin.column else 1, stride if lin.column else 1, False)]
    if bias:
        out.append((f"{lin.path}.bias", (rows,), 0 if lin.column else None, stride if lin.column else 1, False))
    return out


class PartLayout:
    """Where the fused parts of a linear layer sit in its output rows: Q/K/V interleaved per query
    group (``[q_0 .. q_{r-1}, k, v]`` of ``head_dim`` rows each, group after group), SwiGLU's
    ``[gate; up]`` halves. ``groups`` is the number of query groups the tensor holds: all of them in a
    canonical tensor (:meth:`full`), ``query_groups / TP`` in a tensor-parallel shard."""

    def __init__(self, linear: str, groups: int = 1, heads_per_group: int = 1, head_dim: int = 1) -> None:
        self.linear = linear
        self.g, self.r, self.d = groups, heads_per_group, head_dim

    @classmethod
    def full(cls, linear: str, cfg: ModelConfig, tp: int = 1) -> "PartLayout":
        """The layout of a canonical tensor (``tp`` 1) or of one of ``tp`` shards."""
        return cls(linear, cfg.query_groups // tp, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim)

    def parts(self) -> tuple[str, ...]:
        return {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}.get(self.linear, (self.linear,))

    def _qkv_counts(self) -> dict[str, tuple[int, int]]:
        return {"q": (0, self.r), "k": (self.r, 1), "v": (self.r + 1, 1)}

    def select(self, t: torch.Tensor, part: str, dim: int) -> torch.Tensor:
        """The rows of ``part`` along ``dim`` (a view for linear_fc1 and the whole layer)."""
        if part == self.linear:
            return t
        dim = dim % t.dim()
        if self.linear == "linear_fc1":
            return t.chunk(2, dim=dim)[("gate", "up").index(part)]
        shape = t.shape
        v = t.reshape(*shape[:dim], self.g, self.r + 2, self.d, *shape[dim + 1:])
        lo, n = self._qkv_counts()[part]
        return v.narrow(dim + 1, lo, n).reshape(*shape[:dim], -1, *shape[dim + 1:])

    def split(self, t: torch.Tensor, dim: int = 0) -> dict[str, torch.Tensor]:
        """Every part's rows along ``dim``, in row order."""
        return {p: self.select(t, p, dim) for p in self.parts()}

    def join(self, parts: dict[str, torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The inverse of :meth:`split` (every part given)."""
        if self.linear not in ("linear_qkv", "linear_fc1"):
            return parts[self.linear]
        if self.linear == "linear_fc1":
            return torch.cat([parts["gate"], parts["up"]], dim=dim)
        first = parts["q"]
        dim = dim % first.dim()
        lead, tail = first.shape[:dim], first.shape[dim + 1:]
        grouped = [parts[p].reshape(*lead, self.g, n, self.d, *tail) for p, (_, n) in self._qkv_counts().items()]
        return torch.cat(grouped, dim=dim + 1).reshape(*lead, -1, *tail)

    def assemble(self, deltas: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as ``like`` holding each given part's rows (last dim) and zeros elsewhere."""
        zeros = like.new_zeros(like.shape)
        return self.join({p: deltas[p] if p in deltas else z for p, z in self.split(zeros, -1).items()}, -1)


def split_heads(qkv: torch.Tensor, groups: int, heads_per_group: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's view of linear_qkv's output [..., groups * (r + 2) * d] (:class:`PartLayout`): queries
    [..., groups * r, d], keys and values [..., groups, d]."""
    lead, r = qkv.shape[:-1], heads_per_group
    grouped = qkv.view(*lead, groups, r + 2, head_dim)
    q = grouped[..., :r, :].reshape(*lead, groups * r, head_dim)
    return q, grouped[..., r, :], grouped[..., r + 1, :]


def _adapter_params(desc: LayerDesc, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], Optional[int], int, bool]]:
    """LoRA/DoRA parameters of a decoder layer (megatron_ru/model/lora.py)."""
    spec = cfg.lora_spec
    if spec is None:
        return []
    from megatron_ru.config.linears import part_rows
    from megatron_ru.config.lora import ADAPTER_MARK, adapter_param_shapes, b_stride, model_adapters
    rows = part_rows(cfg)
    out = []
    for a in model_adapters(cfg):
        if a.layer != desc.layer_number:
            continue
        lin = LINEARS[a.linear]
        for pname, shape, dim, st in adapter_param_shapes(a, lin.in_features(cfg), rows[a.part], lin.column,
                                                          spec.use_dora, b_stride(cfg, a.part)):
            out.append((f"{lin.path}{ADAPTER_MARK}{a.part}.{pname}", shape, dim, st, False))
    return out


def layer_parameter_specs(desc: LayerDesc, cfg: ModelConfig, vocab_size: int) -> list[ParamSpec]:
    """The canonical parameters one description entry holds (none for a tied output head)."""
    return [ParamSpec(f"{desc.prefix}.{local}", shape, desc.index, dim, stride, vocab)
            for local, shape, dim, stride, vocab in _layer_params(desc, cfg, vocab_size)]


def parameter_specs(cfg: ModelConfig, vocab_size: int) -> list[ParamSpec]:
    """Every canonical parameter once, in model order (a tied weight under ``embedding.``)."""
    return [p for desc in model_description(cfg) for p in layer_parameter_specs(desc, cfg, vocab_size)]


def local_name_of(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``mlp.linear_fc1.weight``."""
    for prefix in (FINAL_NORM + ".", EMBEDDING + ".", OUTPUT_LAYER + "."):
        if name.startswith(prefix):
            return name[len(prefix):]
    m = re.match(r"^decoder\.layers\.\d+\.(.+)$", name)
    if m:
        return m.group(1)
    raise KeyError(f"{name!r} is not a canonical parameter name")


_PIPE_RE = re.compile(r"^(\d+)\.(.+)$")
_TIED_RE = re.compile(rf"^tied_modules\.{TIED_KEY}\.(.+)$")


def canonical_name(module_param_name: str, cfg: ModelConfig) -> str:
    """The canonical name of a parameter named by a :class:`GPTModel` (unchanged) or a DeepSpeed
    ``PipelineModule`` (``5.self_attention.linear_qkv.weight`` -> ``decoder.layers.4...``). Also
    accepts a layer-file key qualified by its layer index the same way."""
    m = _TIED_RE.match(module_param_name)
    if m:
        return f"{EMBEDDING}.{m.group(1)}"
    m = _PIPE_RE.match(module_param_name)
    if m is None:
        return module_param_name
    index, local = int(m.group(1)), m.group(2)
    descs = model_description(cfg)
    if index >= len(descs):
        raise KeyError(f"pipeline layer {index} does not exist in a model with {cfg.num_layers} layers")
    return f"{descs[index].prefix}.{local}"


def canonical_named_parameters(model: nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, local parameter) of a GPTModel or this stage of a PipelineModule; a tied
    weight is yielded once."""
    for name, p in model.named_parameters():
        yield canonical_name(name, cfg), p


def stage_bounds(cfg: ModelConfig, pp: int) -> list[tuple[int, int]]:
    """[start, stop) pipeline layer indices of each stage, exactly as DeepSpeed partitions
    ``partition_method="type:TransformerLayer"`` (balanced transformer-layer counts)."""
    return list(_stage_bounds(cfg.num_layers, pp))


@functools.lru_cache(maxsize=256)
def _stage_bounds(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    parts = balanced_parts(num_layers, pp)
    return tuple((parts[s], parts[s + 1]) for s in range(pp))


def balanced_parts(num_layers: int, pp: int) -> list[int]:
    """The ``pp + 1`` stage boundaries over the pipeline's layer list (embedding, ``num_layers`` transformer
    layers, final norm, output head) that DeepSpeed's ``partition_balanced`` gives for the weights
    ``[0, 1 x num_layers, 0, 0]`` (``partition_method="type:TransformerLayer"``, what training uses).

    DeepSpeed solves the linear partition problem by dynamic programming: the split into ``pp`` non-empty
    contiguous stages whose heaviest and lightest stage differ least, a tie going to the split whose last
    stage starts latest. The same here, without importing DeepSpeed (the planner runs on login nodes, where
    DeepSpeed's import prints on stdout); tests/unit/test_stage_bounds.py checks it against DeepSpeed's own
    function for every stage count of every layer count to 48."""
    weights = [0] + [1] * num_layers + [0, 0]
    n = len(weights)
    if n <= pp:  # DeepSpeed's uniform edge case: one layer a stage, then empty stages
        return [min(p, n) for p in range(pp + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[j][i]: (heaviest, lightest) stage of the best split of the first i layers into j stages;
    # start[j][i]: where its last stage starts
    best: list[dict[int, tuple[int, int]]] = [{0: (0, -1)}] + [{} for _ in range(pp)]
    start: list[dict[int, int]] = [{} for _ in range(pp + 1)]
    for j in range(1, pp + 1):
        for i in range(j, n + 1):
            chosen = None
            for k in range(j - 1, i):
                if k not in best[j - 1]:
                    continue
                heavy, light = best[j - 1][k]
                stage = prefix[i] - prefix[k]
                cand = (max(heavy, stage), stage if light < 0 else min(light, stage))
                if chosen is None or cand[0] - cand[1] <= chosen[0] - chosen[1]:
                    chosen, start[j][i] = cand, k
            if chosen is not None:
                best[j][i] = chosen
    parts = [n]
    for j in range(pp, 0, -1):
        parts.append(start[j][parts[-1]])
    return parts[::-1]


def model_args_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Every ModelConfig field (JSON-able): what a checkpoint records about the model."""
    return dataclasses.asdict(cfg)


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from :func:`model_args_dict`'s output; keys this version does not know are an
    error (the checkpoint is from a newer megatron_ru), missing ones take their defaults."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"the checkpoint's model arguments include {', '.join(unknown)}, which this "
                         f"megatron_ru does not know (written by a newer version?)")
    return ModelConfig(**d)
