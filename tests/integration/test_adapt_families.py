"""The adaptation recipe on the families people adapt today. On Qwen3, as its authors now publish it
(docs/adaptation.md, "Qwen3"): a Qwen3 base model's byte-level BPE extended with the pieces of a Russian
SentencePiece *unigram* tokenizer, new rows the mean of the old pieces; LEP of the learned rows into the
instruct twin; bits per byte and greedy generation of the result. A tiny Qwen3 (per-head query/key norms, head
size != hidden / heads, tied embeddings, a config vocabulary larger than its tokenizer, as Qwen's) stands in for
Qwen3-4B. The same steps run on a tiny Gemma 3 (embeddings scaled by sqrt(hidden), four (1 + w) norms a layer,
local sliding-window and global layers, tied), with the same tokenizers:

* extend: every old row bit-identical, the new pieces appended as real BPE entries, English encodes exactly as
  before and Russian in fewer tokens; transformers loads the result and its old-vocabulary logits are the
  base model's (tied: the new rows only add logits);
* LEP into the instruct twin: its non-embedding tensors are the instruct model's, its vocabulary rows the
  instruct rows plus the adapted model's learned new rows (``--mode direct``);
* evaluate: bits per byte of the adapted model through our runner equal transformers' loss on the same text;
* generate: our greedy tokens from the LEP model equal transformers' ``generate``;
* compare_inits: its scores of the mean and random rows (replace) equal adapt_vocab + evaluate's.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.fixtures.tokenizers import language_texts, make_hf_tokenizer_dir, make_sentencepiece, sample_texts

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EN = "the model reads a long text and writes a short answer"
RU = "модель читает длинный текст и пишет короткий ответ"


def _tool(name: str, *argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{name} {' '.join(map(str, argv))}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


FAMILIES = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _config(family: str, vocab: int):
    from transformers import Gemma3TextConfig, Qwen3Config
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=0,
                  initializer_range=0.2)
    if family == "qwen3":
        return Qwen3Config(rope_theta=1e6, **common)
    # one local layer (window 8, shorter than the texts scored and generated) and one global layer
    return Gemma3TextConfig(sliding_window=8, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                            **common)


def _model(family: str, path: str, tokenizer_dir: str, vocab: int, seed: int, base: str | None = None) -> str:
    """A tiny model of the family with the tokenizer's files; ``base``: the instruct twin of that model (its
    weights plus a perturbation, as instruction tuning moves every tensor)."""
    import shutil

    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(_config(family, vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.1 if "norm" in name or base is not None else 0.0) * torch.randn_like(p))
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def recipe(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(f"{family}_recipe")
    old_tok = make_hf_tokenizer_dir(d, vocab=400, texts=sample_texts(200))           # byte-level BPE, as Qwen's
    new_sp = make_sentencepiece(d, kind="unigram", vocab=500, texts=language_texts("ru", 200, 5), name="ru_unigram")
    from transformers import AutoTokenizer
    old_size = len(AutoTokenizer.from_pretrained(old_tok))
    vocab = old_size + 13   # the config's vocabulary exceeds the tokenizer's (unused rows), as Qwen3's does
    base = _model(family, str(d / "base"), old_tok, vocab, seed=0)
    instruct = _model(family, str(d / "instruct"), old_tok, vocab, seed=1, base=base)
    adapted = d / "adapted"
    proc = _tool("adapt_vocab.py", "--model", base, "--new-tokenizer", new_sp, "--mode", "extend",
                 "--extend-filter", "[а-яё]", "--save", adapted)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"family": family, "dir": d, "base": base, "instruct": instruct, "adapted": str(adapted), "vocab": vocab,
            "tokens": old_size, "report": report, "new_sp": new_sp}


def test_extend_keeps_the_old_model_and_adds_unigram_pieces(recipe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ru.inference.model_io import open_model
    base, adapted = open_model(recipe["base"]), open_model(recipe["adapted"])
    # the new pieces take the ids after the tokenizer's last one: the config's unused rows beyond it go
    v = recipe["tokens"]
    assert adapted.vocab_size == v + recipe["report"]["appended_pieces"] > recipe["vocab"]
    assert adapted.cfg.qk_layernorm and adapted.cfg.tied_embeddings and adapted.cfg.kv_channels == 16
    assert adapted.cfg == base.cfg
    for name in base.names():
        new, old = adapted.get(name), base.get(name)
        if name == "embedding.word_embeddings.weight":
            new, old = new[:v], old[:v]
        assert torch.equal(new, old), name
    with open(os.path.join(recipe["adapted"], "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == [FAMILIES[recipe["family"]]]
    old_tok, new_tok = AutoTokenizer.from_pretrained(recipe["base"]), AutoTokenizer.from_pretrained(recipe["adapted"])
    assert new_tok(EN)["input_ids"] == old_tok(EN)["input_ids"]                  # English as before
    assert len(new_tok(RU)["input_ids"]) < len(old_tok(RU)["input_ids"])          # Russian in fewer tokens
    assert new_tok.decode(new_tok(RU)["input_ids"]) == RU
    # every appended piece is a real BPE entry that its own text encodes to (reachable through the merges; the
    # splice's intermediate tokens, parts of a UTF-8 character among them, are only steps towards pieces)
    whole = [i for i in range(v, adapted.vocab_size) if "\ufffd" not in new_tok.decode([i])]
    unreachable = [i for i in whole if new_tok(new_tok.decode([i]), add_special_tokens=False)["input_ids"] != [i]]
    assert len(whole) > 100 and not unreachable, [new_tok.decode([i]) for i in unreachable[:10]]
    ids = torch.tensor([old_tok(EN)["input_ids"]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(recipe["base"], dtype=torch.float32)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(recipe["adapted"], dtype=torch.float32)(input_ids=ids).logits
    assert got.shape[-1] == adapted.vocab_size and torch.equal(got[..., :v], want[..., :v])


def test_lep_into_the_instruct_twin(recipe):
    from megatron_ru.inference.model_io import open_model
    out = recipe["dir"] / "instruct_ru"
    _tool("propagate_embeddings.py", "--base", recipe["base"], "--adapted", recipe["adapted"], "--instruct",
          recipe["instruct"], "--mode", "direct", "--save", out)
    instruct, adapted, lep = (open_model(p) for p in (recipe["instruct"], recipe["adapted"], str(out)))
    assert lep.vocab_size == adapted.vocab_size and lep.cfg == instruct.cfg
    v = recipe["tokens"]
    emb = "embedding.word_embeddings.weight"
    for name in instruct.names():
        if name != emb:
            assert torch.equal(lep.get(name), instruct.get(name)), name
    assert torch.equal(lep.get(emb)[v:], adapted.get(emb)[v:])          # the learned new rows
    recipe["lep"] = str(out)


def test_bits_per_byte_equal_transformers(recipe):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    texts = [t[:160] for t in language_texts("ru", 3, 9)]  # each in one window of the evaluation
    data = recipe["dir"] / "ru_eval.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    out = recipe["dir"] / "bpb.json"
    _tool("evaluate.py", "--load", recipe["adapted"], "--input", data, "--seq-length", "256", "--dtype", "fp32",
          "--output-json", out)
    result = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(recipe["adapted"])
    model = AutoModelForCausalLM.from_pretrained(recipe["adapted"], dtype=torch.float32).eval()
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for t in texts:  # every token of a document is scored, the first after the evaluation's context token
            ids = torch.tensor([[result["context_token"], *tok(t)["input_ids"]]])
            assert ids.shape[1] <= 256
            nats += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            nbytes += len(t.encode("utf-8"))
    overall = result["overall"]
    assert overall["bytes"] == nbytes and overall["documents"] == len(texts)
    assert overall["bits_per_byte"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5), overall


def test_greedy_generation_equals_transformers(recipe):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = recipe.get("lep") or recipe["adapted"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tok(RU)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    out = recipe["dir"] / "generated.jsonl"
    _tool("generate.py", "--load", path, "--prompt", RU, "--max-new-tokens", "12", "--greedy", "--dtype", "fp32",
          "--output-file", out)
    record = json.loads(out.read_text().splitlines()[0])
    assert record["prompt_token_ids"] == prompt
    assert record["token_ids"] == want


def test_compare_inits_equals_adapt_vocab_and_evaluate(recipe):
    """compare_inits' score of mean rows (replace) is adapt_vocab --mode replace --init mean + evaluate's."""
    data = recipe["dir"] / "ru_compare.jsonl"
    data.write_text("".join(json.dumps({"text": t[:160]}, ensure_ascii=False) + "\n"
                            for t in language_texts("ru", 3, 13)), encoding="utf-8")
    report = recipe["dir"] / "compare.json"
    _tool("compare_inits.py", "--model", recipe["base"], "--new-tokenizer", recipe["new_sp"], "--input", data,
          "--seq-length", "64", "--methods", "mean", "random", "--output-json", report)
    rows = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    assert list(rows) == ["original", "mean", "random"]
    assert rows["mean"]["bits_per_byte"] < rows["random"]["bits_per_byte"]
    replaced = recipe["dir"] / "replaced_mean"
    _tool("adapt_vocab.py", "--model", recipe["base"], "--new-tokenizer", recipe["new_sp"], "--mode", "replace",
          "--init", "mean", "--save", replaced)
    scored = recipe["dir"] / "replaced_mean.json"
    _tool("evaluate.py", "--load", replaced, "--input", data, "--seq-length", "64", "--output-json", scored)
    want = json.loads(scored.read_text())["overall"]["bits_per_byte"]
    assert rows["mean"]["bits_per_byte"] == pytest.approx(want, rel=1e-9)
