"""Small facts about torch's optimizers that several layers need."""
from __future__ import annotations

from typing import Any

import torch


def adam_step_tensor(step: int, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The ``step`` entry of a torch Adam/AdamW state for ``param`` in ``group``, where torch keeps it:
    on the parameter's device (float32) for the fused and capturable kernels, on the CPU otherwise (the
    for-loop and foreach kernels read it on the host)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step))
