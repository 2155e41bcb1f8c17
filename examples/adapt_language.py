#!/usr/bin/env python
"""Adapt a model to a new language, end to end on this machine (`make adapt-demo-tiny`), no download.

The path a researcher takes with LLaMA-3 or Mistral and Russian (docs/adaptation.md), in miniature:
  1. corpora          English-like, Russian-like and a mixed "instruction" corpus (synthetic JSONL)
  2. base model       a tiny Llama-style Hugging Face model with an English SentencePiece tokenizer,
                      pretrained briefly on mostly English, some Russian text (import-hf →
                      pretrain_gpt.py at TP=2 × PP=2 → export-hf)
  3. instruct twin    the base fine-tuned a little on the mixed corpus, given a chat template and
                      two chat special tokens of its own (what an instruct release looks like)
  4. new tokenizer    a Russian SentencePiece BPE tokenizer (tools/train_tokenizer.py)
  5. adapt            tools/adapt_vocab.py --mode replace: new embedding and output rows from the
                      mean of the old pieces, written at TP=2 × PP=2 (and, for comparison only,
                      the same with random new rows)
  6. train            embedding-only training at TP=2 × PP=2 (--train-only-embeddings), then a few
                      iterations of full training
  7. export + LEP     export-hf, then tools/propagate_embeddings.py carries the learned embeddings
                      into the instruct twin (Learned Embedding Propagation)
  8. generate         tools/generate.py with the adapted instruct model
At every step tools/evaluate.py scores the same held-out Russian text: bits per byte (comparable
across tokenizers) and characters per token. Everything goes under adapt_demo_out/ (or --out).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from examples.demo import shown_command  # noqa: E402
from megatron_ru.data.preprocess.synthetic import write_corpus  # noqa: E402
from megatron_ru.utils.cli import ArgumentParser  # noqa: E402

PY = sys.executable
TOOLS = os.path.join(ROOT, "tools")
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TARGET_LAYOUT = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
SEQ = 128
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def one_process_env() -> dict[str, str]:
    """The environment of a step that runs one process (a tool, not ranks under a launcher): torch's
    threads on every core this process may use. ``make`` exports OMP_NUM_THREADS=1 for the ranks, which
    share the cores; a lone process given one thread would leave the others idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return dict(os.environ, OMP_NUM_THREADS=str(cores))


