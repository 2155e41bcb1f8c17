"""Time per step of a layout: compute at an achievable fraction of peak, the 1F1B pipeline bubble,
and the communication of each parallel dimension over its link; the largest overhead is named.

* Compute: the FLOPs of ``megatron_ru.model.flops.flops_per_token`` (the TFLOP/s our log
  reports; recomputation adds a forward of the layers) of the busiest stage, divided by TP, at
  :data:`ACHIEVABLE_FRACTION` of the GPU's dense peak.
* Pipeline (Narayanan et al. 2021, section 2.2): a step takes ``(m + (p - 1) / v)`` micro-batch slots
  of the busiest stage, ``m`` micro batches per step, ``v`` virtual stages per GPU (1 for DeepSpeed's
  schedule): the bubble fraction is ``(p - 1) / (v m)``.
* Communication: the wire bytes per rank and step of :func:`megatron_ru.plan.comm.step_comm_bytes`
  (TP all-reduces / all-gathers / reduce-scatters, PP sends and receives, DP gradient reduction and
  ZeRO all-gather) over the intra-node (NVLink) bandwidth when the group fits in a node, else the
  inter-node bandwidth per GPU. Our trainer overlaps none of it (:data:`OURS`); other frameworks'
  published runs state what they overlap (:class:`Overlap`).
* Optimizer step: memory-bound, the optimizer's state read and written once over the HBM bandwidth.

Sources and what is calibrated: docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ru.config.model import ModelConfig
from megatron_ru.plan.hardware import GpuSpec
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.memory import MemoryPrediction
from megatron_ru.model.flops import ModelShape, flops_per_token

#: Share of the dense peak the model's FLOPs run at when nothing else waits: one number for every GPU
#: generation, calibrated once against the published reference points of docs/planner.md (their
#: predictions fall within 0.8-1.25 of the published figures), not per case.
ACHIEVABLE_FRACTION = 0.50


@dataclass(frozen=True)
class Overlap:
    """Which communication a framework hides behind compute (fractions 0..1) and its virtual
    pipeline stages per GPU (interleaved 1F1B)."""
    tp: float = 0.0
    pp: float = 0.0
    dp: float = 0.0
    virtual_stages: int = 1
    cp: float = 0.0


#: this trainer: Megatron-style TP collectives on the critical path, DeepSpeed's blocking pipeline
#: sends, the ZeRO/DP gradient reduction after the backward, the CP exchange waited for
OURS = Overlap()


@dataclass(frozen=True)
class StepTime:
    seconds: float
    parts: dict[str, float]
    """compute, bubble, tp, pp, dp, optimizer (seconds; they add up to ``seconds``)"""
    tokens_per_step: int
    world_size: int
    flops_per_step: float
    model_flops_per_step: float
    peak_tflops: float

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.seconds / self.world_size

    @property
    def tflops_per_gpu(self) -> float:
        """As our iteration log reports it (recomputation counted)."""
        return self.flops_per_step / self.seconds / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (recomputation not counted)."""
        return self.model_flops_per_step / self.seconds / self.world_size / 1e12 / self.peak_tflops

    @property
    def bottleneck(self) -> str:
        """The largest part that is not useful compute, with its share of the step (``bubble 12%``),
        or ``compute`` when the overheads add up to less than 10 %."""
        overheads = {k: v for k, v in self.parts.items() if k != "compute"}
        name = max(overheads, key=overheads.get)
        share = overheads[name] / self.seconds
        if sum(overheads.values()) / self.seconds < 0.10:
            return "compute"
        return f"{name} {100 * share:.0f}%"


def _stage_flops_per_token(cfg: ModelConfig, vocab_size: int, layout: Layout, n_layers: int, has_head: bool) -> float:
    recompute = layout.recompute == "full"
    layers = flops_per_token(ModelShape.of(cfg, 0, layout.seq_length, n_layers), recompute) if n_layers else 0.0
    head = 3 * 2 * cfg.hidden_size * vocab_size if has_head else 0.0
    return layers + head


def _link(gpu: GpuSpec, span: int, gpus_per_node: int) -> float:
    """Bandwidth (bytes/s) of a group whose ranks span ``span`` consecutive global ranks."""
    return 1e9 * (gpu.intra_node_gbps if span <= gpus_per_node else gpu.inter_node_gbps)


def comm_bytes(cfg: ModelConfig, vocab_size: int, layout: Layout) -> dict[str, int]:
    """Wire bytes per rank and step by dimension (helper module :mod:`megatron_ru.plan.comm`)."""
    from megatron_ru.plan.comm import step_comm_bytes
    return step_comm_bytes(cfg, vocab_size, layout)


def predict_step_time(cfg: ModelConfig, vocab_size: int, layout: Layout, gpu: GpuSpec, *, gpus_per_node: int = 8,
                      memory: MemoryPrediction | None = None, overlap: Overlap = OURS,
                      achievable_fraction: float = ACHIEVABLE_FRACTION) -> StepTime:
    from megatron_ru.plan.memory import stage_layers
    peak = gpu.peak(layout.precision)
    rate = peak * 1e12 * achievable_fraction
    m = layout.num_micro_batches
    tokens_mb = layout.micro_batch * layout.rank_tokens  # each token attends over the whole sample (FLOPs below)
    stages = stage_layers(cfg, layout.pp)
    t_mb = max(_stage_flops_per_token(cfg, vocab_size, layout, n, head) * tokens_mb / layout.tp / rate
               for n, _, head in stages)
    comm = comm_bytes(cfg, vocab_size, layout)
    tp, dp, cp = layout.tp, layout.dp, layout.cp
    t_tp = comm["tp"] / _link(gpu, tp, gpus_per_node) * (1 - overlap.tp)
    t_cp = comm.get("cp", 0) / _link(gpu, tp * cp, gpus_per_node) * (1 - overlap.cp)
    t_pp = comm["pp"] / _link(gpu, layout.world_size, gpus_per_node) * (1 - overlap.pp) if layout.pp > 1 else 0.0
    t_dp = (comm["dp"] + comm.get("mp", 0)) / _link(gpu, tp * cp * dp, gpus_per_node) * (1 - overlap.dp)
    slot = t_mb + (t_tp + t_cp + t_pp) / m  # one micro batch on the busiest stage, its TP, CP and PP messages
    bubble = (layout.pp - 1) / overlap.virtual_stages * slot
    t_opt = 0.0
    if memory is not None:
        t_opt = (2 * memory.terms["optimizer"] + memory.terms["parameters"] + memory.terms["gradients"]) / (gpu.hbm_gbps * 1e9)
    parts = {"compute": m * t_mb, "bubble": bubble, "tp": t_tp, "cp": t_cp, "pp": t_pp, "dp": t_dp,
             "optimizer": t_opt}
    tokens = layout.tokens_per_step
    total_layers = cfg.num_layers
    hw = flops_per_token(ModelShape.of(cfg, vocab_size, layout.seq_length, total_layers), layout.recompute == "full")
    model = flops_per_token(ModelShape.of(cfg, vocab_size, layout.seq_length, total_layers), False)
    return StepTime(sum(parts.values()), parts, tokens, layout.world_size, hw * tokens, model * tokens, peak)
