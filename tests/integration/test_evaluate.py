"""tools/evaluate.py (acceptance 4 of the adaptation issue): bits per byte at TP2 x PP2 equals one
process and an independent computation with transformers (<= 1e-5); bits per byte of the same text
through two different tokenizers is what a hand computation gives (same bytes, different tokens);
long documents are scored in windows, each token once; a preprocessed dataset scores as its JSONL."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from megatron_ru.inference.model_io import open_model, save_model
from megatron_ru.data.preprocess.synthetic import document
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import make_hf_tokenizer_dir, make_sentencepiece, sample_texts

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "evaluate.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
DOMAINS = ("news", "wiki")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "MEGATRON_RU_LOG_LEVEL": "WARNING"}


def _docs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = document(rng, (1, 2), "mixed")
        out.append({"text": text[:rng.randint(40, 300)].strip(), "domain": DOMAINS[i % 2]})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_ru.convert.tokenizer_files import sentencepiece_to_llama_fast
    d = tmp_path_factory.mktemp("evaluate")
    sp = make_sentencepiece(str(d), vocab=600, texts=sample_texts(200), name="sp")
    sp_dir = str(d / "sp_hf")
    sentencepiece_to_llama_fast(sp, sp_dir)
    bl_dir = make_hf_tokenizer_dir(str(d), vocab=500)
    models = {"sp": tiny_llama(str(d / "model_sp"), vocab_size=600, tokenizer_dir=sp_dir, max_positions=256, seed=1),
              "bl": tiny_llama(str(d / "model_bl"), vocab_size=500, tokenizer_dir=bl_dir, max_positions=256, seed=2)}
    docs = _docs(8, 3)
    path = str(d / "eval.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for rec in docs:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return {"dir": d, "models": models, "docs": docs, "jsonl": path, "sp": sp}


def _evaluate(out: str, *argv: str, nproc: int = 1) -> dict:
    launcher = TORCHRUN + [str(nproc)] if nproc > 1 else [sys.executable]
    proc = subprocess.run(launcher + [TOOL, *argv, "--output-json", out, "--distributed-timeout-minutes", "2"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bits/byte" in proc.stdout and proc.stdout.count("overall") == 1
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _hand(model_dir: str, texts: list[str], window: int = 10 ** 9) -> tuple[float, int, int]:
    """sum of -ln p over every text token (context: BOS, else EOS), disjoint windows of ``window`` inputs,
    with transformers; returns (nats, tokens, bytes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    nats, tokens, nbytes = 0.0, 0, 0
    with torch.no_grad():
        for t in texts:
            ids = [start] + tok(t, add_special_tokens=False)["input_ids"]
            for b in range(0, len(ids) - 1, window):
                chunk = torch.tensor([ids[b:b + window + 1]])
                logp = torch.log_softmax(model(chunk[:, :-1]).logits[0].double(), -1)
                nats -= float(logp.gather(1, chunk[0, 1:, None]).sum())
            tokens += len(ids) - 1
            nbytes += len(t.encode("utf-8"))
    return nats, tokens, nbytes


def test_layouts_and_transformers_agree(setup):
    d, hf = setup["dir"], setup["models"]["sp"]
    src = open_model(hf)
    ckpt = save_model(str(d / "ckpt_sp"), kind="megatron", cfg=src.cfg, vocab_size=src.vocab_size, get_tensor=src.get,
                      tokenizer=src.tokenizer, tp=2, pp=2)
    one = _evaluate(str(d / "one.json"), "--load", hf, "--input", setup["jsonl"], "--group-by-key", "domain")
    four = _evaluate(str(d / "four.json"), "--load", ckpt, "--input", setup["jsonl"], "--group-by-key", "domain",
                     "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", nproc=4)
    nats, tokens, nbytes = _hand(hf, [r["text"] for r in setup["docs"]])
    hand_bpb = nats / math.log(2) / nbytes
    for res in (one, four):
        assert res["overall"]["tokens"] == tokens and res["overall"]["bytes"] == nbytes
        assert abs(res["overall"]["bits_per_byte"] - hand_bpb) <= 1e-5
    assert abs(one["overall"]["bits_per_byte"] - four["overall"]["bits_per_byte"]) <= 1e-5
    for dom in DOMAINS:
        texts = [r["text"] for r in setup["docs"] if r["domain"] == dom]
        n, _, b = _hand(hf, texts)
        assert abs(four["groups"][dom]["bits_per_byte"] - n / math.log(2) / b) <= 1e-5
        assert four["groups"][dom]["documents"] == len(texts)
    chars = sum(len(r["text"]) for r in setup["docs"])
    assert one["overall"]["characters"] == chars
    assert one["overall"]["bits_per_char"] == pytest.approx(nats / math.log(2) / chars, abs=1e-5)
    assert one["overall"]["chars_per_token"] == pytest.approx(chars / tokens)


def test_two_tokenizers_same_bytes(setup):
    """The same text through two models with different tokenizers: the same byte count, different
    token counts; each bits per byte is the hand computation's."""
    d = setup["dir"]
    texts = [r["text"] for r in setup["docs"]]
    results = {}
    for name, hf in setup["models"].items():
        res = _evaluate(str(d / f"tok_{name}.json"), "--load", hf, "--input", setup["jsonl"])["overall"]
        nats, tokens, nbytes = _hand(hf, texts)
        assert res["tokens"] == tokens and res["bytes"] == nbytes
        assert abs(res["bits_per_byte"] - nats / math.log(2) / nbytes) <= 1e-5
        results[name] = res
    assert results["sp"]["bytes"] == results["bl"]["bytes"] == sum(len(t.encode()) for t in texts)
    assert results["sp"]["tokens"] != results["bl"]["tokens"]


def test_windows_and_dataset_input(setup):
    d, hf = setup["dir"], setup["models"]["sp"]
    texts = [r["text"] for r in setup["docs"]]
    # disjoint windows of 16 inputs: transformers over the same windows
    res = _evaluate(str(d / "w16.json"), "--load", hf, "--input", setup["jsonl"], "--seq-length", "16")["overall"]
    nats, tokens, nbytes = _hand(hf, texts, window=16)
    assert res["tokens"] == tokens and abs(res["bits_per_byte"] - nats / math.log(2) / nbytes) <= 1e-5
    # overlapping windows give more context: not worse on average than disjoint ones; each token once
    strided = _evaluate(str(d / "s.json"), "--load", hf, "--input", setup["jsonl"], "--seq-length", "16",
                        "--stride", "4")["overall"]
    assert strided["tokens"] == tokens
    # a document that fits one window scores the same whatever the stride
    whole = _evaluate(str(d / "whole.json"), "--load", hf, "--input", setup["jsonl"])["overall"]
    fits = _evaluate(str(d / "fits.json"), "--load", hf, "--input", setup["jsonl"], "--seq-length", "256",
                     "--stride", "8")["overall"]
    assert fits["bits_per_byte"] == whole["bits_per_byte"]
    # a preprocessed dataset of the same documents (with end-of-document tokens): the same numbers
    prefix = str(d / "ds")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
                           setup["jsonl"], "--output-prefix", prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
                           "--tokenizer-model", setup["sp"], "--append-eod", "--workers", "1"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ds = _evaluate(str(d / "ds.json"), "--load", hf, "--data-path", prefix + "_text_document")["overall"]
    for key in ("tokens", "bytes", "characters", "documents"):
        assert ds[key] == whole[key], key
    assert abs(ds["bits_per_byte"] - whole["bits_per_byte"]) <= 1e-9


def test_bad_flags(setup, tmp_path):
    hf = setup["models"]["sp"]
    for argv, message in (
            (["--load", hf], "give exactly one of --input"),
            (["--load", hf, "--input", setup["jsonl"], "--stride", "999", "--seq-length", "16"], "--stride 999"),
            (["--load", hf, "--input", setup["jsonl"], "--seq-length", "100000"], "--seq-length 100000"),
            (["--load", hf, "--input", setup["jsonl"], "--group-by-key", "nope"], "--group-by-key nope"),
            (["--load", str(tmp_path), "--input", setup["jsonl"]], "--load")):
        proc = subprocess.run([sys.executable, TOOL, *argv], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr[-1500:])
