"""``--fp8-format e4m3|hybrid`` and ``--fp8-recipe tensorwise|rowwise`` (Megatron-LM's flags): the transformer
layers' matmuls in FP8 through torchao's float8 training (PyPI ``torchao``, ``torchao.float8``).

Which linears: the four of every transformer layer (QKV, the attention's output projection, the MLP's two),
as Megatron-LM with TransformerEngine and torchtitan convert them; the output head, the embedding and LoRA
adapters stay in the training precision. A linear whose local shard has a dimension that is not a multiple of
16 (FP8 GEMMs need it) stays too, and is named in the start-up report.

What changes: only the three matmuls of each converted linear (forward, input gradient, weight gradient). Their
operands are cast to FP8 with a dynamic per-tensor (``tensorwise``) or per-row (``rowwise``) scale computed
from the operand at each step (torchao's current scaling: no amax history, so there is no state to save);
``e4m3``: every operand in float8_e4m3fn; ``hybrid``: the output gradient in float8_e5m2 (more range, fewer
digits), the rest e4m3. Master weights, optimizer, gradients' reduction, the checkpoint format, and with FP8
off every operation stay as they are: a checkpoint trained with FP8 continues without it and the reverse.

Tensor parallelism: with ``tensorwise`` a sharded operand is scaled by the WHOLE tensor's amax (this rank's
amax all-reduced with MAX over the TP group, what torchao's DTensor tensor parallelism computes): a column-
parallel weight and its output gradient, a row-parallel weight and its input. So every TP (and sequence-
parallel) layout quantizes to the same FP8 values as one process, and differs from it only by the order of the
sums. Context parallelism splits the tokens: an input's and an output gradient's amax are all-reduced over the
CP group too. ``rowwise`` scales along the contraction dimension, which a row-parallel shard splits (and, for
the weight gradient, along the tokens, which CP splits): refused with TP > 1 or CP > 1.

Devices: FP8 GEMMs need compute capability 8.9 (Ada, Hopper, Blackwell); on an older GPU (V100, A100) the flag is
refused. On a CPU, torchao's emulation: the same casts and scales, the product of the FP8 values in fp32 (what
an FP8 GEMM accumulates in); torch's own CPU float8 GEMM is a reference loop, ~1,000x slower. The wiring and
the numerics are testable without a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise")
#: FP8 GEMMs (cuBLASLt, torch._scaled_mm) take dimensions that are multiples of 16
FP8_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class Fp8Spec:
    format: str = "hybrid"
    recipe: str = "tensorwise"

    def describe(self) -> str:
        grads = "e5m2" if self.format == "hybrid" else "e4m3"
        return (f"FP8 {self.format} ({self.recipe} dynamic scaling; inputs and weights e4m3, output gradients "
                f"{grads}), torchao float8 training")


def torchao_float8() -> Any:
    """torchao's float8 package; an ImportError that says how to get it when torchao is missing."""
    try:
        import torchao.float8 as float8  # noqa: F401
        from torchao.float8 import float8_linear, float8_training_tensor, float8_utils  # noqa: F401
    except ImportError as e:  # pragma: no cover - torchao is in requirements.txt
        raise ImportError(f"--fp8-format needs torchao's float8 training: pip install torchao ({e})") from e
    return float8


