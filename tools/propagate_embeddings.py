#!/usr/bin/env python
"""Learned Embedding Propagation: carry an adapted base model's embeddings into its instruct model.

    python tools/propagate_embeddings.py --base BASE --adapted ADAPTED --instruct INSTRUCT --save OUT \\
        [--mode direct|union|conversion] [--keep-original-rows] [--layer-delta ALPHA]

Prints one JSON line (the report) on success; a user mistake prints one ``error:`` line and exits 2.
See megatron_ru/adapt/propagate.py and docs/adaptation.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt import propagate  # noqa: E402
from megatron_ru.utils import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.report_tool("propagate_embeddings.py", propagate))
