"""What DeepSpeed's checkpoint files hold, for reading them without DeepSpeed's own loader: the plain data
classes it pickles into them (allow-listed for ``torch.load(weights_only=True)``)."""
from __future__ import annotations

from typing import Any

__all__ = ["pickled_classes"]


def pickled_classes() -> list[Any]:
    """DeepSpeed's four plain data classes found in its model and optimizer files."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
