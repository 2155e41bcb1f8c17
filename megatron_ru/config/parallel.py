"""Parallel layout and process-group settings (Megatron flag names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ru.config.base import arg

BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """Distributed / parallelism"""

    tensor_model_parallel_size: int = arg(1, "Tensor-parallel degree (TP): ranks that split each layer.")
    pipeline_model_parallel_size: int = arg(
        1, "Pipeline-parallel degree (PP): stages the layers are cut into. "
           "Data-parallel degree = WORLD_SIZE / (TP x PP).")
    sequence_parallel: bool = arg(
        False, "Megatron sequence parallelism: LayerNorm/dropout regions split along the sequence "
               "across the tensor-parallel group (needs TP > 1).")
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
        if self.sequence_parallel and tp < 1:
            out.append(f"--sequence-parallel needs --tensor-model-parallel-size > 1 (got {tp}); "
                       "drop --sequence-parallel or raise TP")
        if not self.distributed_timeout_minutes > 0:
            out.append(f"--distributed-timeout-minutes must be > 0 (got {self.distributed_timeout_minutes})")
        if self.distributed_backend not in BACKENDS:
            out.append(f"--distributed-backend must be one of {', '.join(BACKENDS)} "
                       f"(got {self.distributed_backend!r})")
        return out
