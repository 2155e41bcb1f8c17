"""The planner's output: a ranked table, the rejected families, the best layout as
``pretrain_gpt.py`` flags and as the variables of the ABCI/Slurm job scripts, or one JSON object."""
from __future__ import annotations

from typing import Any

from megatron_ru.plan.hardware import GIB, GpuSpec
from megatron_ru.plan.layout import Layout
from megatron_ru.plan.search import Candidate, Plan


def job_variables(layout: Layout, num_gpus: int, gpus_per_node: int) -> dict[str, str]:
    """The settings of scripts/abci/settings.sh and scripts/slurm/*.sbatch for ``layout``."""
    extra = []
    if layout.cp > 1:
        extra += ["--context-parallel-size", str(layout.cp)]
        if layout.cp_comm == "a2a":
            extra += ["--cp-comm-type", "a2a"]
    if layout.sequence_parallel:
        extra.append("--sequence-parallel")
    if layout.recompute != "none":
        extra += ["--recompute-granularity", layout.recompute]
    nodes = -(-num_gpus // gpus_per_node)
    return {"TP": str(layout.tp), "PP": str(layout.pp), "ZERO_STAGE": str(layout.zero_stage),
            "PRECISION": layout.precision, "MICRO_BATCH_SIZE": str(layout.micro_batch),
            "GLOBAL_BATCH_SIZE": str(layout.global_batch), "SEQ_LENGTH": str(layout.seq_length),
            "EXTRA_ARGS": " ".join(extra), "NODES": str(nodes), "GPUS_PER_NODE": str(gpus_per_node)}


def _row(i: int, c: Candidate, capacity: int) -> str:
    t = c.time
    assert t is not None
    mem = c.memory.total_bytes
    return (f"{i:>3}  {c.layout.short():<38} {mem / GIB:>6.1f} ({100 * mem / capacity:>3.0f}%)  "
            f"{t.tokens_per_second_per_gpu:>9.0f}  {t.tflops_per_gpu:>7.1f}  {100 * t.mfu:>5.1f}%  {t.bottleneck}")


def format_plan(plan: Plan, gpu: GpuSpec, num_gpus: int, gpus_per_node: int, model_line: str, top: int = 10) -> str:
    lines = [model_line,
             f"{num_gpus} x {gpu.name} ({gpu.memory_gib:.1f} GiB, {gpus_per_node} per node; a layout leaves "
             f"{100 * plan.margin:.0f}% free); "
             f"{plan.considered} layouts considered, {len(plan.fitting)} fit"]
    if plan.fitting:
        lines.append(f"{'#':>3}  {'layout':<38} {'GiB/GPU':>12}  {'tokens/s/GPU':>9}  {'TFLOP/s':>7}  {'MFU':>6}  "
                     f"bottleneck")
        lines += [_row(i + 1, c, plan.capacity_bytes) for i, c in enumerate(plan.fitting[:top])]
        if len(plan.fitting) > top:
            lines.append(f"     ... {len(plan.fitting) - top} more (--top N)")
    if plan.rejected:
        lines.append("does not fit:")
        lines += [f"  {r}" for r in plan.rejected]
    if plan.invalid:
        lines.append("cannot run:")
        lines += [f"  {r}" for r in plan.invalid]
    best = plan.best
    if best is None:
        lines.append("no layout fits: more GPUs, a GPU with more memory, a shorter --seq-length, or a smaller model")
        return "\n".join(lines)
    lines.append(f"best: {best.memory.summary()}")
    lines.append("pretrain_gpt.py flags: " + " ".join(best.layout.flags()))
    env = job_variables(best.layout, num_gpus, gpus_per_node)
    nodes = env.pop("NODES")
    lines.append("job scripts (scripts/abci/settings.sh, scripts/slurm/*.sbatch): "
                 + " ".join(f'{k}="{v}"' if " " in v or not v else f"{k}={v}" for k, v in env.items()))
    lines.append(f"nodes: {nodes} (ABCI: qsub -l rt_F={nodes}; Slurm: sbatch --nodes={nodes} "
                 f"--gres=gpu:{gpus_per_node})")
    return "\n".join(lines)


def candidate_dict(c: Candidate, usable: int) -> dict[str, Any]:
    out: dict[str, Any] = {"label": c.layout.short(), "layout": {k: getattr(c.layout, k) for k in (
        "tp", "pp", "dp", "micro_batch", "global_batch", "seq_length", "sequence_parallel", "recompute",
        "zero_stage", "precision")}, "memory_bytes": c.memory.total_bytes, "memory_terms": c.memory.terms,
        "memory_stage": c.memory.stage, "memory_phase": c.memory.phase, "optimizer_wrapper": c.memory.wrapper,
        "fits": c.memory.total_bytes <= usable}
    if c.time is not None:
        out.update({"step_seconds": c.time.seconds, "step_parts_seconds": c.time.parts,
                    "tokens_per_second_per_gpu": c.time.tokens_per_second_per_gpu,
                    "tflops_per_gpu": c.time.tflops_per_gpu, "mfu": c.time.mfu, "bottleneck": c.time.bottleneck})
    return out


def plan_dict(plan: Plan, gpu: GpuSpec, num_gpus: int, gpus_per_node: int, model: dict[str, Any],
              top: int = 10) -> dict[str, Any]:
    best = plan.best
    return {"model": model, "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes,
                                    "peak_tflops": gpu.peak_tflops, "intra_node_gbps": gpu.intra_node_gbps,
                                    "inter_node_gbps": gpu.inter_node_gbps},
            "num_gpus": num_gpus, "gpus_per_node": gpus_per_node, "considered": plan.considered,
            "fitting": [candidate_dict(c, plan.usable_bytes) for c in plan.fitting[:top]],
            "memory_margin": plan.margin, "usable_bytes": plan.usable_bytes,
            "num_fitting": len(plan.fitting), "rejected": plan.rejected, "invalid": plan.invalid,
            "best": None if best is None else {
                **candidate_dict(best, plan.usable_bytes), "flags": best.layout.flags(),
                "job_variables": job_variables(best.layout, num_gpus, gpus_per_node)}}
