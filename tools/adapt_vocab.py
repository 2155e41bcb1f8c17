#!/usr/bin/env python
"""Give a model a new vocabulary (docs/adaptation.md).

    python tools/adapt_vocab.py --model HF_DIR_OR_CHECKPOINT --new-tokenizer NEW.model --mode replace \\
        --save OUT [--output-format megatron --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2]

Prints one JSON line (the report) on success; a user mistake prints one ``error:`` line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.adapt import adapt_vocab  # noqa: E402
from megatron_ru.utils import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adapt_vocab.py", description=adapt_vocab.HELP,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    adapt_vocab.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        report = adapt_vocab.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        cli.error(str(e))
        return 2
    cli.emit(json.dumps(report, default=str, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
