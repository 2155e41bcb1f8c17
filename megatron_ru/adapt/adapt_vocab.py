"""``tools/adapt_vocab.py``: give a model a new vocabulary, its embeddings learned from the old ones.

    python tools/adapt_vocab.py --model /models/Meta-Llama-3-8B --new-tokenizer tok/ru32k.model \\
        --mode replace --save ckpt/llama3-ru32k --output-format megatron \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 4 --sample-text ru_sample.txt

The model is a Hugging Face directory or a megatron_ru checkpoint at any layout; the output is the
same kind (or ``--output-format``), with the new tokenizer and the new rows of the input embedding
and of the output layer (each from its own old rows, :mod:`megatron_ru.adapt.vocab_map`). Every
other tensor is copied as it is. A megatron_ru output records ``vocab_adaptation`` (mode, old
vocabulary size, the rows adaptation initialised) for ``--train-embedding-rows new``; a Hugging Face
output holds the same record in ``vocab_adaptation.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from typing import Any, Optional, Sequence

import torch

from megatron_ru.adapt.focus import FocusMap, add_focus_arguments, build_focus, focus_options
from megatron_ru.adapt.inits import METHODS, correct_input_norms, init_rows
from megatron_ru.adapt.vocab_map import VocabMap, build_vocab_map
from megatron_ru.utils.staging import check_output
from megatron_ru.data.token_text import token_texts
from megatron_ru.inference.model_io import KINDS, model_tokenizer, open_model, open_tokenizer, save_model
from megatron_ru.model.spec import OUTPUT_WEIGHT, WORD_EMBEDDING_WEIGHT as EMBEDDING_WEIGHT
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

HELP = "new vocabulary for a model, new embedding rows from the mean of the old pieces"
REPORT_FILE = "vocab_adaptation.json"
INITS = METHODS
#: fallback tokens named in the report
_LISTED = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory or megatron_ru checkpoint (any TP/PP)")
    p.add_argument("--old-tokenizer", default=None,
                   help="the model's tokenizer (default: the one saved with the model)")
    p.add_argument("--new-tokenizer", required=True,
                   help="SentencePiece .model (tools/train_tokenizer.py) or Hugging Face tokenizer directory")
    p.add_argument("--mode", choices=("replace", "extend"), default="replace",
                   help="replace: the new tokenizer replaces the old; extend: its pieces the old lacks are appended "
                        "after the old ids (saved in the old tokenizer's format)")
    p.add_argument("--extend-filter", default=None, metavar="REGEX",
                   help="extend: append only new pieces whose text matches (re.search), e.g. '[а-яёА-ЯЁ]'")
    p.add_argument("--init", choices=INITS, default="mean",
                   help="new rows of the input embedding (and of the output layer unless --output-init): mean of "
                        "the old pieces' rows, weighted-mean (earlier pieces more, whitespace less), char-weighted "
                        "(by piece length), max-char (the longest piece), mean-all, mean-target (old Cyrillic "
                        "tokens), hf-default (transformers' resize), random (N(0, std of the old rows); tokens "
                        "whose text is one old token, and matched special tokens, keep their old rows), "
                        "random-all (every row random: the fully random baseline), or focus (FOCUS: sparsemax-"
                        "weighted old rows of shared tokens near in a fastText space; needs --focus-corpus). "
                        "docs/adaptation.md")
    p.add_argument("--output-init", choices=INITS, default=None,
                   help="new rows of the output layer (default: --init); an untied model only")
    p.add_argument("--input-norm-correction", action="store_true",
                   help="rescale the new input-embedding rows to the median L2 norm of the old ones (output rows "
                        "are left alone; with tied embeddings the one matrix is the input)")
    p.add_argument("--seed", type=int, default=1234, help="seed of --init random and of --focus-fallback random")
    p.add_argument("--save", required=True, help="output directory")
    p.add_argument("--output-format", choices=KINDS, default=None,
                   help="hf or megatron (default: the kind of --model)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="T")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, metavar="P")
    p.add_argument("--sample-text", default=None, metavar="FILE",
                   help="UTF-8 text for the report: characters per token of both tokenizers, frequent new tokens")
    p.add_argument("--report-json", default=None, metavar="FILE", help="write the report here too")
    p.add_argument("--force", action="store_true", help="replace --save if it exists")
    add_focus_arguments(p)


def _ranges(ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def random_ids(vmap: VocabMap, init: str) -> list[int]:
    """The rows an initialisation computes: every row for ``random-all``, else the new rows."""
    return list(range(vmap.new_size)) if init == "random-all" else vmap.new_ids()


def new_matrix(old: torch.Tensor, vmap: VocabMap, init: str, rows: int, seed: int,
               old_pieces: Sequence[Optional[bytes]], norm_correction: bool = False,
               focus: Optional[FocusMap] = None) -> tuple[torch.Tensor, list[int]]:
    """The adapted matrix with ``rows`` rows by ``init`` (:mod:`megatron_ru.adapt.inits`), the computed
    rows rescaled to the old rows' median norm with ``norm_correction``, and the ids that got the mean
    of all old rows; rows past the new tokenizer's ids (a model with more rows than its tokenizer, as
    Qwen) keep the old rows when there are any, else the mean of the old rows; ``focus`` is what
    ``init`` focus needs."""
    new, fallbacks = init_rows(old, vmap, init, old_pieces, seed=seed, focus=focus)
    if norm_correction:
        new = correct_input_norms(new, old, random_ids(vmap, init), vmap.old_size)
    if rows > new.shape[0]:
        extra = old[new.shape[0]:rows] if old.shape[0] >= rows else \
            old[:vmap.old_size].to(torch.float64).mean(0, keepdim=True).expand(rows - new.shape[0], -1).to(old.dtype)
        new = torch.cat([new, extra.to(old.dtype)])
    return new, fallbacks


def _sample_report(sample: Optional[str], old_tok: Any, new_tok: Any, vmap: VocabMap, old_texts: Any,
                   new_texts: Any) -> dict[str, Any]:
    if not sample:
        return {}
    with open(sample, encoding="utf-8") as f:
        text = f.read()
    lines = [line for line in text.split("\n") if line]
    old_ids = [i for line in lines for i in old_tok.tokenize(line)]
    new_ids = [i for line in lines for i in new_tok.tokenize(line)]
    chars = sum(len(line) for line in lines)
    adapted = set(vmap.new_ids())
    freq = Counter(i for i in new_ids if i in adapted)
    top = [{"id": i, "token": new_texts.display(i), "count": n, "kind": vmap.kind[i],
             "old_pieces": [old_texts.display(j) for j in vmap.pieces[i]]} for i, n in freq.most_common(10)]
    return {"sample_text": sample, "characters": chars,
            "old_chars_per_token": chars / max(1, len(old_ids)), "new_chars_per_token": chars / max(1, len(new_ids)),
            "top_new_tokens": top}


def adapt_vocab(args: argparse.Namespace) -> dict[str, Any]:
    src = open_model(args.model, "--model")
    kind = args.output_format or src.kind
    check_output(args.save, [("--model", args.model), ("--old-tokenizer", args.old_tokenizer),
                             ("--new-tokenizer", args.new_tokenizer), ("--sample-text", args.sample_text),
                             ("--focus-corpus", args.focus_corpus)], args.force)
    if args.sample_text and not os.path.isfile(args.sample_text):
        raise FileNotFoundError(f"--sample-text {args.sample_text}: no such file")
    if args.extend_filter and args.mode != "extend":
        raise ValueError("--extend-filter applies to --mode extend only")
    output_init = args.output_init or args.init
    if src.cfg.tied_embeddings and output_init != args.init:
        raise ValueError(f"--output-init {output_init} differs from --init {args.init}, but --model {args.model} "
                         "ties its output layer to the input embedding: one matrix, one initialisation")
    if args.focus_corpus and "focus" not in (args.init, output_init):
        raise ValueError("--focus-corpus applies to --init focus or --output-init focus only")
    focus_opts = focus_options(args, "focus" in (args.init, output_init),
                               "--init focus" if args.init == "focus" else "--output-init focus")
    old_source, old_tok = model_tokenizer(src, args.old_tokenizer, "--old-tokenizer", "--model")
    new_source, new_tok = open_tokenizer(args.new_tokenizer, "--new-tokenizer")
    if old_tok.vocab_size > src.vocab_size:
        raise ValueError(f"--old-tokenizer has {old_tok.vocab_size} ids but --model {args.model} has only "
                         f"{src.vocab_size} vocabulary rows: it is not this model's tokenizer")
    old_texts, new_texts = token_texts(old_tok), token_texts(new_tok)
    with tempfile.TemporaryDirectory(prefix="adapt-vocab-") as tmp:
        skipped = intermediates = 0
        if args.mode == "extend":
            from megatron_ru.adapt.extend_tokenizer import extend_tokenizer
            from megatron_ru.inference.model_io import load_tokenizer
            ext = extend_tokenizer(old_source, old_texts, new_texts, os.path.join(tmp, "tokenizer"), args.extend_filter)
            target_source, skipped, intermediates = ext.tokenizer, ext.skipped, ext.intermediates
            target_tok = load_tokenizer(target_source)
            target_texts = token_texts(target_tok)
            rows = max(src.vocab_size, target_tok.vocab_size)
        else:
            target_source, target_tok, target_texts = new_source, new_tok, new_texts
            rows = target_tok.vocab_size
        vmap = build_vocab_map(old_tok, target_tok, old_texts, target_texts)
        fmap = build_focus(vmap, target_tok, target_texts, focus_opts) if focus_opts else None
        tensors = {}
        tensors[EMBEDDING_WEIGHT], fallbacks = new_matrix(src.get(EMBEDDING_WEIGHT), vmap, args.init, rows, args.seed,
                                                          old_texts.pieces, args.input_norm_correction, fmap)
        if not src.cfg.tied_embeddings:
            tensors[OUTPUT_WEIGHT], _ = new_matrix(src.get(OUTPUT_WEIGHT), vmap, output_init, rows, args.seed + 1,
                                                   old_texts.pieces, focus=fmap)
        computed = sorted(set(random_ids(vmap, args.init)) | set(random_ids(vmap, output_init)))
        record = {"mode": args.mode, "init": args.init, "output_init": output_init,
                  "input_norm_correction": bool(args.input_norm_correction), "old_vocab_size": src.vocab_size,
                  "new_rows": _ranges(computed)}
        counts = vmap.counts()
        report: dict[str, Any] = {
            "save": os.path.abspath(args.save), "output_format": kind, "mode": args.mode, "init": args.init,
            "old_vocab_size": src.vocab_size, "new_vocab_size": rows, "tokenizer_size": target_tok.vocab_size,
            "kept": counts["kept"] + counts["special"], "special_matched": counts["special"],
            "initialised_from_pieces": counts["pieces"], "fallback": len(fallbacks),
            "fallback_no_pieces": counts["fallback"],
            "random_rows": len(random_ids(vmap, args.init)) if args.init.startswith("random") else 0,
            "output_init": output_init, "input_norm_correction": bool(args.input_norm_correction),
            "fallback_tokens": [target_texts.display(i) for i in fallbacks[:_LISTED]],
            "appended_pieces": (target_tok.vocab_size - old_tok.vocab_size) if args.mode == "extend" else None,
            "skipped_pieces": skipped if args.mode == "extend" else None,
            "intermediate_tokens": intermediates if args.mode == "extend" else None,
            "focus": {**fmap.summary(), "no_vector_tokens": [target_texts.display(i) for i in fmap.no_vector[:_LISTED]]}
            if fmap else None,
            **_sample_report(args.sample_text, old_tok, target_tok, vmap, old_texts, target_texts)}

        def get_tensor(name: str) -> torch.Tensor:
            return tensors[name] if name in tensors else src.get(name)

        def side_files(out_dir: str) -> None:
            if kind == "hf":
                with open(os.path.join(out_dir, REPORT_FILE), "w", encoding="utf-8") as f:
                    json.dump(record, f, indent=1)

        save_model(args.save, kind=kind, cfg=src.cfg, vocab_size=rows, get_tensor=get_tensor,
                   tokenizer=target_source, tp=args.target_tensor_parallel_size, pp=args.target_pipeline_parallel_size,
                   hf_config=src.hf_config, generation_config=src.generation_config,
                   extra_meta={"vocab_adaptation": record} if kind == "megatron" else None, extra_files=side_files,
                   force=args.force)
    _log_report(report)
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
    return report


def _log_report(r: dict[str, Any]) -> None:
    log.info(f"adapted vocabulary ({r['mode']}, init {r['init']}): {r['old_vocab_size']} -> {r['new_vocab_size']} rows; "
             f"kept {r['kept']} (special tokens matched: {r['special_matched']}), initialised from old pieces "
             f"{r['initialised_from_pieces']}, fallback (mean of all rows) {r['fallback']}"
             + (f" ({r['fallback_no_pieces']} with no old piece: {', '.join(r['fallback_tokens'][:8])}"
                f"{', ...' if r['fallback'] > 8 else ''})" if r['fallback'] else ""))
    if r["random_rows"]:
        log.info(f"--init {r['init']}: {r['random_rows']} rows drawn at random"
                 + (f"; the {r['kept']} kept and matched special tokens keep their old rows (--init random-all "
                    "draws every row)" if r["init"] == "random" else ""))
    if r["focus"]:
        f = r["focus"]
        log.info(f"FOCUS: {f['focus_rows']} rows from a mean of {f['mean_neighbours']:.1f} overlapping tokens "
                 f"(of {f['overlap_with_vector']} with a fastText vector; temperature {f['temperature']:g}); "
                 f"{f['no_vector_rows']} new tokens without a vector -> --focus-fallback {f['fallback']}"
                 + (f" ({', '.join(f['no_vector_tokens'][:8])}{', ...' if f['no_vector_rows'] > 8 else ''})"
                    if f["no_vector_rows"] else "") + f"; fastText {f['fasttext_seconds']:.1f} s")
    if "new_chars_per_token" in r:
        log.info(f"characters per token on {r['sample_text']}: old tokenizer {r['old_chars_per_token']:.3f}, "
                 f"new {r['new_chars_per_token']:.3f}")
        for t in r["top_new_tokens"]:
            log.info(f"  {t['token']!r:>16} x{t['count']:<6} <- {' + '.join(repr(p) for p in t['old_pieces']) or '(mean of all rows)'}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return adapt_vocab(args)
