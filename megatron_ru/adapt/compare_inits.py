"""``tools/compare_inits.py``: every initialisation of a new vocabulary's rows, scored before training.

    python tools/compare_inits.py --model HF_DIR_OR_CKPT --new-tokenizer ru16k.model --input heldout.jsonl
    torchrun --nproc-per-node 2 tools/compare_inits.py ... --pipeline-model-parallel-size 2

The model is loaded once; for each method (:mod:`megatron_ru.adapt.inits`) the new input and output
rows are built in memory and swapped into the running model, and the same documents are scored as
``tools/evaluate.py`` scores them (bits per byte, comparable across tokenizers). Nothing is written
per method. A method is ``INPUT`` (the output layer the same), ``INPUT/OUTPUT`` (an untied model's
two sides chosen independently), either with ``+norm`` (input norm correction); ``focus`` needs
``--focus-corpus``, which adds it to the default methods (its fastText vectors are trained once).
The first row is the original model with its own tokenizer; characters per token and fertility
(tokens per whitespace-separated word) of both tokenizers are reported too. Output: a table and
``--output-json``.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Optional, Sequence

import torch

from megatron_ru.adapt.evaluate import (OVERALL, _context_token, _read_jsonl, Document, emit_report, score_documents,
                                        text_documents)
from megatron_ru.utils.dtypes import DTYPES
from megatron_ru.adapt.focus import add_focus_arguments, build_focus, focus_options
from megatron_ru.adapt.inits import CORPUS_METHODS, METHODS, correct_input_norms, init_rows
from megatron_ru.utils.logging import get_logger, log_rank0

log = get_logger(__name__)

DEFAULT_METHODS = tuple(m for m in METHODS if m not in CORPUS_METHODS) + ("mean+norm",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/compare_inits.py", allow_abbrev=False,
                                description="Bits per byte before training of every initialisation of new rows.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face directory or megatron_ru checkpoint (any TP/PP)")
    p.add_argument("--old-tokenizer", default=None, help="the model's tokenizer (default: saved with the model)")
    p.add_argument("--new-tokenizer", required=True, help="SentencePiece .model or Hugging Face tokenizer directory")
    p.add_argument("--input", required=True, help="JSONL documents to score (held-out text of the new language)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help=f"INPUT[/OUTPUT][+norm], each of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)}, "
                        "and focus with --focus-corpus)")
    p.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's maximum)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random methods")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--distributed-backend", default="auto", choices=("auto", "nccl", "gloo"))
    p.add_argument("--distributed-timeout-minutes", type=float, default=30.0)
    p.add_argument("--output-json", default=None)
    add_focus_arguments(p)
    return p


def parse_method(spec: str, tied: bool) -> tuple[str, str, bool]:
    """``INPUT[/OUTPUT][+norm]`` -> (input method, output method, norm correction)."""
    body, norm = (spec[:-5], True) if spec.endswith("+norm") else (spec, False)
    inp, _, out = body.partition("/")
    out = out or inp
    for m in (inp, out):
        if m not in METHODS:
            raise ValueError(f"--methods {spec}: {m!r} is not one of {', '.join(METHODS)}")
    if tied and out != inp:
        raise ValueError(f"--methods {spec}: the model ties its output layer to its input embedding: one method")
    return inp, out, norm


def _documents(path: str, keys: Sequence[str], limit: Optional[int], tokenizer: Any) -> tuple[list[Document], int]:
    texts = _read_jsonl(path, keys, None, limit)
    return text_documents(texts, tokenizer), sum(len(t.split()) for t, _ in texts)


def _score(runner: Any, docs: list[Document], start: int, length: int, state: Any) -> dict[str, Any]:
    return score_documents(runner, docs, start, length, length, state)[OVERALL]


def run(ns: argparse.Namespace, argv: Sequence[str] = ()) -> dict[str, Any]:
    from megatron_ru.adapt.vocab_map import build_vocab_map
    from megatron_ru.data.token_text import token_texts
    from megatron_ru.inference.model_io import model_tokenizer, open_model, open_tokenizer
    from megatron_ru.inference.runner import StageRunner, start_stage_runner
    from megatron_ru.model.spec import OUTPUT_WEIGHT, WORD_EMBEDDING_WEIGHT

    src = open_model(ns.model, "--model")
    _, old_tok = model_tokenizer(src, ns.old_tokenizer, "--old-tokenizer", "--model")
    _, new_tok = open_tokenizer(ns.new_tokenizer, "--new-tokenizer")
    specs = ns.methods or list(DEFAULT_METHODS) + (["focus"] if ns.focus_corpus else [])
    methods = [(spec, *parse_method(spec, src.cfg.tied_embeddings)) for spec in specs]
    uses_focus = any("focus" in (inp, out) for _, inp, out, _ in methods)
    if ns.focus_corpus and not uses_focus:
        raise ValueError("--focus-corpus is given but no method of --methods uses focus")
    focus_opts = focus_options(ns, uses_focus, "--methods focus")
    length = ns.seq_length or src.cfg.max_position_embeddings
    if not 2 <= length <= src.cfg.max_position_embeddings:
        raise ValueError(f"--seq-length {length}: must be in [2, {src.cfg.max_position_embeddings}]")
    old_docs, words = _documents(ns.input, ns.json_keys, ns.max_documents, old_tok)
    new_docs, _ = _documents(ns.input, ns.json_keys, ns.max_documents, new_tok)
    if not old_docs:
        raise ValueError(f"--input {ns.input}: no documents to score")
    old_texts, new_texts = token_texts(old_tok), token_texts(new_tok)
    vmap = build_vocab_map(old_tok, new_tok, old_texts, new_texts)
    fmap = build_focus(vmap, new_tok, new_texts, focus_opts) if focus_opts else None

    state, runner = start_stage_runner(ns, src.cfg, src.vocab_size, DTYPES[ns.dtype])
    cache: dict[str, torch.Tensor] = {}

    def get_src(name: str) -> torch.Tensor:
        if name not in cache:
            cache[name] = src.get(name)
        return cache[name]

    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    runner.load(get_src)
    rows.append({"method": "original", "tokenizer": "old", "words": words,
                 **_score(runner, old_docs, _context_token(old_tok), length, state)})
    log_rank0(log, f"original: {rows[-1]['bits_per_byte']:.4f} bits per byte")
    del runner
    new_rows = new_tok.vocab_size
    runner = StageRunner(src.cfg, new_rows, state, dtype=DTYPES[ns.dtype])
    for spec, inp, out, norm in methods:
        emb, fallbacks = init_rows(get_src(WORD_EMBEDDING_WEIGHT), vmap, inp, old_texts.pieces, seed=ns.seed,
                                   focus=fmap)
        if norm:
            computed = list(range(vmap.new_size)) if inp == "random-all" else vmap.new_ids()
            emb = correct_input_norms(emb, get_src(WORD_EMBEDDING_WEIGHT), computed, vmap.old_size)
        swapped = {WORD_EMBEDDING_WEIGHT: emb}
        if not src.cfg.tied_embeddings:
            swapped[OUTPUT_WEIGHT] = init_rows(get_src(OUTPUT_WEIGHT), vmap, out, old_texts.pieces, seed=ns.seed + 1,
                                               focus=fmap)[0]
        runner.load(lambda name: swapped[name] if name in swapped else get_src(name))
        rows.append({"method": spec, "input": inp, "output": out, "input_norm_correction": norm, "tokenizer": "new",
                     "words": words, "fallback": len(fallbacks),
                     **_score(runner, new_docs, _context_token(new_tok), length, state)})
        log_rank0(log, f"{spec}: {rows[-1]['bits_per_byte']:.4f} bits per byte")
    for r in rows:
        r["fertility"] = r["tokens"] / max(1, r["words"])
    out = {"model": ns.model, "new_tokenizer": ns.new_tokenizer, "input": ns.input, "seq_length": length,
           "tensor_model_parallel_size": state.tp_size, "pipeline_model_parallel_size": state.pp_size,
           "kept": vmap.counts()["kept"] + vmap.counts()["special"], "new_rows": len(vmap.new_ids()),
           "results": rows, "focus": fmap.summary() if fmap else None, "seconds": time.perf_counter() - t0}
    emit_report(out, format_table(out), ns.output_json, state)
    return out


def format_table(out: dict[str, Any]) -> str:
    head = f"{'method':<28} {'bits/byte':>10} {'chars/token':>11} {'tokens/word':>11} {'fallback':>8}"
    lines = [head, "-" * len(head)]
    for r in out["results"]:
        lines.append(f"{r['method']:<28} {r['bits_per_byte']:>10.4f} {r['chars_per_token']:>11.3f} "
                     f"{r['fertility']:>11.3f} {r.get('fallback', ''):>8}")
    f = out.get("focus")
    if f:
        lines.append(f"focus: fastText (dim {f['dim']}, {f['epochs']} epochs, min count {f['min_count']}) on "
                     f"{f['corpus_tokens']} tokens of {f['corpus']} in {f['fasttext_seconds']:.1f} s; "
                     f"{f['focus_rows']} rows from {f['mean_neighbours']:.1f} of {f['overlap_with_vector']} "
                     f"overlapping tokens on average (temperature {f['temperature']:g}), {f['no_vector_rows']} "
                     f"without a vector ({f['fallback']})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_ru.parallel.failure import distributed_tool_main
    return distributed_tool_main(argv, build_parser, run, what="the comparison")
