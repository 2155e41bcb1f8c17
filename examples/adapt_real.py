#!/usr/bin/env python
"""Adapt a real pretrained model to Russian, end to end on this machine (`make adapt-demo`).

SmolLM2-135M-Instruct (a trained LLaMA-architecture model with an English byte-level BPE) and
Russian man pages, both from the package registries (`make real-model`, tools/real_model.py):
  1. tokenizer      a 16k Russian SentencePiece BPE on the training pages
  2. initialise     tools/compare_inits.py: every initialisation of the new rows, scored before training
                    (FOCUS's fastText vectors learned on the training pages)
  3. adapt          tools/adapt_vocab.py --mode replace --init mean, written at TP 1 x PP 2
  4. train          embedding-only training at TP 1 x PP 2 (pretrain_gpt.py --train-only-embeddings)
  5. instruct twin  SmolLM2 itself, fine-tuned briefly on English man pages (a different mixture), as a
                    stand-in for the instruct release of the same base; scored with its own tokenizer
                    and with the new vocabulary's mean rows (the twin without LEP)
  6. LEP            tools/propagate_embeddings.py carries the trained embeddings into the twin
  7. generate       Russian text before (the original) and after (adapted, and the twin with LEP)
Bits per byte (comparable across tokenizers) and characters per token of the same held-out Russian
text at every step, in one table at the end; the orderings the method promises are checked:
mean rows ahead of random rows before training; after embedding-only training below the
original model with at least 3x its characters per token; the twin with LEP ahead of the twin
given the new vocabulary's mean rows (the same tokenizer without the trained embeddings) and
within 0.05 bits per byte of the adapted base. Everything goes under adapt_real_out/, with
summary.json (every score, the checks, the generations, the LEP report, FOCUS's figures) for scripts.

Training runs in bf16 with DeepSpeed's fp32 master weights, as on a GPU (`--precision fp32` for fp32: on 2
cores with bf16 matrix units about twice the time); scoring and generation run in fp32.
--quick is the shortened run (about 4 minutes on 2 cores instead of 22): mean, random and FOCUS rows
only, 10 embedding iterations, 2 twin iterations. 10 iterations do not reach the original model
(about 60 do), so it checks that training lowered bits per byte instead; every other check stays.
`make test` runs `--quick --iters 60` (tests/integration/test_adapt_real.py), which also checks that
the trained model went below the original.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.adapt_language import PY, TOOLS, mpirun, step  # noqa: E402
from megatron_ru.utils.cli import ArgumentParser  # noqa: E402
from tools.real_model import english_file, ensure, model_dir, text_file  # noqa: E402

LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
TARGET_LAYOUT = ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]
PROMPT = "Команда cat"
QUICK = {"methods": ["mean", "random", "focus"], "iters": 10, "twin_iters": 2}
FULL = {"methods": None, "iters": 60, "twin_iters": 10}
LEP_MARGIN = 0.05  # bits per byte between the twin with LEP and the adapted base it copies


def evaluate(out: str, label: str, model: str, scores: list[dict]) -> dict:
    report = os.path.join(out, "eval", f"{label.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    step(f"evaluate '{label}' on held-out Russian man pages",
         [PY, os.path.join(TOOLS, "evaluate.py"), "--load", model, "--input", text_file("ru_heldout_sample.jsonl"),
          "--seq-length", "512", "--output-json", report])
    with open(report, encoding="utf-8") as f:
        overall = json.load(f)["overall"]
    scores.append({"step": label, "bits_per_byte": overall["bits_per_byte"],
                   "chars_per_token": overall["chars_per_token"]})
    return overall


def train(out: str, name: str, load: str, data: str, iters: int, lr: float, precision: str, *extra: str) -> str:
    save = os.path.join(out, "checkpoints", name)
    shutil.rmtree(save, ignore_errors=True)
    launcher, env = mpirun(2)
    step(f"train '{name}': {iters} iterations at TP 1 x PP 2 in {precision} {' '.join(extra)}".rstrip(),
         [*launcher, PY, os.path.join(ROOT, "pretrain_gpt.py"), *LAYOUT, "--distributed-backend", "gloo",
          "--load", load, "--use-checkpoint-args", "--finetune", "--save", save, "--save-interval", str(iters),
          "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(iters),
          "--lr", str(lr), "--lr-decay-style", "constant", "--weight-decay", "0.0", "--adam-beta2", "0.95",
          "--adam-eps", "1e-5", "--clip-grad", "1.0", "--seed", "1234", "--data-path", data, "--split", "100,0,0",
          "--eval-iters", "0", "--num-workers", "0", "--log-interval", "10",
          "--metrics-file", os.path.join(out, "metrics", f"{name}.jsonl"), "--distributed-timeout-minutes", "30",
          *(["--bf16"] if precision == "bf16" else []), *extra], env=env)
    return save


def generate(out: str, label: str, model: str, prompt: str, generations: list[dict], *extra: str) -> None:
    result = os.path.join(out, "generate", f"{label.replace(' ', '_')}.jsonl")
    os.makedirs(os.path.dirname(result), exist_ok=True)
    step(f"generate with {label}", [PY, os.path.join(TOOLS, "generate.py"), "--load", model, "--prompt", prompt,
                                    "--greedy", "--max-new-tokens", "32", "--output-file", result, *extra])
    with open(result, encoding="utf-8") as f:
        record = json.loads(f.readline())
    generations.append({"model": label, "prompt": prompt, "completion": record["completion"],
                        "new_tokens": len(record["token_ids"])})


def instruct_twin(out: str, base: str, tok: str, iters: int, precision: str, scores: list[dict]) -> str:
    """SmolLM2 fine-tuned on English man pages, scored as it is and with the new vocabulary's mean rows
    (the twin without LEP: the same tokenizer as the twin with LEP, none of the trained embeddings)."""
    ckpt, hf = os.path.join(out, "checkpoints"), os.path.join(out, "hf")
    imported = os.path.join(ckpt, "smollm2")
    shutil.rmtree(imported, ignore_errors=True)
    step("import SmolLM2 at TP 1 x PP 2", [PY, os.path.join(TOOLS, "convert_checkpoint.py"), "import-hf", "--load",
                                          base, "--save", imported, *TARGET_LAYOUT])
    en = os.path.join(out, "data", "en")
    step("preprocess English man pages with SmolLM2's tokenizer",
         [PY, os.path.join(TOOLS, "preprocess_data.py"), "--input", english_file(), "--output-prefix", en,
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", base, "--append-eod",
          "--eod-token", "<|endoftext|>", "--workers", "1", "--log-interval", "100000"])
    twin_ckpt = train(out, "twin", imported, en + "_text_document", iters, 2e-5, precision)
    twin = os.path.join(hf, "twin")
    shutil.rmtree(twin, ignore_errors=True)
    step("export the twin", [PY, os.path.join(TOOLS, "convert_checkpoint.py"), "export-hf", "--load", twin_ckpt,
                             "--save", twin])
    evaluate(out, "instruct twin (English tokenizer)", twin, scores)
    twin_mean = os.path.join(hf, "twin_mean")
    shutil.rmtree(twin_mean, ignore_errors=True)
    step("the twin without LEP: the new vocabulary with mean-of-pieces rows (what LEP is compared with)",
         [PY, os.path.join(TOOLS, "adapt_vocab.py"), "--model", twin, "--new-tokenizer", tok, "--mode", "replace",
          "--save", twin_mean, "--output-format", "hf"])
    evaluate(out, "instruct twin, mean rows (no LEP)", twin_mean, scores)
    return twin


def propagate(out: str, base: str, emb: str, twin: str, scores: list[dict],
              generations: list[dict]) -> tuple[str, dict]:
    """LEP of the adapted base's trained embeddings into the twin; its score, generation and report."""
    hf = os.path.join(out, "hf")
    emb_hf = os.path.join(hf, "adapted")
    shutil.rmtree(emb_hf, ignore_errors=True)
    step("export the adapted model", [PY, os.path.join(TOOLS, "convert_checkpoint.py"), "export-hf", "--load", emb,
                                      "--save", emb_hf])
    twin_ru = os.path.join(hf, "twin_ru")
    shutil.rmtree(twin_ru, ignore_errors=True)
    lep_report = os.path.join(out, "eval", "lep.json")
    step("Learned Embedding Propagation into the twin (conversion mode)",
         [PY, os.path.join(TOOLS, "propagate_embeddings.py"), "--base", base, "--adapted", emb_hf, "--instruct", twin,
          "--save", twin_ru, "--report-json", lep_report])
    with open(lep_report, encoding="utf-8") as f:
        lep = json.load(f)
    evaluate(out, "instruct twin + LEP (Russian tokenizer)", twin_ru, scores)
    generate(out, "the twin with LEP", twin_ru, PROMPT, generations)
    return twin_ru, lep


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "adapt_real_out"))
    ap.add_argument("--quick", action="store_true",
                    help=f"the shortened run (`make test`): --methods {' '.join(QUICK['methods'])} --iters "
                         f"{QUICK['iters']} --twin-iters {QUICK['twin_iters']} unless given; checks that training "
                         "lowered bits per byte instead of that it went below the original model")
    ap.add_argument("--iters", type=int, default=None,
                    help=f"embedding-only training iterations (1,024 tokens each; default {FULL['iters']})")
    ap.add_argument("--twin-iters", type=int, default=None,
                    help=f"fine-tuning iterations of the instruct twin (default {FULL['twin_iters']})")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="training precision (default bf16, with DeepSpeed's fp32 master weights, as on a GPU; on a "
                         "CPU with bf16 matrix units about half the time of fp32); scoring and generation stay fp32")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="tools/compare_inits.py --methods (default: all, focus included)")
    args = ap.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ensure()
    base, scores, generations = model_dir(), [], []
    ckpt = os.path.join(out, "checkpoints")

    # 1. the Russian tokenizer; the original model's score and Russian
    tok = os.path.join(out, "tokenizers", "ru16k")
    step("train a 16k Russian SentencePiece BPE on the training pages",
         [PY, os.path.join(TOOLS, "train_tokenizer.py"), "--input", text_file("ru_train.jsonl"), "--heldout-input",
          text_file("ru_heldout.jsonl"), "--output-prefix", tok, "--model-type", "bpe", "--vocab-size", "16000"])
    tok += ".model"
    generate(out, "the original model (chat template)", base, "Что делает команда cat? Ответь по-русски.",
             generations, "--chat-template")

    # 2. every initialisation, before training
    report = os.path.join(out, "eval", "inits.json")
    focus = not args.methods or any("focus" in m for m in args.methods)
    step("compare every initialisation of the new rows before training (tools/compare_inits.py)",
         [PY, os.path.join(TOOLS, "compare_inits.py"), "--model", base, "--new-tokenizer", tok, "--input",
          text_file("ru_heldout_sample.jsonl"), "--seq-length", "512", "--output-json", report,
          *(["--methods", *args.methods] if args.methods else []),
          *(["--focus-corpus", text_file("ru_train.jsonl")] if focus else [])])
    with open(report, encoding="utf-8") as f:
        compared = json.load(f)
    inits = {r["method"]: r for r in compared["results"]}
    # the original model's score on the same text: compare_inits scores it as tools/evaluate.py does
    # (test_compare_inits.py), so it is not scored twice
    for name, label in (("original", "original (English tokenizer)"), ("mean", "adapted, mean rows (before training)"),
                        ("random", "adapted, random rows (before training)")):
        if name in inits:
            scores.append({"step": label,
                           "bits_per_byte": inits[name]["bits_per_byte"],
                           "chars_per_token": inits[name]["chars_per_token"]})

    # 3-4. adapt (mean) at the training layout, then embedding-only training
    adapted = os.path.join(ckpt, "adapted")
    shutil.rmtree(adapted, ignore_errors=True)
    step("adapt the vocabulary: replace, mean of old pieces, at TP 1 x PP 2",
         [PY, os.path.join(TOOLS, "adapt_vocab.py"), "--model", base, "--new-tokenizer", tok, "--mode", "replace",
          "--save", adapted, "--output-format", "megatron", *TARGET_LAYOUT])
    data = os.path.join(out, "data", "ru16k")
    step("preprocess the Russian training pages with the new tokenizer",
         [PY, os.path.join(TOOLS, "preprocess_data.py"), "--input", text_file("ru_train.jsonl"), "--output-prefix",
          data, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tok, "--append-eod",
          "--workers", "1", "--log-interval", "100000"])
    emb = train(out, "embeddings", adapted, data + "_text_document", args.iters, 3e-3, args.precision,
                "--train-only-embeddings")
    evaluate(out, "after embedding-only training", emb, scores)
    generate(out, "the adapted model", emb, PROMPT, generations)

    # 5. the instruct twin: SmolLM2 fine-tuned briefly on English man pages; 6. LEP into it
    twin = instruct_twin(out, base, tok, args.twin_iters, args.precision, scores)
    twin_ru, lep = propagate(out, base, emb, twin, scores, generations)
    run = {"quick": args.quick, "iters": args.iters, "twin_iters": args.twin_iters, "methods": args.methods,
           "precision": args.precision,
           "tokenizer": tok, "twin_with_lep": twin_ru}
    return summary(out, run, scores, inits, generations, lep, compared["focus"])


