#!/usr/bin/env python
"""Plan a run before it waits in the queue: which TP x PP x DP x micro batch x recomputation x ZeRO
layouts of a model fit the GPUs, how fast each is, and the best one as flags and job-script
variables. Same as ``python -m megatron_ru.plan`` (``--help`` for the flags; docs/planner.md)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.plan.cli import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run())
