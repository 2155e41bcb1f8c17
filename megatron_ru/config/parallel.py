"""Parallel layout and process-group settings (Megatron flag names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg

BACKENDS = ("auto", "nccl", "gloo")
#: --cp-comm-type: the ring (p2p), the all-to-all (a2a), and Megatron-LM's all_gather (the keys/values of every
#: rank gathered: the same result as the ring, which runs it here)
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass
class ParallelConfig:
    """Distributed / parallelism"""

    tensor_model_parallel_size: int = arg(1, "Tensor-parallel degree (TP): ranks that split each layer.")
    pipeline_model_parallel_size: int = arg(
        1, "Pipeline-parallel degree (PP): stages the layers are cut into. "
           "Data-parallel degree = WORLD_SIZE / (TP x PP).")
    context_parallel_size: int = arg(
        1, "Context-parallel degree (CP): ranks that split each sample's sequence (each holds 2 of 2 x CP chunks, "
           "load-balanced for causal attention). Data-parallel degree = WORLD_SIZE / (TP x CP x PP); the "
           "sequence length must be a multiple of 2 x CP.")
    cp_comm_type: str = arg(
        "p2p", "How context-parallel attention exchanges keys/values: p2p (a ring over the CP ranks), a2a "
               "(DeepSpeed-Ulysses all-to-all: heads per TP rank divisible by CP), all_gather (runs as p2p, the "
               "same result); a2a+p2p is refused.", choices=CP_COMM_TYPES)
    sequence_parallel: bool = arg(
        False, "Megatron sequence parallelism: LayerNorm/dropout regions split along the sequence "
               "across the tensor-parallel group (needs TP > 1).")
    auto_layout: bool = arg(
        False, "Choose TP, PP, CP, sequence parallelism, the micro batch, recomputation and the ZeRO stage at start-up "
               "with the planner (python -m megatron_ru.plan) for this job's ranks, model, sequence, batch, precision "
               "and devices; the layout flags given explicitly are kept as constraints. Rerun on another number of "
               "ranks, the same command chooses again and continues the checkpoint (docs/planner.md).")
    gpu: Optional[str] = arg(
        None, "--auto-layout: the device to plan for, one of the planner's presets (v100-16gb, v100-32gb, a100-40gb, "
              "a100-80gb, h100-80gb, h200-141gb); default: the detected GPU. On CPU give this or --gpu-memory-gib "
              "with --peak-tflops.")
    gpu_memory_gib: Optional[float] = arg(
        None, "--auto-layout: the memory of one device to plan for (GiB); default: the detected GPU's (or --gpu's).")
    memory_margin: Optional[float] = arg(
        None, "--auto-layout: the share of a device's memory the chosen layout leaves free (default 0.05, as the "
              "planner's --memory-margin: its measured error and what a run holds beyond the step, BENCHMARKS.md).")
    gpus_per_node: Optional[int] = arg(
        None, "--auto-layout: devices per node (TP and CP stay within a node); default: the launcher's local world "
              "size.")
    distributed_backend: str = arg(
        "auto", "torch.distributed backend; auto = nccl when CUDA is available, else gloo.",
        choices=BACKENDS)
    distributed_timeout_minutes: float = arg(
        10.0, "Timeout of every collective; a stuck rank fails the job after this long "
              "instead of hanging.")
    use_mpi: bool = arg(
        False, "Accepted for Megatron-DeepSpeed script compatibility and ignored: OpenMPI ranks "
               "(and rank 0's address) are discovered automatically.")
    local_rank: Optional[int] = arg(
        None, "Set by the deepspeed launcher; accepted and ignored (LOCAL_RANK from the "
              "environment is used).", flags=("--local_rank", "--local-rank"))

    @property
    def backend(self) -> str | None:
        """The backend to request: None means choose from the hardware."""
        return None if self.distributed_backend == "auto" else self.distributed_backend

    def problems(self) -> list[str]:
        out = []
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if tp < 1:
            out.append(f"--tensor-model-parallel-size must be >= 1 (got {tp})")
        if pp < 1:
            out.append(f"--pipeline-model-parallel-size must be >= 1 (got {pp})")
        if self.context_parallel_size < 1:
            out.append(f"--context-parallel-size must be >= 1 (got {self.context_parallel_size})")
        if self.cp_comm_type not in CP_COMM_TYPES:
            out.append(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)} (got {self.cp_comm_type!r})")
        elif self.cp_comm_type == "a2a+p2p":
            out.append("--cp-comm-type a2a+p2p is not supported: the hierarchical exchange (all-to-all inside a group, "
                       "a ring across groups) needs --hierarchical-context-parallel-sizes, which is not available; "
                       "use --cp-comm-type p2p or a2a")
        if self.sequence_parallel and tp < 1:
            out.append(f"--sequence-parallel needs --tensor-model-parallel-size > 1 (got {tp}); "
                       "drop --sequence-parallel or raise TP")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            out.append(f"--gpu-memory-gib must be > 0 (got {self.gpu_memory_gib})")
        if self.memory_margin is not None and not 0 <= self.memory_margin < 1:
            out.append(f"--memory-margin must be a share in [0, 1) of a device's memory (got {self.memory_margin})")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            out.append(f"--gpus-per-node must be >= 1 (got {self.gpus_per_node})")
        if not self.auto_layout and (self.gpu, self.gpu_memory_gib, self.gpus_per_node,
                                     self.memory_margin) != (None, None, None, None):
            given = [f for f, v in (("--gpu", self.gpu), ("--gpu-memory-gib", self.gpu_memory_gib),
                                    ("--gpus-per-node", self.gpus_per_node), ("--memory-margin", self.memory_margin))
                     if v is not None]
            out.append(f"{', '.join(given)} describe the devices --auto-layout plans for: add --auto-layout or drop "
                       f"{'them' if len(given) > 1 else 'it'}")
        if not self.distributed_timeout_minutes > 0:
            out.append(f"--distributed-timeout-minutes must be > 0 (got {self.distributed_timeout_minutes})")
        if self.distributed_backend not in BACKENDS:
            out.append(f"--distributed-backend must be one of {', '.join(BACKENDS)} "
                       f"(got {self.distributed_backend!r})")
        return out
