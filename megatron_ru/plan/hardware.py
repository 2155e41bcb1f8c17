"""GPU presets: memory, dense peak TFLOP/s, HBM bandwidth and link bandwidths per GPU.

Memory is what ``nvidia-smi`` reports as the total of one GPU (MiB), i.e. what the CUDA allocator
can reach before the context and allowance of :mod:`megatron_ru.plan.memory` are taken off. Peak
TFLOP/s are NVIDIA's dense (no sparsity) tensor-core figures of the SXM parts, as in
PEAK_TFLOPS below (the progress line's MFU uses the same table). Bandwidths are per GPU and per direction, in GB/s:
``intra_node`` the NVLink bandwidth of one GPU (V100 6 x 25, A100 12 x 25, H100/H200 18 x 25),
``inter_node`` the InfiniBand bandwidth per GPU of the usual DGX-class node (V100: one 100 Gb/s EDR
port per GPU, A100: 200 Gb/s HDR, H100/H200: 400 Gb/s NDR). Sites differ (ABCI's V100 nodes have two
EDR ports for four GPUs): give ``--inter-node-gbps`` for yours.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

#: dense peak TFLOP/s per device by (name fragment, precision); SXM parts, no sparsity
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}



def peak_tflops_for(device_name: str, precision: str) -> Optional[float]:
    """Peak dense TFLOP/s for a device name (``torch.cuda.get_device_name``) or None if unknown."""
    for key, table in PEAK_TFLOPS.items():
        if key in device_name.upper():
            value = table.get(precision, 0.0)
            return value or None
    return None


def device_peak_tflops(precision: str, override: Optional[float]) -> Optional[float]:
    if override is not None:
        return override
    if torch.cuda.is_available():
        return peak_tflops_for(torch.cuda.get_device_name(), precision)
    return None


GIB = 2 ** 30
MIB = 2 ** 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    peak_tflops: dict[str, float]
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    generation: str

    def peak(self, precision: str) -> float:
        value = self.peak_tflops.get(precision, 0.0)
        if not value:
            raise ValueError(f"{self.name} has no {precision} tensor cores (V100: use --fp16); give --peak-tflops "
                             f"or another precision")
        return value

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def _spec(name: str, mib: int, table: str, hbm: float, intra: float, inter: float) -> GpuSpec:
    return GpuSpec(name, mib * MIB, dict(PEAK_TFLOPS[table]), hbm, intra, inter, table)


PRESETS: dict[str, GpuSpec] = {s.name: s for s in (
    _spec("v100-16gb", 16160, "V100", 900.0, 150.0, 12.5),
    _spec("v100-32gb", 32510, "V100", 900.0, 150.0, 12.5),
    _spec("a100-40gb", 40536, "A100", 1555.0, 300.0, 25.0),
    _spec("a100-80gb", 81920, "A100", 2039.0, 300.0, 25.0),
    _spec("h100-80gb", 81559, "H100", 3350.0, 450.0, 50.0),
    _spec("h200-141gb", 143771, "H200", 4800.0, 450.0, 50.0),
)}


def gpu_spec(preset: Optional[str] = None, *, memory_gib: Optional[float] = None,
             peak_tflops: Optional[float] = None, intra_node_gbps: Optional[float] = None,
             inter_node_gbps: Optional[float] = None, hbm_gbps: Optional[float] = None) -> GpuSpec:
    """A preset with overrides, or a custom GPU from the four numbers (``--gpu`` or ``--gpu-memory-gib``,
    ``--peak-tflops``, ``--intra-node-gbps``, ``--inter-node-gbps``)."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"--gpu {preset!r} is not a preset; choose one of {', '.join(PRESETS)} or give "
                             f"--gpu-memory-gib/--peak-tflops/--intra-node-gbps/--inter-node-gbps")
        spec = PRESETS[preset]
    else:
        missing = [flag for flag, v in (("--gpu-memory-gib", memory_gib), ("--peak-tflops", peak_tflops))
                   if v is None]
        if missing:
            raise ValueError(f"no --gpu preset: give {' and '.join(missing)} (and --intra-node-gbps/"
                             f"--inter-node-gbps, default 300/25) or --gpu {'|'.join(PRESETS)}")
        spec = GpuSpec("custom", 0, {}, 2000.0, 300.0, 25.0, "custom")
    if memory_gib is not None:
        spec = replace(spec, memory_bytes=int(memory_gib * GIB))
    if peak_tflops is not None:
        spec = replace(spec, peak_tflops={"bf16": peak_tflops, "fp16": peak_tflops, "fp32": peak_tflops})
    if intra_node_gbps is not None:
        spec = replace(spec, intra_node_gbps=intra_node_gbps)
    if inter_node_gbps is not None:
        spec = replace(spec, inter_node_gbps=inter_node_gbps)
    if hbm_gbps is not None:
        spec = replace(spec, hbm_gbps=hbm_gbps)
    return spec
