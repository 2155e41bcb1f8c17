#!/usr/bin/env python
"""Bits per byte before training of every initialisation of a new vocabulary's rows, in one table.

    python tools/compare_inits.py --model HF_DIR_OR_CHECKPOINT --new-tokenizer NEW.model --input heldout.jsonl

See megatron_ru/adapt/compare_inits.py and docs/adaptation.md.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt.compare_inits import main  # noqa: E402
from megatron_ru.parallel.failure import exit_with  # noqa: E402

if __name__ == "__main__":
    exit_with(main())