def checks(scores: list[dict], inits: dict, quick: bool) -> list[dict]:
    """The orderings the method promises, each with its figures and whether it held."""
    by = {s["step"]: s["bits_per_byte"] for s in scores}
    cpt = {s["step"]: s["chars_per_token"] for s in scores}
    original, trained = by["original (English tokenizer)"], by["after embedding-only training"]
    lep, twin_mean = by["instruct twin + LEP (Russian tokenizer)"], by["instruct twin, mean rows (no LEP)"]
    out = []

    def check(claim: str, held: bool, figures: str) -> None:
        out.append({"check": claim, "passed": bool(held), "figures": figures})

    if "mean" in inits and "random" in inits:
        check("mean rows ahead of random rows before training",
              inits["mean"]["bits_per_byte"] < inits["random"]["bits_per_byte"],
              f"{inits['mean']['bits_per_byte']:.4f} vs {inits['random']['bits_per_byte']:.4f}")
    if "mean" in inits:
        check("embedding-only training lowered bits per byte", trained < inits["mean"]["bits_per_byte"],
              f"{inits['mean']['bits_per_byte']:.4f} -> {trained:.4f}")
    if not quick:
        check("after embedding-only training below the original model", trained < original,
              f"{trained:.4f} vs {original:.4f}")
    ratio = cpt["after embedding-only training"] / cpt["original (English tokenizer)"]
    check("the new tokenizer gives at least 3x the original's characters per token", ratio >= 3, f"{ratio:.2f}x")
    check("the twin with LEP ahead of the twin with mean rows (same tokenizer, no trained embeddings)",
          lep < twin_mean, f"{lep:.4f} vs {twin_mean:.4f}")
    check(f"the twin with LEP within {LEP_MARGIN} bits per byte of the adapted base", abs(lep - trained) <= LEP_MARGIN,
          f"{lep:.4f} vs {trained:.4f}")
    return out


def summary(out: str, run: dict, scores: list[dict], inits: dict, generations: list[dict], lep: dict,
            focus: dict | None) -> dict:
    print("\n== initialisations before training (tools/compare_inits.py)")
    for name, r in inits.items():
        print(f"{name:28s} {r['bits_per_byte']:10.4f} bits per byte")
    print("\n== summary: the same held-out Russian text, scored at every step")
    print(f"{'step':44s} {'bits/byte':>10s} {'chars/token':>12s}")
    for s in scores:
        print(f"{s['step']:44s} {s['bits_per_byte']:10.4f} {s['chars_per_token']:12.2f}")
    results = checks(scores, inits, run["quick"])
    print("\n== checks")
    for c in results:
        print(f"{'ok  ' if c['passed'] else 'FAIL'} {c['check']}: {c['figures']}")
    report = {"run": run, "steps": scores, "inits": inits, "focus": focus, "checks": results,
              "generations": generations, "lep": lep}
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    failed = [c for c in results if not c["passed"]]
    if failed:
        raise SystemExit("; ".join(f"{c['check']} failed ({c['figures']})" for c in failed))
    print(f"every check held; summary in {os.path.join(out, 'summary.json')}")
    return report


if __name__ == "__main__":
    main()