def device_problem(device: torch.device) -> Optional[str]:
    """Why FP8 cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"--fp8-format needs FP8 matrix units (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                f"{name} is {major}.{minor}: drop --fp8-format and train in --bf16")
    return None


def float8_config(spec: Fp8Spec, device: torch.device) -> Any:
    """torchao's Float8LinearConfig for ``spec`` on ``device``: its recipe, the output gradients in e5m2
    (hybrid) or e4m3, emulated off CUDA (torch's CPU float8 GEMM is a reference loop: 1.2 s for a 128 x 64 x 256
    product, 2.5 ms emulated)."""
    torchao_float8()
    from torchao.float8.config import Float8LinearConfig
    config = (Float8LinearConfig() if spec.recipe == "tensorwise" else
              Float8LinearConfig.from_recipe_name("rowwise"))
    grad_dtype = torch.float8_e5m2 if spec.format == "hybrid" else torch.float8_e4m3fn
    fields: dict[str, Any] = {"emulate": device.type != "cuda"}
    for name in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"):
        cast = getattr(config, name)
        if cast.target_dtype is not None:
            fields[name] = dataclasses.replace(cast, target_dtype=grad_dtype)
    return dataclasses.replace(config, **fields)


class _Fp8GradOutput(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient cast to FP8 with the whole tensor's scale (its amax
    all-reduced over the groups that split it), so that torchao's matmul backward takes it as it is."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, matmul: "Fp8Matmul") -> torch.Tensor:  # type: ignore[override]
        ctx.matmul = matmul
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from torchao.float8.float8_training_tensor import GemmInputRole
        m: Fp8Matmul = ctx.matmul
        return m.cast(grad.contiguous(), m.config.cast_config_grad_output.target_dtype, GemmInputRole.GRAD_OUTPUT,
                      m.output_groups), None


class Fp8Matmul:
    """The FP8 product ``x @ weight.T`` of one column- or row-parallel linear (``kind`` "column" or "row"); a
    plain object, not a module: it holds no parameter or buffer, and the model's modules and state stay as
    they are."""

    def __init__(self, spec: Fp8Spec, config: Any, kind: str, tp_group: Any, tp_size: int,
                 cp_group: Any = None) -> None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
        self.spec, self.config, self.kind = spec, config, kind
        tp = [tp_group] if tp_group is not None and tp_size > 1 else []
        # context parallelism splits the tokens (inputs and output gradients), never the weight
        cp = [cp_group] if cp_group is not None else []
        # the groups over which this rank holds a shard of each operand (its scale is the whole tensor's)
        self.weight_groups = tp
        self.input_groups = (tp if kind == "row" else []) + cp
        self.output_groups = (tp if kind == "column" else []) + cp
        mm = [ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
              for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)]
        self.mm_config = LinearMMConfig(*mm)

    def cast(self, t: torch.Tensor, dtype: torch.dtype, role: Any, groups: list) -> torch.Tensor:
        """``t`` as torchao's Float8TrainingTensor with a tensorwise dynamic scale: the whole tensor's, its local
        amax all-reduced with MAX over each of ``groups`` (those that split it)."""
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
        amax = tensor_to_amax(t)
        if groups:
            amax = amax.float()  # exact: amax is one of t's values; gloo has no bfloat16 MAX
            for group in groups:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = amax_to_scale(amax, dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, dtype, self.mm_config, role)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import GemmInputRole
        x2 = x.reshape(-1, x.shape[-1])
        if self.spec.recipe == "tensorwise":
            e4m3 = self.config.cast_config_input.target_dtype
            xq = self.cast(x2, e4m3, GemmInputRole.INPUT, self.input_groups)
            wq = self.cast(weight, self.config.cast_config_weight.target_dtype, GemmInputRole.WEIGHT,
                           self.weight_groups)
            y = matmul_with_hp_or_float8_args.apply(xq, wq.t(), self.mm_config, self.config)
            y = _Fp8GradOutput.apply(y, self)
        else:  # rowwise (TP 1): torchao casts each operand along the GEMM's contraction dimension itself
            y = matmul_with_hp_or_float8_args.apply(x2, weight.t(), self.mm_config, self.config)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    def __repr__(self) -> str:
        return f"Fp8Matmul({self.kind}, {self.spec.format}, {self.spec.recipe}, emulate={self.config.emulate})"


def convert_to_fp8(model: nn.Module, spec: Fp8Spec, device: torch.device, cp_group: Any = None
                   ) -> tuple[list[str], list[str]]:
    """Give every column- and row-parallel linear of the transformer layers an FP8 matmul (``module.fp8``);
    ``cp_group``: the context-parallel group when CP > 1 (it splits the tokens). Returns (converted, kept):
    module names, the kept ones with why."""
    from megatron_ru.model.transformer import TransformerLayer
    from megatron_ru.parallel.layers import ColumnParallelLinear, RowParallelLinear
    problem = device_problem(device)
    if problem:
        raise ValueError(problem)
    config = float8_config(spec, device)
    converted, kept = [], []
    layers = {id(m) for m in model.modules() if isinstance(m, TransformerLayer)}
    for layer_name, layer in model.named_modules():
        if id(layer) not in layers:
            continue
        for name, mod in layer.named_modules():
            if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                continue
            full = f"{layer_name}.{name}"
            shape = tuple(mod.weight.shape)
            if any(d % FP8_DIM_MULTIPLE for d in shape):
                kept.append(f"{full} (local weight {list(shape)}: FP8 GEMMs need multiples of {FP8_DIM_MULTIPLE})")
                continue
            kind = "column" if isinstance(mod, ColumnParallelLinear) else "row"
            mod.fp8 = Fp8Matmul(spec, config, kind, mod.tp_group, mod.tp_size, cp_group)
            converted.append(full)
    return converted, kept
