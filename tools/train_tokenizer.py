#!/usr/bin/env python
"""Train a SentencePiece BPE or Unigram tokenizer from JSONL and report symbols per token.

    python tools/train_tokenizer.py --input 'corpus/*.jsonl' --output-prefix tok/ru_bpe32k \\
        --model-type bpe --vocab-size 32000

Every --heldout-every-th document (default: every 100th) is held out of training; the model's
characters per token and UTF-8 bytes per token on that held-out text are printed (stderr)
and written as one JSON line to stdout and to <prefix>.stats.json. The model is lossless by
default (identity normalization, byte fallback, no dummy prefix): see docs/data_format.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ru.config.tokenizer import TokenizerConfig  # noqa: E402
from megatron_ru.data.preprocess.encode import iter_texts  # noqa: E402
from megatron_ru.data.preprocess.reader import expand_inputs  # noqa: E402
from megatron_ru.data.tokenizer import build_tokenizer  # noqa: E402
from megatron_ru.data.tokenizers.train import symbols_per_token, train_sentencepiece  # noqa: E402
from megatron_ru.utils.cli import ArgumentParser  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="JSONL file(s) or quoted globs (.gz ok)")
    ap.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is used")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>.model, .vocab, .stats.json")
    ap.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--heldout-every", type=int, default=100,
                    help="hold out every N-th document (the last of each N) for evaluation; 0 = none")
    ap.add_argument("--heldout-input", nargs="+", default=None,
                    help="evaluate on these JSONL files instead (all input documents then train)")
    ap.add_argument("--character-coverage", type=float, default=0.9995)
    ap.add_argument("--input-sentence-size", type=int, default=2_000_000,
                    help="at most this many lines (sampled) are used for training")
    ap.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                    help="unknown characters become <unk> (the model is then lossy)")
    ap.add_argument("--add-dummy-prefix", action="store_true",
                    help="Llama-style leading '▁' (breaks exact paragraph-wise round trips)")
    ap.add_argument("--pad-id", type=int, default=-1, help="id of <pad> (-1: none)")
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-invalid", action="store_true", help="skip invalid JSONL lines instead of failing")
    args = ap.parse_args(argv)
    if args.vocab_size < 16:
        ap.error(f"--vocab-size {args.vocab_size} is too small")
    if args.heldout_every < 0 or args.heldout_every == 1:
        ap.error("--heldout-every must be 0 (no held-out text) or >= 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    files = expand_inputs(args.input)
    heldout: list[str] = []
    k = args.heldout_every if args.heldout_input is None else 0

    def training_texts():
        for i, text in enumerate(iter_texts(files, tuple(args.json_keys), args.skip_invalid)):
            if k and i % k == k - 1:
                heldout.append(text)
            else:
                yield text

    model = train_sentencepiece(
        training_texts(), args.output_prefix, args.model_type, args.vocab_size,
        character_coverage=args.character_coverage, byte_fallback=args.byte_fallback,
        add_dummy_prefix=args.add_dummy_prefix, input_sentence_size=args.input_sentence_size,
        num_threads=args.num_threads, pad_id=args.pad_id)
    if args.heldout_input is not None:
        heldout = list(iter_texts(expand_inputs(args.heldout_input), tuple(args.json_keys), args.skip_invalid))
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model))
    stats = {"model": model, "model_type": args.model_type, "vocab_size": tok.vocab_size}
    stats.update(symbols_per_token(tok, heldout) if heldout else {"documents": 0})
    with open(args.output_prefix + ".stats.json.tmp", "w", encoding="utf-8") as f:
        json.dump(stats, f)
    os.replace(args.output_prefix + ".stats.json.tmp", args.output_prefix + ".stats.json")
    if heldout:
        print(f"{model}: {args.model_type}, vocab {tok.vocab_size}; held-out {stats['documents']} documents: "
              f"{stats['symbols_per_token']:.3f} characters/token, {stats['bytes_per_token']:.3f} bytes/token",
              file=sys.stderr)
    else:
        print(f"{model}: {args.model_type}, vocab {tok.vocab_size}; no held-out text", file=sys.stderr)
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        sys.exit(1)