def step(title: str, cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run one step of the walkthrough; ``env``: a launcher's environment (ranks), else
    :func:`one_process_env`."""
    print(f"\n== {title}\n$ {shown_command(cmd)}",
          flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env if env is not None else one_process_env(), stdout=subprocess.PIPE,
                          text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"step failed ({proc.returncode}): {title}")
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return proc.stdout


def mpirun(ranks: int) -> tuple[list[str], dict[str, str]]:
    from examples.demo import mpirun as demo_mpirun
    return demo_mpirun(ranks)


# ---- 1. corpora ----------------------------------------------------------------------------------
def corpora(out: str, scale: float) -> dict[str, str]:
    paths = {}
    for name, language, mb, seed in (("en", "en", 1.5, 1), ("ru", "ru", 1.5, 2), ("ru_eval", "ru", 0.04, 3),
                                      ("mix", "mixed", 0.5, 4), ("ru_some", "ru", 0.1, 5)):
        path = os.path.join(out, "corpora", f"{name}.jsonl")
        if not os.path.exists(path):
            n = write_corpus(path, int(mb * scale * 1e6), seed=seed, paragraphs=(2, 10), language=language,
                             common_only=True)
            print(f"== corpus {name}: {path} ({n} documents)", flush=True)
        paths[name] = path
    return paths


def train_tokenizer(out: str, corpus: str | list[str], name: str, vocab: int = 1000) -> str:
    prefix = os.path.join(out, "tokenizers", name)
    step(f"train the {name} SentencePiece BPE tokenizer ({vocab} pieces)",
         [PY, os.path.join(TOOLS, "train_tokenizer.py"), "--input", *([corpus] if isinstance(corpus, str) else corpus),
          "--output-prefix", prefix,
          "--model-type", "bpe", "--vocab-size", str(vocab), "--heldout-every", "0"])
    return prefix + ".model"


def preprocess(out: str, corpus: str, tokenizer: str, name: str) -> str:
    prefix = os.path.join(out, "data", name)
    step(f"preprocess {os.path.basename(corpus)} with the {name.split('_')[-1]} tokenizer",
         [PY, os.path.join(TOOLS, "preprocess_data.py"), "--input", corpus, "--output-prefix", prefix,
          "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tokenizer, "--append-eod",
          "--workers", "2", "--log-interval", "100000"])
    return prefix + "_text_document"


# ---- 2. the base model ---------------------------------------------------------------------------
def quiet_transformers() -> None:
    """No progress bars from transformers in this process (a tiny model loads and saves in a blink)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def create_hf_model(path: str, tokenizer_model: str) -> None:
    """A tiny Llama-style model, random, with the English tokenizer as Hugging Face files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ru.convert.tokenizer_files import sentencepiece_to_llama_fast, special_token_ids
    quiet_transformers()
    sentencepiece_to_llama_fast(tokenizer_model, path)
    ids = special_token_ids(path)
    import sentencepiece
    vocab = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model).vocab_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=ids["bos_token_id"],
                         eos_token_id=ids["eos_token_id"])
    LlamaForCausalLM(config).save_pretrained(path)
    print(f"== created a random Llama-style model in {path} ({vocab} vocabulary rows)", flush=True)


def train(out: str, name: str, load: str, data: str | list[str], iters: int, lr: float, *extra: str) -> str:
    """pretrain_gpt.py on 4 ranks (TP=2 × PP=2) from ``load`` (model flags and tokenizer from it)."""
    save = os.path.join(out, "checkpoints", name)
    shutil.rmtree(save, ignore_errors=True)
    launcher, env = mpirun(4)
    step(f"train '{name}': {iters} iterations at TP=2 x PP=2 {' '.join(extra)}".rstrip(),
         [*launcher, PY, os.path.join(ROOT, "pretrain_gpt.py"), *LAYOUT, "--distributed-backend", "gloo",
          "--load", load, "--use-checkpoint-args", "--finetune", "--save", save,
          "--seq-length", str(SEQ), "--micro-batch-size", "4", "--global-batch-size", "16",
          "--train-iters", str(iters), "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-decay-style", "cosine",
          "--lr-warmup-iters", str(max(1, iters // 10)), "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
          "--data-path", *([data] if isinstance(data, str) else data), "--split", "95,5,0", "--num-workers", "0",
          "--log-interval", str(max(1, iters // 4)), "--eval-interval", str(iters), "--eval-iters", "2",
          "--metrics-file", os.path.join(out, "metrics", f"{name}.jsonl"), "--distributed-timeout-minutes", "5",
          *extra], env=env)
    return save


def convert(kind: str, load: str, save: str, *extra: str) -> str:
    shutil.rmtree(save, ignore_errors=True)
    step(f"{kind}: {os.path.relpath(load, ROOT)} -> {os.path.relpath(save, ROOT)}",
         [PY, os.path.join(TOOLS, "convert_checkpoint.py"), kind, "--load", load, "--save", save, *extra])
    return save


def make_instruct(path: str) -> None:
    """Give the instruct twin what instruct releases have: a chat template and special tokens of its
    own (their embedding rows are new rows of the instruct model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    old = model.get_input_embeddings().weight.shape[0]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its note that new rows start from the old rows' mean: what we ask for
    try:
        model.resize_token_embeddings(len(tok), mean_resizing=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    print(f"== instruct twin: {len(tok) - old} chat tokens and a chat template added in {path}", flush=True)


# ---- evaluation ----------------------------------------------------------------------------------
def evaluate(out: str, label: str, model: str, text: str, scores: list[dict]) -> dict:
    report = os.path.join(out, "eval", f"{label}.json")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    step(f"evaluate '{label}' on held-out Russian text",
         [PY, os.path.join(TOOLS, "evaluate.py"), "--load", model, "--input", text, "--seq-length", str(SEQ),
          "--output-json", report])
    with open(report, encoding="utf-8") as f:
        result = json.load(f)
    overall = result.get("overall", result)
    scores.append({"step": label, "bits_per_byte": overall["bits_per_byte"],
                   "chars_per_token": overall["chars_per_token"]})
    print(f"-> {label}: {overall['bits_per_byte']:.4f} bits per byte, {overall['chars_per_token']:.2f} characters "
          "per token", flush=True)
    return overall


def sample_text(out: str, corpus: str) -> str:
    path = os.path.join(out, "corpora", "ru_sample.txt")
    with open(corpus, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as g:
        for line in f:
            g.write(json.loads(line)["text"] + "\n")
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "adapt_demo_out"))
    ap.add_argument("--scale", type=float, default=0.5, help="corpus size factor (1.0: about 3.6 MB in all)")
    ap.add_argument("--iters", type=int, default=60, help="iterations of base pretraining and embedding training")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    scores: list[dict] = []
    ckpt, hf = os.path.join(out, "checkpoints"), os.path.join(out, "hf")

    c = corpora(out, args.scale)
    # like LLaMA's or Mistral's: trained on English with a little Russian (Cyrillic letters, few Russian pieces)
    en_tok = train_tokenizer(out, [c["en"], c["ru_some"]], "english")
    ru_tok = train_tokenizer(out, c["ru"], "russian")
    data = {"en": preprocess(out, c["en"], en_tok, "en_english"), "mix": preprocess(out, c["mix"], en_tok, "mix_english"),
            "ru_old": preprocess(out, c["ru"], en_tok, "ru_english"), "ru": preprocess(out, c["ru"], ru_tok, "ru_russian")}

    # 2-3. base and instruct models (Hugging Face directories, as users download them)
    shutil.rmtree(os.path.join(hf, "base_init"), ignore_errors=True)
    create_hf_model(os.path.join(hf, "base_init"), en_tok)
    convert("import-hf", os.path.join(hf, "base_init"), os.path.join(ckpt, "base_init"), *TARGET_LAYOUT)
    # mostly English with some Russian, as the open models' pretraining data (their tokenizers spell Russian badly)
    base_ckpt = train(out, "base", os.path.join(ckpt, "base_init"), ["0.5", data["en"], "0.5", data["ru_old"]],
                      args.iters, 3e-3)
    base = convert("export-hf", base_ckpt, os.path.join(hf, "base"))
    instruct_ckpt = train(out, "instruct", base_ckpt, data["mix"], max(4, args.iters // 4), 1e-3)
    instruct = convert("export-hf", instruct_ckpt, os.path.join(hf, "instruct"))
    make_instruct(instruct)
    evaluate(out, "base (English tokenizer)", base, c["ru_eval"], scores)

    # 4-5. adapt the vocabulary
    sample = sample_text(out, c["ru_eval"])
    adapted = os.path.join(ckpt, "adapted")
    shutil.rmtree(adapted, ignore_errors=True)
    step("adapt the vocabulary: replace the English tokenizer by the Russian one (mean of old pieces)",
         [PY, os.path.join(TOOLS, "adapt_vocab.py"), "--model", base, "--new-tokenizer", ru_tok, "--mode", "replace",
          "--save", adapted, "--output-format", "megatron", *TARGET_LAYOUT, "--sample-text", sample,
          "--report-json", os.path.join(out, "eval", "adapt_report.json")])
    random_init = os.path.join(hf, "adapted_random_rows")
    shutil.rmtree(random_init, ignore_errors=True)
    step("for comparison only: the same adaptation with random new rows",
         [PY, os.path.join(TOOLS, "adapt_vocab.py"), "--model", base, "--new-tokenizer", ru_tok, "--mode", "replace",
          "--init", "random", "--save", random_init])
    evaluate(out, "adapted, random rows", random_init, c["ru_eval"], scores)
    evaluate(out, "adapted, mean of old pieces", adapted, c["ru_eval"], scores)

    # 6. train: embeddings only, then everything
    emb = train(out, "embeddings", adapted, data["ru"], args.iters, 1e-2, "--train-only-embeddings")
    evaluate(out, "after embedding-only training", emb, c["ru_eval"], scores)
    full = train(out, "full", emb, data["ru"], max(4, args.iters // 3), 1e-3)
    evaluate(out, "after full training", full, c["ru_eval"], scores)

    # 7. export and propagate into the instruct twin
    adapted_hf = convert("export-hf", full, os.path.join(hf, "adapted"))
    instruct_ru = os.path.join(hf, "instruct_ru")
    shutil.rmtree(instruct_ru, ignore_errors=True)
    step("Learned Embedding Propagation into the instruct twin (conversion mode; the layers' change from full "
         "training added with --layer-delta 1.0)",
         [PY, os.path.join(TOOLS, "propagate_embeddings.py"), "--base", base, "--adapted", adapted_hf,
          "--instruct", instruct, "--save", instruct_ru, "--layer-delta", "1.0"])
    evaluate(out, "instruct (English tokenizer)", instruct, c["ru_eval"], scores)
    evaluate(out, "instruct + LEP (Russian tokenizer)", instruct_ru, c["ru_eval"], scores)

    # 8. generate
    step("generate with the adapted instruct model",
         [PY, os.path.join(TOOLS, "generate.py"), "--load", instruct_ru, "--prompt", "Новости", "--greedy",
          "--max-new-tokens", "24"])
    return summary(out, scores)


def summary(out: str, scores: list[dict]) -> dict:
    print("\n== summary: the same held-out Russian text, scored at every step")
    print(f"{'step':42s} {'bits/byte':>10s} {'chars/token':>12s}")
    for s in scores:
        print(f"{s['step']:42s} {s['bits_per_byte']:10.4f} {s['chars_per_token']:12.2f}")
    by = {s["step"]: s["bits_per_byte"] for s in scores}
    expected = [("after embedding-only training", "adapted, mean of old pieces"),
                ("after embedding-only training", "adapted, random rows"),
                ("after full training", "after embedding-only training"),
                ("instruct + LEP (Russian tokenizer)", "instruct (English tokenizer)")]
    failed = [f"{a} ({by[a]:.4f}) is not below {b} ({by[b]:.4f})" for a, b in expected if not by[a] < by[b]]
    mean, rand = by["adapted, mean of old pieces"], by["adapted, random rows"]
    verdict = "ahead" if mean < rand else ("not ahead: a model this small mostly predicts its old short pieces, "
                                           "and their mean misleads the new output rows (docs/adaptation.md)")
    print(f"before training, mean-of-pieces rows vs random rows: {mean:.4f} vs {rand:.4f} bits per byte ({verdict})")
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(scores, f, indent=2, ensure_ascii=False)
    if failed:
        raise SystemExit("bits per byte did not fall where it should: " + "; ".join(failed))
    print(f"bits per byte fell at every step where it should; scores in {os.path.join(out, 'summary.json')}")
    return {"scores": scores}


if __name__ == "__main__":
    main()
