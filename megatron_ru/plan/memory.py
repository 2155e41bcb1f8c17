"""Peak memory of one GPU for a layout: the sum of the terms below for the busiest pipeline stage.

* ``parameters``, ``gradients``, ``optimizer``: what DeepSpeed's engine holds (:mod:`.states`),
* ``activations``: the saved tensors of the micro batches in flight on the stage under 1F1B
  (stage ``i`` of ``p`` holds ``min(p - i, m)``, Narayanan et al. 2021 section 2.2; 1 with PP = 1),
  per layer (:mod:`.activations`), plus the embedding's, plus one layer's full set rebuilt in the
  backward with recomputation (else the largest pair of activation gradients of one layer),
* ``buffers``: the output head (its input, the fp32 softmax the loss keeps, and the larger of the
  logits and the logit gradients: never alive together, unless a pipeline's buffers keep the logits)
  on the last stage, and DeepSpeed's pipeline
  send/receive buffers (stage outputs kept per micro batch in flight, partitioned over TP unless
  sequence parallel),
* ``comm_buckets``: the ZeRO reduce bucket (``reduce_bucket_size`` elements),
* ``allowance``: on CUDA a fixed :data:`CUDA_CONTEXT_BYTES` (context, kernels, cuBLAS workspaces,
  NCCL communicator buffers), on a CPU :data:`CPU_PROCESS_BYTES`, and :data:`FRAGMENTATION` of
  everything allocated and freed during the step (activations, buffers, buckets) for the allocator's
  fragmentation.

Sources and what is approximated: docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_ru.config.model import ModelConfig
from megatron_ru.model import spec as model_spec
from megatron_ru.model.shards import padded_vocab_rows
from megatron_ru.plan import activations as act
from megatron_ru.plan.hardware import GIB, MIB
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.params import stage_tensors
from megatron_ru.plan.states import BucketSizes, StateBytes, state_bytes

#: CUDA context + kernels + cuBLAS workspaces + NCCL buffers of the TP/PP/DP communicators (an
#: allowance, not a measurement: 0.3-0.6 GiB context with torch 2.x, a few hundred MiB of NCCL buffers)
CUDA_CONTEXT_BYTES = 1 * GIB
#: share of the memory allocated and freed during a step added for the caching allocator's fragmentation
FRAGMENTATION = 0.10
#: what a CPU rank holds beyond the terms (the first kernels' and gloo's buffers, the data pipeline, DeepSpeed's
#: objects): 39-53 MiB measured with a model whose terms are all under 1 MiB (benchmarks/plan_memory.py --shape
#: tiny, BENCHMARKS.md); on a GPU these live in host memory
CPU_PROCESS_BYTES = 50 * MIB

TERMS = ("parameters", "gradients", "optimizer", "activations", "buffers", "comm_buckets", "allowance")


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted peak bytes of one GPU (the busiest pipeline stage), by term."""
    terms: dict[str, int]
    stage: int
    layout: Layout
    wrapper: str
    stage_totals: list[int] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)
    phase: str = "backward"
    """when the peak happens: "backward" (activations in flight) or "step" (the optimizer update)"""

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())

    def fits(self, capacity_bytes: int) -> bool:
        return self.total_bytes <= capacity_bytes

    def summary(self) -> str:
        """``predicted peak per GPU 13.2 GiB (parameters 2.1, gradients 2.1, ...)``."""
        unit, scale = ("GiB", GIB) if self.total_bytes >= GIB else ("MiB", MIB)
        parts = ", ".join(f"{k.replace('_', ' ')} {v / scale:.2f}" for k, v in self.terms.items() if v)
        where = f" on pipeline stage {self.stage}" if self.layout.pp > 1 else ""
        if self.phase == "step":
            where += " at the optimizer step"
        return f"predicted peak per GPU {self.total_bytes / scale:.2f} {unit}{where} ({parts}; {unit})"


def in_flight(layout: Layout, stage: int) -> int:
    """Micro batches whose activations stage ``stage`` holds at once under 1F1B."""
    return max(1, min(layout.pp - stage, layout.num_micro_batches))


