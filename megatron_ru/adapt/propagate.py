"""``tools/propagate_embeddings.py``: Learned Embedding Propagation (LEP, ADAPTATION.md step 4).

    python tools/propagate_embeddings.py --base /models/Llama-3-8B --adapted hf/llama3-8b-ru \\
        --instruct /models/Llama-3-8B-Instruct --save hf/llama3-8b-instruct-ru [--mode conversion]

The adapted **base** model learned embeddings for a new vocabulary; the **instruct** model of the same
family never saw them. Its input embedding (and, separately, its output layer; only the input side
when tied) becomes ``adapted @ P``, P a hidden × hidden map fitted in float64 by ordinary least
squares from the base model's matrix to the instruct model's:

* ``direct`` — no map: the adapted rows as they are;
* ``union`` — P fitted on the tokens whose text is in both the old and the new vocabulary (their old
  rows in base and instruct);
* ``conversion`` (default) — base and instruct matrices first converted to the new vocabulary by the
  mean-of-old-pieces rule of ``adapt_vocab`` (:mod:`megatron_ru.adapt.vocab_map`), P fitted on all
  new rows.

Every row of the new vocabulary is projected, shared tokens included (``--keep-original-rows``: the
tokens shared with the old vocabulary keep the instruct model's rows instead). Tokens the instruct
model added on top of the base vocabulary (chat-template specials) keep the instruct model's rows,
appended after the new tokenizer's ids; the output tokenizer is the adapted model's plus those tokens
(as added special tokens) with the instruct model's chat template. ``--layer-delta ALPHA`` adds
``ALPHA × (adapted − base)`` to every other parameter of the instruct model (for an adapted base whose
layers were trained too). The report gives each fit's relative residual ``‖XP − Y‖ / ‖Y‖``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch

from megatron_ru.adapt.vocab_map import build_vocab_map
from megatron_ru.utils.staging import check_output
from megatron_ru.data.token_text import token_texts
from megatron_ru.inference.model_io import KINDS, ModelSource, load_tokenizer, open_model, save_model
from megatron_ru.model.spec import OUTPUT_WEIGHT, WORD_EMBEDDING_WEIGHT, model_args_dict
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

HELP = "Learned Embedding Propagation: an adapted base model's embeddings into its instruct model"
MODES = ("direct", "union", "conversion")
EMB, OUT = WORD_EMBEDDING_WEIGHT, OUTPUT_WEIGHT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the original base model (HF directory or megatron_ru checkpoint)")
    p.add_argument("--adapted", required=True, help="the base model adapted to the new vocabulary (after training)")
    p.add_argument("--instruct", required=True, help="the instruct model of the same family (old vocabulary)")
    p.add_argument("--save", required=True, help="output directory")
    p.add_argument("--mode", choices=MODES, default="conversion", help="how the map is fitted (see the docs)")
    p.add_argument("--keep-original-rows", action="store_true",
                   help="tokens shared with the old vocabulary keep the instruct model's rows")
    p.add_argument("--layer-delta", type=float, default=None, metavar="ALPHA",
                   help="add ALPHA x (adapted - base) to every non-embedding parameter of the instruct model")
    p.add_argument("--output-format", choices=KINDS, default=None, help="hf or megatron (default: --instruct's kind)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="T")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, metavar="P")
    p.add_argument("--report-json", default=None, metavar="FILE", help="write the report here too")
    p.add_argument("--force", action="store_true", help="replace --save if it exists")


def fit_map(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """P minimising ‖xP − y‖ (float64 least squares) and the relative residual ‖xP − y‖ / ‖y‖."""
    x64, y64 = x.to(torch.float64), y.to(torch.float64)
    p = torch.linalg.lstsq(x64, y64, driver="gelsd").solution
    residual = float(torch.linalg.norm(x64 @ p - y64) / torch.linalg.norm(y64).clamp_min(1e-300))
    return p, residual


def _family_problems(base: ModelSource, adapted: ModelSource, instruct: ModelSource) -> list[str]:
    problems = []
    b, a, i = model_args_dict(base.cfg), model_args_dict(adapted.cfg), model_args_dict(instruct.cfg)
    for other, flag in ((a, "--adapted"), (i, "--instruct")):
        diff = [f"{k} {b[k]!r} vs {other[k]!r}" for k in b if b[k] != other.get(k)]
        if diff:
            problems.append(f"--base and {flag} are not the same architecture: " + ", ".join(diff))
    return problems


def _vocab_problems(base_texts: Any, instruct_texts: Any) -> list[str]:
    n = len(base_texts.pieces)
    if len(instruct_texts.pieces) < n:
        return [f"--instruct's tokenizer has {len(instruct_texts.pieces)} ids, fewer than --base's {n}: the instruct "
                "model must use the base vocabulary (possibly plus added tokens)"]
    differ = [j for j in range(n) if instruct_texts.pieces[j] != base_texts.pieces[j]]
    if differ:
        j = differ[0]
        return [f"--instruct's vocabulary is not --base's: {len(differ)} of the first {n} ids differ (first: id {j}, "
                f"{base_texts.display(j)!r} vs {instruct_texts.display(j)!r})"]
    return []


def _added_tokens(base_texts: Any, instruct_texts: Any) -> list[tuple[int, str]]:
    """(instruct id, string) of the tokens the instruct model added on top of the base vocabulary."""
    n = len(base_texts.pieces)
    names = {i: s for s, i in instruct_texts.specials.items()}
    return [(j, names.get(j) or instruct_texts.display(j)) for j in range(n, len(instruct_texts.pieces))]


def _output_tokenizer(adapted: ModelSource, instruct: ModelSource, added: list[tuple[int, str]], out_dir: str) -> Any:
    """The adapted model's tokenizer plus the instruct model's added tokens and chat template, saved
    as a Hugging Face tokenizer in ``out_dir``."""
    from transformers import AutoTokenizer

    from megatron_ru.convert.tokenizer_files import HF_TYPE, TokenizerSource, sentencepiece_to_llama_fast
    src = adapted.tokenizer
    if src.type != HF_TYPE:
        sentencepiece_to_llama_fast(src.path, os.path.join(out_dir, "base"))
        src = TokenizerSource(HF_TYPE, os.path.join(out_dir, "base"))
    tok = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    ins = AutoTokenizer.from_pretrained(instruct.tokenizer.path, local_files_only=True) \
        if instruct.tokenizer is not None and instruct.tokenizer.type == HF_TYPE else None
    if added:
        tok.add_special_tokens({"additional_special_tokens": [s for _, s in added]},
                               replace_extra_special_tokens=False)
    if ins is not None:
        if getattr(ins, "chat_template", None):
            tok.chat_template = ins.chat_template
        if ins.eos_token and ins.eos_token in tok.get_vocab():
            tok.eos_token = ins.eos_token        # e.g. an instruct model that ends turns with its own token
    final = os.path.join(out_dir, "final")
    tok.save_pretrained(final)
    return TokenizerSource(HF_TYPE, final), tok


def propagate(args: argparse.Namespace) -> dict[str, Any]:
    base = open_model(args.base, "--base")
    adapted = open_model(args.adapted, "--adapted")
    instruct = open_model(args.instruct, "--instruct")
    check_output(args.save, [("--base", args.base), ("--adapted", args.adapted), ("--instruct", args.instruct)],
                 args.force)
    problems = _family_problems(base, adapted, instruct)
    for model, flag in ((base, "--base"), (adapted, "--adapted"), (instruct, "--instruct")):
        if model.tokenizer is None:
            problems.append(f"{flag} {model.path} has no tokenizer saved with it")
    if problems:
        raise ValueError("; ".join(problems))
    base_tok, new_tok, ins_tok = (load_tokenizer(m.tokenizer) for m in (base, adapted, instruct))
    base_texts, new_texts, ins_texts = token_texts(base_tok), token_texts(new_tok), token_texts(ins_tok)
    problems = _vocab_problems(base_texts, ins_texts)
    if new_tok.vocab_size > adapted.vocab_size:
        problems.append(f"--adapted's tokenizer has {new_tok.vocab_size} ids but the model {adapted.vocab_size} rows")
    if problems:
        raise ValueError("; ".join(problems))
    vmap = build_vocab_map(base_tok, new_tok, base_texts, new_texts)
    added = _added_tokens(base_texts, ins_texts)
    n_old, n_new = base_tok.vocab_size, new_tok.vocab_size
    rows = max(adapted.vocab_size, n_new + len(added))
    names = [EMB] if instruct.cfg.tied_embeddings else [EMB, OUT]
    report: dict[str, Any] = {"save": os.path.abspath(args.save), "mode": args.mode, "maps": {},
                              "rows": rows, "new_tokenizer_ids": n_new,
                              "added_instruct_tokens": [s for _, s in added],
                              "keep_original_rows": bool(args.keep_original_rows), "layer_delta": args.layer_delta}
    shared = [(j, vmap.pieces[j][0]) for j, k in enumerate(vmap.kind) if k in ("kept", "special")]
    matrices: dict[str, torch.Tensor] = {}
    for name in names:
        x, y, a = base.get(name)[:n_old], instruct.get(name), adapted.get(name)
        dtype = y.dtype
        if args.mode == "direct":
            new, p, residual, fitted = a.to(torch.float64), None, None, 0
        else:
            if args.mode == "union":
                idx = torch.tensor([i for _, i in shared], dtype=torch.long)
                xs, ys = x[idx], y[idx]
            else:
                xs, ys = vmap.convert(x.to(torch.float64)), vmap.convert(y[:n_old].to(torch.float64))
            p, residual = fit_map(xs, ys)
            fitted = xs.shape[0]
            new = a.to(torch.float64) @ p
        out = torch.zeros((rows, a.shape[1]), dtype=torch.float64)
        out[:a.shape[0]] = new
        if args.keep_original_rows and shared:
            jj = torch.tensor([j for j, _ in shared])
            out[jj] = y[torch.tensor([i for _, i in shared])].to(torch.float64)
        for k, (ins_id, _) in enumerate(added):              # the instruct model's own tokens keep their rows
            out[n_new + k] = y[ins_id].to(torch.float64)
        matrices[name] = out.to(dtype)
        report["maps"][name] = {"residual": residual, "rows_fitted": fitted, "rows_projected": a.shape[0]}
        log.info(f"{name}: {args.mode} map" + ("" if p is None else
                 f" fitted on {fitted} rows, relative residual {residual:.3e}") + f"; {a.shape[0]} rows projected, "
                 f"{len(added)} instruct tokens kept")

    alpha = args.layer_delta

    def get_tensor(name: str) -> torch.Tensor:
        if name in matrices:
            return matrices[name]
        t = instruct.get(name)
        if alpha is None:
            return t
        delta = adapted.get(name).to(torch.float64) - base.get(name).to(torch.float64)
        return (t.to(torch.float64) + alpha * delta).to(t.dtype)

    kind = args.output_format or instruct.kind
    with tempfile.TemporaryDirectory(prefix="lep-tokenizer-") as tmp:
        tok_source, hf_tok = _output_tokenizer(adapted, instruct, added, tmp)
        wrong = [s for k, (_, s) in enumerate(added) if hf_tok.convert_tokens_to_ids(s) != n_new + k]
        if wrong:
            raise ValueError(f"the new tokenizer already holds the instruct model's added tokens {wrong} at other ids; "
                             "they cannot keep their instruct rows")
        save_model(args.save, kind=kind, cfg=instruct.cfg, vocab_size=rows, get_tensor=get_tensor, tokenizer=tok_source,
                   tp=args.target_tensor_parallel_size, pp=args.target_pipeline_parallel_size,
                   hf_config=instruct.hf_config, generation_config=instruct.generation_config, force=args.force)
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    return propagate(args)
