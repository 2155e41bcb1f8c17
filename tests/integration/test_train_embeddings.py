"""Training the embeddings of an adapted model (acceptance 2 of the adaptation issue, second half):
``--train-only-embeddings`` at PP = 4 (middle stages with nothing to train) and TP2 x PP2 lowers the
loss while every other parameter stays bit-identical; ``--train-embedding-rows new`` trains only the
rows the adaptation initialised, the kept rows bit-identical with weight decay on, at fp32 ZeRO 1 and
bf16; the adaptation record is carried into the saved checkpoints."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_ru.inference.model_io import open_model, save_model
from tests.dist_utils import run_distributed
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import adaptation_tokenizers, language_texts
from tests.integration._train_helpers import train_body

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"DS_ACCELERATOR": "cpu"}
EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_emb")
    _, new_sp, tok_dir = adaptation_tokenizers(str(d))
    base = tiny_llama(str(d / "base"), vocab_size=600, hidden=64, layers=4, heads=4, kv_heads=2, ffn=128,
                      max_positions=64, tokenizer_dir=tok_dir)
    hf = str(d / "adapted_hf")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "adapt_vocab.py"), "--model", base,
                           "--new-tokenizer", new_sp, "--mode", "extend", "--extend-filter", "[а-яё]", "--save", hf],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    src = open_model(hf)
    ckpts = {}
    for tp, pp in ((1, 4), (2, 2)):
        ckpts[(tp, pp)] = save_model(str(d / f"adapted_tp{tp}pp{pp}"), kind="megatron", cfg=src.cfg,
                                     vocab_size=src.vocab_size, get_tensor=src.get, tokenizer=src.tokenizer, tp=tp,
                                     pp=pp, extra_meta={"vocab_adaptation": _record(hf)})
    plain = save_model(str(d / "plain_tp2pp2"), kind="megatron", cfg=src.cfg, vocab_size=src.vocab_size,
                       get_tensor=src.get, tokenizer=src.tokenizer, tp=2, pp=2)
    corpus = d / "ru.jsonl"
    import json
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in language_texts("ru", 150, 6)),
                      encoding="utf-8")
    prefix = str(d / "ru")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                           hf, "--append-eod", "--workers", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"dir": d, "src": src, "ckpts": ckpts, "plain": plain, "data": prefix + "_text_document",
            "old_vocab": 600}


def _record(hf: str) -> dict:
    import json
    with open(os.path.join(hf, "vocab_adaptation.json"), encoding="utf-8") as f:
        return json.load(f)


def _argv(load: str, save: str, data: str, tp: int, pp: int, *extra: str) -> list[str]:
    return ["--load", load, "--use-checkpoint-args", "--finetune", "--save", save,
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "8",
            "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-path", data, "--split", "100,0,0", "--num-workers", "0",
            "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "2", *extra]


def test_embedding_training_at_every_layout(adapted):
    d, data = adapted["dir"], adapted["data"]
    runs = {
        "pp4": _argv(adapted["ckpts"][(1, 4)], str(d / "out_pp4"), data, 1, 4, "--train-only-embeddings"),
        "tp2pp2": _argv(adapted["ckpts"][(2, 2)], str(d / "out_tp2pp2"), data, 2, 2, "--train-only-embeddings"),
        "new_rows": _argv(adapted["ckpts"][(2, 2)], str(d / "out_new"), data, 2, 2, "--train-only-embeddings",
                          "--train-embedding-rows", "new", "--zero-stage", "1"),
        "new_rows_bf16": _argv(adapted["ckpts"][(2, 2)], str(d / "out_bf16"), data, 2, 2, "--train-only-embeddings",
                               "--train-embedding-rows", "new", "--bf16", "--zero-stage", "1"),
    }
    bad = ["expect-error"] + _argv(adapted["plain"], str(d / "out_bad"), data, 2, 2, "--train-only-embeddings",
                                   "--train-embedding-rows", "new")
    results = run_distributed(train_body, 4, args=(list(runs.values()) + [bad],), timeout=600, env=ENV)[0]
    by = dict(zip(runs, results))
    assert "records no vocabulary adaptation" in results[-1]["error"]
    src = adapted["src"]
    v_old = adapted["old_vocab"]
    for name, res in by.items():
        losses = res["losses"]
        assert losses[8] < losses[1] - 0.2, (name, losses)             # embedding-only training learns
        out = open_model(str(d / f"out_{name.replace('new_rows_bf16', 'bf16').replace('new_rows', 'new')}"))
        assert out.meta.vocab_adaptation == _record(str(d / "adapted_hf")), name   # carried forward
        for canonical in src.names():
            got, want = out.get(canonical), src.get(canonical)
            if canonical in (EMB, OUT):
                if "new_rows" in name:                                 # kept rows exact, new rows learned
                    assert torch.equal(got[:v_old], want[:v_old].to(got.dtype)), (name, canonical)
                    assert not torch.equal(got[v_old:], want[v_old:].to(got.dtype)), (name, canonical)
                else:
                    assert not torch.equal(got[:v_old], want[:v_old]), (name, canonical)
            else:
                assert torch.equal(got, want.to(got.dtype)), (name, canonical)


#: (TP, PP, ZeRO stage) of the continuations at another layout (4 ranks: DP = 4 / (TP x PP))
ELSEWHERE = ((1, 4, "1"), (1, 2, "1"), (2, 1, "2"), (1, 1, "0"))


def test_new_rows_continue_at_another_layout(adapted):
    """``--train-embedding-rows new`` saved at TP 2 x PP 2 ZeRO 1 continues by a plain --load at TP 1 x PP 4,
    (1, 2, 2) ZeRO 1, (2, 1, 2) ZeRO 2 and (1, 1, 4) ZeRO 0: the losses equal the uninterrupted run, the kept
    rows stay bit-identical, the record is carried."""
    from tests.integration._train_helpers import relative_diff, without_flags
    d, data, ckpt = adapted["dir"], adapted["data"], adapted["ckpts"][(2, 2)]
    rows = ("--train-only-embeddings", "--train-embedding-rows", "new", "--zero-stage", "1", "--train-iters", "12")
    part = str(d / "rows_part")
    runs = [_argv(ckpt, str(d / "rows_full"), data, 2, 2, *rows),
            _argv(ckpt, part, data, 2, 2, *rows, "--exit-interval", "8")]
    for tp, pp, zero in ELSEWHERE:
        runs.append(without_flags(_argv(part, str(d / f"rows_cont_{tp}{pp}"), data, tp, pp, *rows), "--finetune",
                                  "--zero-stage") + ["--zero-stage", zero])
    full, first, *conts = run_distributed(train_body, 4, args=(runs,), timeout=600, env=ENV)[0]
    src, v_old = adapted["src"], adapted["old_vocab"]
    for (tp, pp, zero), cont in zip(ELSEWHERE, conts):
        assert sorted(cont["losses"]) == list(range(9, 13)), (tp, pp)
        assert relative_diff(cont["losses"], {k: full["losses"][k] for k in range(9, 13)}) <= 5e-7, (tp, pp)
        out = open_model(str(d / f"rows_cont_{tp}{pp}"))
        assert out.meta.vocab_adaptation == _record(str(d / "adapted_hf"))
        for canonical in (EMB, OUT):
            assert torch.equal(out.get(canonical)[:v_old], src.get(canonical)[:v_old]), (tp, pp, canonical)


def test_docs_agree_on_the_pipeline_sizes():
    """The tests above run --train-only-embeddings at PP = 4; no page may still say it needs PP <= 2."""
    import re
    for page in ("README.md", "docs/training.md", "docs/adaptation.md"):
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"train-only-embeddings`? needs PP", text), page
