"""inference.model_io: a model opened from a Hugging Face directory or a megatron_ru checkpoint at any
layout gives the same canonical tensors, and is written back as either kind, tokenizer included."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ru.inference.model_io import open_model, open_tokenizer, save_model
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import make_hf_tokenizer_dir, make_sentencepiece


def _same_tensors(a, b):
    assert a.names() == b.names()
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), n


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_checkpoint_to_hf_round_trip(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok_dir = make_hf_tokenizer_dir(str(tmp_path))
    hf = tiny_llama(str(tmp_path / "hf"), vocab_size=500, tied=tied, tokenizer_dir=tok_dir)
    src = open_model(hf)
    assert src.kind == "hf" and src.vocab_size == 500 and src.tokenizer.type == "HuggingFaceTokenizer"
    ckpt = save_model(str(tmp_path / "ckpt"), kind="megatron", cfg=src.cfg, vocab_size=src.vocab_size,
                      get_tensor=src.get, tokenizer=src.tokenizer, tp=2, pp=2, hf_config=src.hf_config)
    back = open_model(ckpt)
    assert back.kind == "megatron" and back.meta.tensor_model_parallel_size == 2
    assert back.tokenizer.path == os.path.join(ckpt, "tokenizer") and back.hf_config["architectures"]
    _same_tensors(src, back)
    out = save_model(str(tmp_path / "out"), kind="hf", cfg=back.cfg, vocab_size=back.vocab_size, get_tensor=back.get,
                     tokenizer=back.tokenizer, hf_config=back.hf_config)
    ids = torch.tensor([[1, 5, 9, 300, 42, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert torch.equal(want, got)
    assert AutoTokenizer.from_pretrained(out)("мир data")["input_ids"] == \
        AutoTokenizer.from_pretrained(tok_dir)("мир data")["input_ids"]
    with pytest.raises(FileExistsError, match="--force"):
        save_model(out, kind="hf", cfg=back.cfg, vocab_size=back.vocab_size, get_tensor=back.get, tokenizer=None)


def test_sentencepiece_tokenizer_recorded_with_checkpoint(tmp_path):
    from megatron_ru.flags.arguments import parse_arguments
    sp = make_sentencepiece(str(tmp_path))
    source, tok = open_tokenizer(sp, "--new-tokenizer")
    hf = tiny_llama(str(tmp_path / "hf"), vocab_size=tok.vocab_size)
    src = open_model(hf)
    ckpt = save_model(str(tmp_path / "ckpt"), kind="megatron", cfg=src.cfg, vocab_size=src.vocab_size,
                      get_tensor=src.get, tokenizer=source, extra_meta={"vocab_adaptation": {"mode": "replace"}})
    with open(os.path.join(ckpt, "iter_0000000", "metadata.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["tokenizer"] == {"tokenizer_type": "GPTSentencePieceTokenizer",
                                 "tokenizer_model": "tokenizer/tokenizer.model"}
    assert meta["vocab_adaptation"] == {"mode": "replace"}
    assert open_model(ckpt).tokenizer.type == "GPTSentencePieceTokenizer"
    args = parse_arguments(["--load", ckpt, "--use-checkpoint-args", "--micro-batch-size", "1", "--train-iters", "1",
                            "--lr", "1e-3", "--seq-length", "16", "--data-path", "x"], world_size=1, device_type="cpu",
                           validate=False)
    assert args.tokenizer.tokenizer_type == "GPTSentencePieceTokenizer"
    assert args.tokenizer.tokenizer_model == os.path.join(ckpt, "tokenizer", "tokenizer.model")


def test_bad_paths_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--base .*no such directory"):
        open_model(str(tmp_path / "nope"), "--base")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="--base .*neither"):
        open_model(str(tmp_path / "empty"), "--base")
    with pytest.raises(FileNotFoundError, match="--new-tokenizer .*no Hugging Face tokenizer files"):
        open_tokenizer(str(tmp_path / "empty"), "--new-tokenizer")


def test_both_hf_writers_refuse_an_architecture_the_model_cannot_be(tmp_path):
    """The model-to-HF path of the adaptation tools (save_model) and tools/convert_checkpoint.py export-hf go
    through one writer and one check: a source config.json naming an architecture we cannot write is refused
    by both (save_model used to replace it by another silently), and nothing is left behind."""
    from megatron_ru.convert.export_hf import export_hf
    hf = tiny_llama(str(tmp_path / "hf"), vocab_size=300)
    src = open_model(hf)
    ckpt = save_model(str(tmp_path / "ckpt"), kind="megatron", cfg=src.cfg, vocab_size=src.vocab_size,
                      get_tensor=src.get, tokenizer=None, hf_config={**src.hf_config,
                                                                       "architectures": ["GPT2LMHeadModel"]})
    for write in (lambda out: save_model(out, kind="hf", cfg=src.cfg, vocab_size=src.vocab_size, get_tensor=src.get,
                                         tokenizer=None, hf_config={**src.hf_config,
                                                                     "architectures": ["GPT2LMHeadModel"]}),
                  lambda out: export_hf(ckpt, out)):
        out = str(tmp_path / "out")
        with pytest.raises(ValueError, match=r"cannot be expressed as GPT2LMHeadModel: it has architecture "
                                             r"'GPT2LMHeadModel' \(supported: LlamaForCausalLM, MistralForCausalLM"):
            write(out)
        assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    # the architecture the source names, when the model can be it, is kept
    out = save_model(str(tmp_path / "mistral"), kind="hf", cfg=src.cfg, vocab_size=src.vocab_size, get_tensor=src.get,
                     tokenizer=None, hf_config={**src.hf_config, "architectures": ["MistralForCausalLM"]})
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["MistralForCausalLM"]
