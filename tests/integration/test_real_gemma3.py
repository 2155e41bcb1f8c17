"""A real Gemma 3 through megatron_ru: Gemma 3 270M (google/gemma-3-270m: 18 layers, 15 local ones of window 512
and 3 global ones with their own RoPE base, 4 query heads and one KV head of size 256 against a hidden size of
640, four (1 + w) norms a layer, embeddings scaled by sqrt(640), a 262,144-row tied vocabulary) from PyPI's
chunked GGUF wheels (tools/real_model.py; built here when missing, never skipped).

Imported at TP 1 and at PP 2 (one KV head: TP must divide the KV heads, as in Megatron-LM, so TP 2 is refused
for this model), it gives transformers' logits (fp32, eager attention, <= 1e-5
relative of the largest) on an English prompt and on 530 tokens of Russian man pages, beyond the 512-token
window of the local layers (the rows compared: the first 16 and the last 48, where the window has cut keys
off); greedy generation is token for token transformers' ``generate``; export gives the source's tensors back
bit for bit.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration.test_real_model import _safetensors

pytestmark = pytest.mark.slow

LAYOUTS = [(1, 1), (1, 2)]
TOL = 1e-5
RU_TOKENS = 530         # > the local layers' window (512)
HEAD, TAIL = 16, 48     # the logit rows compared (a full 530 x 262,144 row set is 555 MB a copy)
NEW_TOKENS = 16
ENGLISH = "The cat command reads files in sequence and writes them to standard output. It is often used to"


@pytest.fixture(scope="module")
def gemma(real_model_cache):
    """Gemma 3 270M's directory, the prompts and transformers' answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.real_model import ensure_gemma3, text_file
    hf_dir = ensure_gemma3()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    with open(text_file("ru_heldout.jsonl"), encoding="utf-8") as f:
        russian = " ".join(json.loads(line)["text"] for line in f)
    ru = tok(russian[:6000], add_special_tokens=True)["input_ids"][:RU_TOKENS]
    assert len(ru) == RU_TOKENS
    prompts = {"english": tok(ENGLISH)["input_ids"], "russian": ru}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    assert model.config.sliding_window == 512 and model.config.num_key_value_heads == 1
    with torch.no_grad():
        logits = {k: _rows(model(input_ids=torch.tensor([v])).logits[0]) for k, v in prompts.items()}
        out = model.generate(torch.tensor([prompts["english"]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, attention_mask=torch.ones(1, len(prompts["english"]),
                                                                                   dtype=torch.long))
    generated = out[0, len(prompts["english"]):].tolist()
    assert tok.decode(generated).strip(), generated
    return {"hf": hf_dir, "prompts": prompts, "logits": logits, "generated": generated}


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.cat([logits[:HEAD], logits[-TAIL:]]) if logits.shape[0] > HEAD + TAIL else logits


def _body(rank: int, world_size: int, tp: int, pp: int, ckpt: str, prompts: dict) -> dict:
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
            logits = runner(torch.tensor([ids]), torch.arange(len(ids))[None])
            if runner.is_last:
                out[name] = _rows(logits[0])
    done = generate(runner, [prompts["english"]], max_new_tokens=NEW_TOKENS, params=SamplingParams(greedy=True))
    out["generated"] = done[0].token_ids
    return out


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_logits_generation_and_export(gemma, tmp_path, tp: int, pp: int) -> None:
    from megatron_ru.convert.export_hf import export_hf
    from megatron_ru.convert.import_hf import import_hf

    ckpt = str(tmp_path / "ckpt")
    import_hf(gemma["hf"], ckpt, tp, pp)
    results = run_distributed(_body, tp * pp, args=(tp, pp, ckpt, gemma["prompts"]), timeout=600)
    last = [r for r in results if "english" in r]
    assert len(last) == tp
    for name, ref in gemma["logits"].items():
        for r in last:
            err = float((r[name] - ref).abs().max() / ref.abs().max())
            assert r[name].shape == ref.shape and err <= TOL, f"{name} at TP={tp} PP={pp}: logits differ by {err:.2e}"
    for r in results:                                   # every rank has every generated token
        assert r["generated"] == gemma["generated"], (tp, pp, r["generated"], gemma["generated"])
    if pp > 1:   # export gives back the source's tensors bit for bit (tied: no lm_head.weight either side)
        out = str(tmp_path / "hf")
        export_hf(ckpt, out)
        src, back = _safetensors(gemma["hf"]), _safetensors(out)
        assert sorted(back) == sorted(src) and "lm_head.weight" not in back
        for name, t in src.items():
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]


def test_tp2_is_refused_in_one_line(gemma, tmp_path) -> None:
    """One KV head cannot be split over 2 TP ranks: the import says so before writing anything."""
    from megatron_ru.convert.import_hf import import_hf
    with pytest.raises(ValueError, match=r"num-query-groups \(1\) must be divisible by"):
        import_hf(gemma["hf"], str(tmp_path / "ckpt"), 2, 1)
    assert not os.path.exists(tmp_path / "ckpt")
