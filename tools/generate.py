#!/usr/bin/env python
"""Generate text from a megatron_ru checkpoint at any tensor- and pipeline-parallel size.

    python tools/generate.py --load CKPT --prompt "Hello" --greedy --max-new-tokens 32
    torchrun --nproc-per-node 4 tools/generate.py --load CKPT --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt-file prompts.jsonl --top-p 0.9 --output-file out.jsonl

Launch like training (torchrun, mpirun, srun). See docs/inference.md; ``--help`` lists every flag.
Exit status: 0 done, 2 a bad flag or input, 1 a failure.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.inference.cli import main  # noqa: E402
from megatron_ru.parallel.failure import exit_with  # noqa: E402

if __name__ == "__main__":
    exit_with(main())
