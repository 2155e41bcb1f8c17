"""``--torch-compile``: the transformer layers and (at TP = 1) the loss through ``torch.compile``.

The eager modules stay the reference: compiling changes the order of floating-point operations inside
fused kernels (not the math), so results agree with the eager path to rounding, not bit for bit
(``tests/unit/test_torch_compile.py`` holds the tolerances). Every layer of one shape shares one
compiled graph (parameters are graph inputs), so the compile cost is paid once per model.
"""
from __future__ import annotations

from torch import nn

from megatron_ru.model.gpt import GPTLoss
from megatron_ru.model.transformer import TransformerLayer


def compile_model(model: nn.Module, loss_fn: GPTLoss | None = None) -> int:
    """Compile every :class:`TransformerLayer` in ``model`` and ``loss_fn`` (default: ``model.loss_fn``
    when it has one). Returns the number of layers compiled."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile_forward()
    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss_fn", None)
    if isinstance(loss_fn, GPTLoss):
        loss_fn.compile()
    return len(layers)