def stage_layers(cfg: ModelConfig, pp: int) -> list[tuple[int, bool, bool]]:
    """(transformer layers, has embedding, has output head) of each stage."""
    descs = model_spec.model_description(cfg)
    bounds = model_spec.stage_bounds(cfg, pp) if pp > 1 else [(0, len(descs))]
    out = []
    for start, stop in bounds:
        kinds = [descs[j].kind for j in range(start, stop)]
        out.append((kinds.count("transformer"), "embedding" in kinds, "output" in kinds))
    return out


def predict_memory(cfg: ModelConfig, vocab_size: int, layout: Layout, *, device: str = "cuda",
                   optimizer: str = "adam", buckets: Optional[BucketSizes] = None,
                   runtime: Optional[act.Runtime] = None) -> MemoryPrediction:
    """The peak bytes of one GPU (``device`` "cuda") or process (any other device: no CUDA context
    allowance) for ``layout``: the maximum over pipeline stages."""
    buckets = buckets or BucketSizes()
    rt = runtime or act.Runtime.for_device(device, cfg)
    rows = padded_vocab_rows(cfg, vocab_size, layout.tp)
    tensors = stage_tensors(cfg, vocab_size, layout.tp, layout.pp)
    shape = stage_layers(cfg, layout.pp)
    per_layer = act.layer_bytes(cfg, layout, rt)
    e = layout.param_bytes
    T = layout.rank_tokens * layout.micro_batch
    f1 = cfg.resolved_ffn_hidden_size * (2 if cfg.gated_mlp else 1)
    best: Optional[MemoryPrediction] = None
    totals = []
    for stage, (n_layers, has_embed, has_head) in enumerate(shape):
        dp_ranks = {0, layout.data_axis - 1}
        states: StateBytes = max((state_bytes(tensors[stage], layout, optimizer, buckets, r, device) for r in dp_ranks),
                                 key=lambda sb: sb.parameters + sb.gradients + sb.optimizer)
        k = in_flight(layout, stage)
        layers_saved, rebuilt = act.stage_layer_bytes(cfg, layout, rt, n_layers)
        saved = layers_saved + (act.embedding_bytes(cfg, layout, rt) if has_embed else 0)
        if has_head:
            saved += act.final_norm_bytes(cfg, layout, rt)
        # the backward of one layer: rebuilt activations (recomputation: a chunk's) or the gradients it makes
        working = max(rebuilt, 2 * e * T * max(cfg.hidden_size, f1 // layout.tp))
        activations = k * saved + (working if n_layers else 0)
        buffers = 0
        details: dict[str, int] = {"in_flight": k, "layers": n_layers, "per_layer": per_layer}
        if has_head:
            lb = act.logits_bytes(cfg, layout, rows)
            buffers += act.head_peak_bytes(lb, pipeline=layout.pp > 1)
            details.update(lb)
        if layout.pp > 1:
            sp_or_no_tp = layout.sequence_parallel or layout.tp == 1
            out_bytes = e * T * cfg.hidden_size // (1 if sp_or_no_tp else layout.tp)
            if not has_head:
                buffers += k * out_bytes                     # stage outputs kept for the backward
            if stage > 0:
                buffers += 2 * e * T * cfg.hidden_size       # receive buffers (activation, gradient)
        context = CUDA_CONTEXT_BYTES if device == "cuda" else CPU_PROCESS_BYTES
        churn = activations + buffers + states.buckets
        backward = {"parameters": states.parameters, "gradients": states.grads_backward,
                    "optimizer": states.optimizer, "activations": activations, "buffers": buffers,
                    "comm_buckets": states.buckets, "allowance": int(FRAGMENTATION * churn) + context}
        step = {"parameters": states.parameters, "gradients": states.gradients + states.step_transient,
                "optimizer": states.optimizer, "activations": 0, "buffers": 0, "comm_buckets": 0,
                "allowance": int(FRAGMENTATION * states.step_transient) + context}
        phase, terms = max((("backward", backward), ("step", step)), key=lambda pt: sum(pt[1].values()))
        pred = MemoryPrediction(terms, stage, layout, states.wrapper, details=details, phase=phase)
        totals.append(pred.total_bytes)
        if best is None or pred.total_bytes > best.total_bytes:
            best = pred
    assert best is not None
    return MemoryPrediction(best.terms, best.stage, layout, best.wrapper, totals, best.details, best.phase)
