#!/usr/bin/env python
"""Score text with a model: loss, perplexity, bits per byte and per character, characters per token.

    python tools/evaluate.py --load CHECKPOINT_OR_HF_DIR --input eval.jsonl [--group-by-key domain]

See megatron_ru/adapt/evaluate.py and docs/adaptation.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt import evaluate  # noqa: E402
from megatron_ru.parallel.failure import exit_with  # noqa: E402
from megatron_ru.utils.cli import with_one_line_errors  # noqa: E402

# usage mistakes as one line with a suggestion, as in every other tool
evaluate.build_parser = with_one_line_errors(evaluate.build_parser)

if __name__ == "__main__":
    exit_with(evaluate.main())
