"""Acceptance 5 of issue 10 and the generation tool: ``tools/generate.py`` under torchrun at TP = 2
and at PP = 2 gives transformers' greedy ``generate`` tokens (KV cache on, prompts of different
lengths in one batch, a sample that stops at the end-of-document token and ones that run to
--max-new-tokens) on the model exported back to Hugging Face; seeded sampling is reproducible and
the same at every layout; the JSONL output has its fields; bad flags give clear errors.

The tiny Llama is imported at TP = 2 x PP = 2 and read at other layouts. Its tokenizer (a word-level
``tokenizer.json`` saved with the model) travels with the checkpoint, so no tokenizer flag is given.
The end-of-document id is chosen after a first greedy run so that one prompt reaches it early.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "generate.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
VOCAB, NEW = 64, 10
PROMPTS = [[5, 9, 2, 33, 17, 8, 41], [12, 3], [60, 7, 21, 30]]   # different lengths, one batch


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "MEGATRON_RU_LOG_LEVEL": "WARNING"}


def _hf_greedy(model: Any, prompts: list[list[int]], eos: int | None, pad: int) -> tuple[list[list[int]], float]:
    """transformers' greedy generate on a left-padded batch: each sample's new tokens (cut after its
    first eos) and the smallest top-1/top-2 logit margin along the path (ties would make the
    comparison meaningless)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True, output_logits=True)
    result, margin = [], float("inf")
    for i in range(len(prompts)):
        new = out.sequences[i, width:].tolist()
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        result.append(new)
        for step in range(len(new)):
            top2 = out.logits[step][i].topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
    return result, margin


def _save_tokenizer(path: str, eos: int, bos: int, pad: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    names = {eos: "</s>", bos: "<s>", pad: "<pad>"}
    vocab = {names.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ru.convert.export_hf import export_hf
    from megatron_ru.convert.import_hf import import_hf

    root = tmp_path_factory.mktemp("gen")
    torch.manual_seed(1)   # a seed whose greedy paths have clear margins and a usable end-of-document id
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    free = [i for i in range(VOCAB) if all(i not in p for p in PROMPTS)]
    # the end-of-document id: a token one prompt produces early and the others never do
    plain, _ = _hf_greedy(model, PROMPTS, None, free[0])
    stopper, eos = next((s, t) for s in range(len(PROMPTS)) for t in plain[s][1:NEW // 2]
                        if t in free and all(t not in plain[o] for o in range(len(PROMPTS)) if o != s))
    bos, pad = [i for i in free if i != eos][:2]
    model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = eos, bos, pad
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id, model.generation_config.pad_token_id = bos, pad
    hf_dir, ckpt, exported = str(root / "hf"), str(root / "ckpt"), str(root / "exported")
    model.save_pretrained(hf_dir)
    _save_tokenizer(hf_dir, eos, bos, pad)
    import_hf(hf_dir, ckpt, 2, 2)
    export_hf(ckpt, exported)
    from transformers import AutoModelForCausalLM
    ref_model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    expected, margin = _hf_greedy(ref_model, PROMPTS, eos, pad)
    assert margin > 1e-3, f"greedy path has a near-tie ({margin:.2e}): pick another seed"
    finish = ["eod" if i == stopper else "length" for i in range(len(PROMPTS))]
    assert expected[stopper][-1] == eos and len(expected[stopper]) < NEW
    assert all(len(e) == NEW and eos not in e for i, e in enumerate(expected) if i != stopper)
    prompt_file = str(root / "prompts.jsonl")
    with open(prompt_file, "w", encoding="utf-8") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in p)}) + "\n")
    return {"ckpt": ckpt, "hf": hf_dir, "prompt_file": prompt_file, "expected": expected, "eos": eos, "root": root,
            "finish": finish, "stopper": stopper, "bos": bos, "names": {eos: "</s>", bos: "<s>", pad: "<pad>"}}


