#!/usr/bin/env python
"""Print what a Megatron ``.bin/.idx`` dataset holds: dtype, counts, lengths, first tokens.

    python tools/dataset_info.py --data-path data/corpus_text_document \\
        [--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model]

With a tokenizer, the first tokens are also shown as text.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

from megatron_ru.config.base import arg, parse_configs  # noqa: E402
from megatron_ru.config.tokenizer import TokenizerConfig  # noqa: E402
from megatron_ru.data.indexed_dataset import IndexedDataset  # noqa: E402


@dataclass
class InfoConfig:
    """Dataset"""

    data_path: list[str] = arg(default_factory=list, help="Dataset prefix(es), without .bin/.idx.")
    num_tokens: int = arg(32, "How many tokens of each shown document to print.")
    show_documents: int = arg(2, "How many leading documents to show.")


def describe(prefix: str, num_tokens: int = 32, show_documents: int = 2, tokenizer=None) -> str:
    ds = IndexedDataset(prefix)
    lengths = np.asarray(ds.sequence_lengths)
    docs = np.diff(np.asarray(ds.document_indices))
    out = [f"{prefix}",
           f"  dtype {ds.dtype} ({ds.dtype.itemsize} bytes/token); .bin {os.path.getsize(prefix + '.bin'):,} bytes, "
           f".idx {os.path.getsize(prefix + '.idx'):,} bytes",
           f"  documents {ds.num_documents:,}, sequences {len(ds):,}, tokens {ds.num_tokens:,}"]
    if len(ds):
        out.append(f"  tokens per sequence: min {lengths.min()}, mean {lengths.mean():.1f}, max {lengths.max()}; "
                   f"sequences per document: min {docs.min()}, mean {docs.mean():.2f}, max {docs.max()}")
    for d in range(min(show_documents, ds.num_documents)):
        seqs = ds.document(d)
        toks = np.concatenate(seqs)[:num_tokens] if seqs else np.zeros(0, ds.dtype)
        out.append(f"  document {d}: {len(seqs)} sequence(s), {sum(s.size for s in seqs)} tokens; first {toks.size}: "
                   f"{toks.tolist()}")
        if tokenizer is not None:
            out.append(f"    text: {tokenizer.detokenize(toks.tolist())!r}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    cfgs = parse_configs([InfoConfig, TokenizerConfig], argv, description=__doc__.split("\n")[0])
    info, tok_cfg = cfgs[InfoConfig], cfgs[TokenizerConfig]
    if not info.data_path:
        raise ValueError("--data-path is required (a dataset prefix without .bin/.idx)")
    tokenizer = None
    if tok_cfg.tokenizer_type is not None:
        from megatron_ru.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(tok_cfg)
    text = "\n".join(describe(p, info.num_tokens, info.show_documents, tokenizer) for p in info.data_path)
    print(text)
    return text


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"dataset_info.py: error: {e}", file=sys.stderr)
        sys.exit(1)
