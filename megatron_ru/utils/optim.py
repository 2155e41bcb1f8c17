"""Small facts about torch's optimizers that several layers need."""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


def weight_decay_groups(items: Sequence[T], decays: Callable[[T], bool]) -> list[tuple[bool, list[T]]]:
    """Megatron's optimizer groups, the one statement of their order: the items with weight decay
    (``decays``: matrices), then the rest (biases, norm weights), in the given order, empty groups
    dropped. The engine builds its optimizer with it; the checkpoint reader and the planner, which
    must find a parameter in the optimizer's flat state, use it too. Each group: (weight decay, items)."""
    groups = ((True, [t for t in items if decays(t)]), (False, [t for t in items if not decays(t)]))
    return [(decay, g) for decay, g in groups if g]


def adam_step_tensor(step: int, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The ``step`` entry of a torch Adam/AdamW state for ``param`` in ``group``, where torch keeps it:
    on the parameter's device (float32) for the fused and capturable kernels, on the CPU otherwise (the
    for-loop and foreach kernels read it on the host)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step))