def _generate(setup: dict[str, Any], name: str, nproc: int, *flags: str, load: str = "ckpt") -> list[dict[str, Any]]:
    out = str(setup["root"] / f"{name}.jsonl")
    launcher = TORCHRUN + [str(nproc)] if nproc > 1 else [sys.executable]
    cmd = launcher + [TOOL, "--load", setup[load], "--prompt-file", setup["prompt_file"],
                      "--max-new-tokens", str(NEW), "--output-file", out, "--distributed-timeout-minutes", "2",
                      *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    # rank 0 alone prints every prompt with its completion
    assert proc.stdout.count("--- prompt ") == len(PROMPTS), proc.stdout
    return records


def test_greedy_from_a_hugging_face_directory(setup: dict[str, Any]) -> None:
    """--load takes the Hugging Face directory itself (its weights and tokenizer), no import step."""
    records = _generate(setup, "greedy_hf", 1, "--greedy", load="hf")
    assert [r["token_ids"] for r in records] == setup["expected"]
    assert [r["finish_reason"] for r in records] == setup["finish"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_greedy_equals_transformers_generate(setup: dict[str, Any], layout: str) -> None:
    flags = ["--tensor-model-parallel-size", "2"] if layout == "tp2" else ["--pipeline-model-parallel-size", "2"]
    records = _generate(setup, f"greedy_{layout}", 2, "--greedy", *flags)
    assert [r["prompt_token_ids"] for r in records] == PROMPTS
    assert [r["token_ids"] for r in records] == setup["expected"]
    assert [r["finish_reason"] for r in records] == setup["finish"]
    for r, prompt in zip(records, PROMPTS):
        assert set(r) == {"prompt", "completion", "prompt_token_ids", "token_ids", "finish_reason"}
        assert r["prompt"] == " ".join(f"w{i}" for i in prompt)
        # the end-of-document token ends the text and is not part of it
        text_ids = r["token_ids"][:-1] if r["finish_reason"] == "eod" else r["token_ids"]
        assert r["completion"].split() == [setup["names"].get(i, f"w{i}") for i in text_ids]


def test_seeded_sampling_is_identical_across_layouts(setup: dict[str, Any]) -> None:
    """TP = 2 with all prompts in one batch, and DP = 2 (prompts split between two replicas, one
    prompt per micro-batch): the same seed gives the same tokens."""
    flags = ("--seed", "11", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--add-bos")
    tp2 = _generate(setup, "sample_tp2", 2, "--tensor-model-parallel-size", "2", *flags)
    dp2 = _generate(setup, "sample_dp2", 2, "--micro-batch-size", "1", *flags)
    assert [r["token_ids"] for r in tp2] == [r["token_ids"] for r in dp2]
    assert [r["prompt"] for r in dp2] == [r["prompt"] for r in tp2]   # input order kept
    assert [r["prompt_token_ids"] for r in dp2] == [[setup["bos"]] + p for p in PROMPTS]
    assert [r["token_ids"] for r in tp2] != setup["expected"]   # it really sampled


def test_kv_cache_equals_recomputation(setup: dict[str, Any]) -> None:
    """In-process, one rank: the cached decode gives the tokens of recomputing every step, for
    greedy and for sampling, with per-prompt micro-batches or all prompts in one batch."""
    import types

    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.runner import StageRunner
    from megatron_ru.inference.sampling import SamplingParams
    from megatron_ru.parallel.topology import ParallelLayout

    state = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, pp_ranks=[0],
                                  mp_group=None, mp_ranks=[0], layout=ParallelLayout(1, 1, 1),
                                  device=torch.device("cpu"))
    reader = read_checkpoint(setup["ckpt"])
    runner = StageRunner(reader.cfg, reader.vocab_size, state)
    runner.load(reader.get)
    for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_p=0.9)):
        runs = [generate(runner, PROMPTS, max_new_tokens=NEW, params=params, eod=setup["eos"], seed=3,
                         use_cache=cache) for cache in (True, False)]
        alone = [generate(runner, [p], max_new_tokens=NEW, params=params, eod=setup["eos"], seed=3, indices=[i])[0]
                 for i, p in enumerate(PROMPTS)]
        tokens = [[c.token_ids for c in run] for run in runs] + [[c.token_ids for c in alone]]
        assert tokens[0] == tokens[1] == tokens[2], params
        if params.greedy:
            assert tokens[0] == setup["expected"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "w1"], "--load is required"),
    (["--load", "{ckpt}", "--prompt", ""], "prompt 0 is empty"),
    (["--load", "{ckpt}"], "no prompts: give --prompt"),
    (["--load", "{ckpt}", "--prompt", "w1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--load", "{ckpt}", "--prompt", "w1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--load", "{ckpt}", "--prompt", "w1", "--temperature", "0"], "--temperature must be > 0"),
    (["--load", "{ckpt}", "--prompt", "w1", "--greedy", "--top-k", "5"], "cannot be combined with --top-k"),
    (["--load", "{root}", "--prompt", "w1"], "holds no checkpoint"),
    (["--load", "{root}/nowhere", "--prompt", "w1"], "no such directory"),
])
def test_bad_flags_are_named(setup: dict[str, Any], argv: list[str], message: str) -> None:
    from megatron_ru.inference.cli import build_parser, check_arguments
    argv = [a.format(ckpt=setup["ckpt"], root=setup["root"]) for a in argv]
    with pytest.raises(ValueError) as e:
        check_arguments(build_parser().parse_args(argv), argv)
    assert message in str(e.value)


def test_bad_flag_exit_status_and_one_message(setup: dict[str, Any]) -> None:
    cmd = [sys.executable, TOOL, "--load", setup["ckpt"], "--prompt", "w1", "--top-p", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--top-p must be in (0, 1]") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_layout_that_does_not_divide_the_world_is_refused_before_start(setup: dict[str, Any], monkeypatch) -> None:
    from megatron_ru.inference.cli import build_parser, check_arguments
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    argv = ["--load", setup["ckpt"], "--prompt", "w1", "--tensor-model-parallel-size", "4"]
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 is not divisible by TP x PP = 4 x 1"):
        check_arguments(build_parser().parse_args(argv), argv)


def test_completion_text_keeps_the_tokenizers_spacing() -> None:
    from megatron_ru.inference.cli import completion_text

    class Words:   # a word-level tokenizer: tokens joined by spaces
        def detokenize(self, ids: list[int]) -> str:
            return " ".join(f"w{i}" for i in ids)

    class Pieces:  # SentencePiece-like: "▁" marks a word start, dropped at the start of a decode
        vocab = {0: "▁hello", 1: "▁wor", 2: "ld"}

        def detokenize(self, ids: list[int]) -> str:
            return "".join(self.vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    assert completion_text(Words(), [1, 2], [3]) == " w3"
    assert completion_text(Pieces(), [0], [1, 2]) == " world"
    assert Pieces().detokenize([1, 2]) == "world"   # what decoding the completion alone would lose
    assert completion_text(Words(), [1], []) == ""
