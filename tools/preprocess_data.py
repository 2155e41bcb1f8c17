#!/usr/bin/env python
"""JSONL → Megatron-LM ``<prefix>_<key>_document.bin/.idx`` (see docs/data_format.md).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --output-prefix data/corpus \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

Progress goes to stderr every --log-interval documents, then a summary. Exit status 1 with a
message naming the file, line and fix on bad input (nothing is left at the output paths); on
Ctrl-C or SIGTERM, 130 or 143, and nothing is left either.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.config.base import parse_configs  # noqa: E402
from megatron_ru.config.tokenizer import TokenizerConfig  # noqa: E402
from megatron_ru.data.preprocess.config import PreprocessConfig  # noqa: E402
from megatron_ru.data.preprocess.pipeline import Summary, format_summary, run  # noqa: E402


def main(argv: list[str] | None = None) -> Summary:
    cfgs = parse_configs([PreprocessConfig, TokenizerConfig], argv, description=__doc__.split("\n")[0])
    summary = run(cfgs[PreprocessConfig], cfgs[TokenizerConfig])
    print(format_summary(summary), file=sys.stderr)
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ChildProcessError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (Interrupted says which)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"preprocess_data.py: interrupted by {signal.Signals(signum).name}; nothing was written", file=sys.stderr)
        sys.exit(128 + signum)
    # Done: every output is written, fsynced and renamed, every worker has ended. The interpreter's
    # teardown (freeing each object and module one by one) added 20-35 ms to every run here (a run
    # on one short document: 195 -> 160 ms, median of 20 paired), for nothing this process needs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
