#!/usr/bin/env python
"""Give a model a new vocabulary (docs/adaptation.md).

    python tools/adapt_vocab.py --model HF_DIR_OR_CHECKPOINT --new-tokenizer NEW.model --mode replace \\
        --save OUT [--output-format megatron --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2]

Prints one JSON line (the report) on success; a user mistake prints one ``error:`` line and exits 2.
See megatron_ru/adapt/adapt_vocab.py.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt import adapt_vocab  # noqa: E402
from megatron_ru.utils import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.report_tool("adapt_vocab.py", adapt_vocab))
