#!/usr/bin/env python
"""Score text with a model: loss, perplexity, bits per byte and per character, characters per token.

    python tools/evaluate.py --load CHECKPOINT_OR_HF_DIR --input eval.jsonl [--group-by-key domain]

See megatron_ru/adapt/evaluate.py and docs/adaptation.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt.evaluate import main  # noqa: E402
from megatron_ru.training.failure import exit_with  # noqa: E402

if __name__ == "__main__":
    exit_with(main())
