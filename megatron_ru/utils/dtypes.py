"""The dtype names the command-line tools take (``--dtype fp32|bf16|fp16``), as Megatron-LM spells
the precisions (``--bf16``, ``--fp16``), and the torch dtypes they mean."""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
