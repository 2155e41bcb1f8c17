"""tools/convert_checkpoint.py import-hf / export-hf (issue 10 §3, acceptance 3's Hugging Face half
and acceptance 6 for conversion).

Tiny Llama (GQA, untied and tied, sharded files), Qwen2 (Q/K/V biases, tied: no lm_head.weight in
its safetensors), Mistral (odd vocabulary, bf16), Qwen3 (query/key norms, a head size whose query width
is not the hidden size, tied), Llama-3.2-shaped (tied, llama3 RoPE scaling), Mistral-Nemo-shaped (head
size != hidden / heads) and Gemma 3 (local and global layers, four (1 + w) norms a layer, bf16, tied)
models are saved with ``save_pretrained`` together with a tiny tokenizer built with the ``tokenizers``
library; each is imported at (TP, PP) = (1, 1) and (2, 2), the latter resharded to (1, 2) with the
reshard tool, and each of the three exported again: every tensor is bit-identical to the original,
the row count and tie flag are kept, transformers loads the export and gives the same logits,
and the tokenizer encodes the same ids. A SentencePiece model exports to a fast Llama tokenizer
with SentencePiece's ids. Every bad input is refused with a message naming what is wrong, and
leaves neither the output directory nor a temporary one behind.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_SIZE = 96
SAMPLE = ["привет мир, hello world", "  two  spaces\nand a newline 12345", "ünïcødé ok"]


def _cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_cli", os.path.join(REPO, "tools",
                                                                                         "convert_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def convert(*argv: str) -> int:
    """Run the tool in this process (fast); its exit status."""
    return _cli().main([str(a) for a in argv])


# ---------------------------------------------------------------- tiny models and tokenizers
def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SAMPLE * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def _perturb_norms(model) -> None:
    with torch.no_grad():  # transformers starts norms at 1: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))


def save_model(path: str, family: str, *, tied: bool = False, vocab: int = 101, dtype=torch.float32,
               max_shard_size: str | None = None) -> None:
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rope_theta=1e6))
        with torch.no_grad():  # make the Q/K/V biases count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif family == "qwen3":  # query/key norms; head size 16: the query width (64) is not the hidden size (32)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16, rope_theta=1e6))
    elif family == "llama32":  # Llama-3.2's shape: tied, llama3 RoPE scaling
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    elif family == "nemo":  # Mistral-Nemo's shape: head size 16 with hidden 32 and 4 heads, no window
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, head_dim=16, sliding_window=None))
    elif family == "gemma3":  # local and global layers with their RoPE, four (1 + w) norms a layer, q/k norms
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    else:
        raise ValueError(family)
    _perturb_norms(model)
    model = model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    _tokenizer(path)


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from megatron_ru.convert.hf_io import HFWeights
    w = HFWeights(path)
    return {n: w.get(n) for n in w.names()}


def logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def no_leftovers(parent: str, name: str) -> None:
    left = [n for n in os.listdir(parent) if n == name or n.startswith((f"{name}.tmp-", f"{name}.old-"))]
    assert not left, f"left behind: {left}"


# ---------------------------------------------------------------- round trips
CASES = {
    "llama-gqa-untied": dict(family="llama", tied=False),
    "llama-tied-sharded": dict(family="llama", tied=True, max_shard_size="20KB"),
    "qwen2-bias-tied": dict(family="qwen2", tied=True),
    "mistral-odd-vocab-bf16": dict(family="mistral", vocab=97, dtype=torch.bfloat16),
    "qwen3-qknorm-tied": dict(family="qwen3", tied=True),
    "llama32-tied-rope-scaling": dict(family="llama32", tied=True),
    "nemo-head-dim": dict(family="nemo"),
    "gemma3-local-global-bf16": dict(family="gemma3", tied=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_round_trip_bit_identical(tmp_path, case):
    spec = CASES[case]
    hf = str(tmp_path / "hf")
    save_model(hf, **spec)
    original = hf_tensors(hf)
    assert ("lm_head.weight" in original) == (not spec.get("tied", False))
    with open(os.path.join(hf, "config.json")) as f:
        src_config = json.load(f)
    ids = torch.tensor([[1, 5, 17, 42, 3, 88, 9, 60]])
    want = logits(hf, ids)
    from transformers import AutoTokenizer
    src_tok = AutoTokenizer.from_pretrained(hf)
    for tp, pp, resharded in ((1, 1, False), (2, 2, False), (1, 2, True)):
        ckpt, out = tmp_path / f"ckpt{tp}{pp}", tmp_path / f"out{tp}{pp}"
        if resharded:   # the TP 2 x PP 2 import rewritten at TP 1 x PP 2 by the reshard tool
            assert convert("reshard", "--load", tmp_path / "ckpt22", "--save", ckpt, "--target-tensor-parallel-size",
                           tp, "--target-pipeline-parallel-size", pp) == 0
        else:
            assert convert("import-hf", "--load", hf, "--save", ckpt, "--target-tensor-parallel-size", tp,
                           "--target-pipeline-parallel-size", pp) == 0
        assert os.path.isfile(ckpt / "tokenizer" / "tokenizer.json")
        assert convert("export-hf", "--load", ckpt, "--save", out, "--max-shard-size", "30KB") == 0
        exported = hf_tensors(str(out))
        assert sorted(exported) == sorted(original), (tp, pp)
        for name, t in original.items():
            assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), (tp, pp, name)
        with open(out / "config.json") as f:
            config = json.load(f)
        assert config["vocab_size"] == src_config["vocab_size"]
        assert config["tie_word_embeddings"] == src_config.get("tie_word_embeddings", False)
        assert config["architectures"] == src_config["architectures"]
        assert os.path.isfile(out / "generation_config.json")
        if len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1:
            assert os.path.isfile(out / "model.safetensors.index.json")
        assert torch.equal(logits(str(out), ids), want), (tp, pp)
        tok = AutoTokenizer.from_pretrained(str(out))
        for text in SAMPLE:
            assert tok(text)["input_ids"] == src_tok(text)["input_ids"]


def test_import_dtype_conversion(tmp_path):
    hf = str(tmp_path / "hf")
    save_model(hf, "llama")
    assert convert("import-hf", "--load", hf, "--save", tmp_path / "ck", "--dtype", "bf16") == 0
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out") == 0
    exported, original = hf_tensors(str(tmp_path / "out")), hf_tensors(hf)
    for name, t in original.items():
        assert torch.equal(exported[name], t.to(torch.bfloat16)), name
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out32", "--dtype", "fp32") == 0
    exported = hf_tensors(str(tmp_path / "out32"))
    assert all(t.dtype == torch.float32 for t in exported.values())
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out32") == 2  # exists
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out32", "--force") == 0
    assert all(t.dtype == torch.bfloat16 for t in hf_tensors(str(tmp_path / "out32")).values())


def test_export_of_a_damaged_checkpoint_leaves_nothing(tmp_path, capsys):
    hf = str(tmp_path / "hf")
    save_model(hf, "llama")
    assert convert("import-hf", "--load", hf, "--save", tmp_path / "ck", "--target-pipeline-parallel-size", "2") == 0
    (it,) = [d for d in os.listdir(tmp_path / "ck") if d.startswith("iter_")]
    victim = sorted(n for n in os.listdir(tmp_path / "ck" / it) if n.endswith(".pt"))[-1]
    with open(tmp_path / "ck" / it / victim, "r+b") as f:
        f.truncate(100)
    err = _refused(capsys, tmp_path, "out", "export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out")
    assert victim in err


def test_pickle_weights_only_with_allow_pickle(tmp_path, capsys):
    hf = tmp_path / "hf"
    save_model(str(hf), "llama")
    original = hf_tensors(str(hf))
    torch.save(original, hf / "pytorch_model.bin")
    os.remove(hf / "model.safetensors")
    assert convert("import-hf", "--load", hf, "--save", tmp_path / "ck") == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and "--allow-pickle" in err and "arbitrary code" in err
    no_leftovers(str(tmp_path), "ck")
    assert convert("import-hf", "--load", hf, "--save", tmp_path / "ck", "--allow-pickle") == 0
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", tmp_path / "out") == 0
    exported = hf_tensors(str(tmp_path / "out"))
    assert all(torch.equal(exported[n], t) for n, t in original.items())


# ---------------------------------------------------------------- tokenizers
def _train_sentencepiece(prefix: str, dummy_prefix: bool, kind: str = "bpe") -> str:
    from megatron_ru.data.tokenizers.train import train_sentencepiece
    words = ["привет", "мир", "hello", "world", "12345", "тест", "данные", "модель", "x"]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(25)) + "\n  " + words[i % len(words)]
             for i in range(200)]
    return train_sentencepiece(iter(texts), prefix, kind, 340 if kind == "bpe" else 296, byte_fallback=True,
                               add_dummy_prefix=dummy_prefix)


@pytest.mark.parametrize("kind,dummy_prefix", [("bpe", False), ("bpe", True), ("unigram", False), ("unigram", True)])
def test_sentencepiece_to_fast_llama_tokenizer(tmp_path, kind, dummy_prefix):
    """SentencePiece's ids for BPE and unigram models (a unigram model segments by its pieces' scores: a BPE
    built from its vocabulary, as transformers' Llama conversion makes, splits words differently)."""
    import sentencepiece
    from transformers import AutoTokenizer
    from megatron_ru.convert.tokenizer_files import sentencepiece_to_llama_fast
    model = _train_sentencepiece(str(tmp_path / "sp"), dummy_prefix, kind)
    sentencepiece_to_llama_fast(model, str(tmp_path / "tok"))
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tok.eos_token_id == sp.eos_id() and tok.bos_token_id == sp.bos_id()
    texts = SAMPLE + ["hello  world 12345 данные\n\nмодель", " leading", "trailing ", "漢字 🙂\t", "",
                      "приветмирмодельданные helloworld"]
    for text in texts:
        assert tok(text)["input_ids"] == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def _scratch_checkpoint(path: str, **model_flags) -> tuple:
    """A megatron_ru checkpoint as a run trained from scratch would leave (random weights)."""
    from megatron_ru.checkpointing import write_checkpoint
    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model.spec import parameter_specs
    llama = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, group_query_attention=True,
                 num_query_groups=2, max_position_embeddings=64, position_embedding_type="rope",
                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                 untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = ModelConfig(**{**llama, **model_flags})
    vocab = 300
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=gen) for s in parameter_specs(cfg, vocab)}
    write_checkpoint(path, cfg=cfg, vocab_size=vocab, tp=2, pp=1, get_tensor=tensors.__getitem__)
    return cfg, tensors


def test_export_scratch_checkpoint_with_sentencepiece(tmp_path):
    import sentencepiece
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megatron_ru.convert.hf_mapping import to_canonical, hf_to_canonical_names
    model = _train_sentencepiece(str(tmp_path / "sp"), False)
    cfg, tensors = _scratch_checkpoint(str(tmp_path / "ck"))
    out = tmp_path / "out"
    assert convert("export-hf", "--load", tmp_path / "ck", "--save", out, "--tokenizer-type",
                   "GPTSentencePieceTokenizer", "--tokenizer-model", model) == 0
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 300
    exported = hf_tensors(str(out))
    for name, sources in hf_to_canonical_names(cfg).items():
        assert torch.equal(to_canonical(name, {n: exported[n] for n in sources}, cfg), tensors[name]), name
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    assert hf.config.vocab_size == 300 and not hf.config.tie_word_embeddings
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLE:
        assert tok(text)["input_ids"] == sp.encode(text)
    with open(out / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == sp.eos_id()


# ---------------------------------------------------------------- bad inputs
def _refused(capsys, tmp_path, name: str, *argv) -> str:
    assert convert(*argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: "), err  # (above: save_pretrained's progress bars)
    no_leftovers(str(tmp_path), name)
    return err


def _rewrite_safetensors(hf, edit) -> None:
    from safetensors.torch import load_file, save_file
    path = os.path.join(hf, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_bad_hf_inputs_are_refused_and_leave_nothing(tmp_path, capsys):
    hf = str(tmp_path / "hf")
    save_model(hf, "llama")
    imp = ("import-hf", "--load", hf, "--save", tmp_path / "ck", "--target-tensor-parallel-size", "2")
    q1 = "model.layers.1.self_attn.q_proj.weight"
    k0 = "model.layers.0.self_attn.k_proj.weight"

    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    bad = dict(config, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(bad, f)
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in err

    rope = dict(config, rope_parameters={"rope_type": "made-up", "rope_theta": 10000.0, "factor": 2.0})
    rope.pop("rope_scaling", None)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(rope, f)
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "rope_type" in err and "made-up" in err

    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(dict(config, num_key_value_heads=1, num_attention_heads=4), f)
    err = _refused(capsys, tmp_path, "ck", *imp)  # one KV head cannot be split over TP = 2
    assert "--target-tensor-parallel-size (2)" in err
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)

    original = hf_tensors(hf)
    _rewrite_safetensors(hf, lambda t: t.pop(q1))
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert f"missing tensor {q1} (expected shape [32, 32])" in err

    _rewrite_safetensors(hf, lambda t: t.update({q1: original[q1], "model.layers.0.self_attn.extra.weight":
                                                 torch.zeros(3, 4)}))
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "unexpected tensor model.layers.0.self_attn.extra.weight (shape [3, 4]" in err

    _rewrite_safetensors(hf, lambda t: (t.pop("model.layers.0.self_attn.extra.weight"),
                                        t.update({k0: torch.zeros(24, 32)})))
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert f"tensor {k0} in model.safetensors has shape [24, 32], expected [16, 32]" in err

    _rewrite_safetensors(hf, lambda t: t.update({k0: original[k0]}))
    path = os.path.join(hf, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # the last tensor's bytes are gone: found only while writing
        f.truncate(size - 64)
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "model.safetensors" in err and ("damaged" in err or "truncated" in err)

    err = _refused(capsys, tmp_path, "nope", "import-hf", "--load", tmp_path / "nope", "--save", tmp_path / "x")
    assert "no such directory" in err
    os.rename(os.path.join(hf, "config.json"), os.path.join(hf, "config.old"))
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "no config.json" in err


def test_sharded_index_problems_are_named(tmp_path, capsys):
    hf = str(tmp_path / "hf")
    save_model(hf, "llama", max_shard_size="20KB")
    imp = ("import-hf", "--load", hf, "--save", tmp_path / "ck")
    index = os.path.join(hf, "model.safetensors.index.json")
    with open(index) as f:
        good = json.load(f)
    first = sorted(set(good["weight_map"].values()))[0]
    moved = dict(good, weight_map={n: ("model-00002-of-09999.safetensors" if f == first else f)
                                   for n, f in good["weight_map"].items()})
    with open(index, "w") as f:
        json.dump(moved, f)
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert "model-00002-of-09999.safetensors, which is not in" in err
    wrong = dict(good["weight_map"])
    name = next(n for n, f in wrong.items() if f == first)
    wrong[name] = next(f for f in sorted(set(wrong.values())) if f != first)
    with open(index, "w") as f:
        json.dump(dict(good, weight_map=wrong), f)
    err = _refused(capsys, tmp_path, "ck", *imp)
    assert f"puts tensor {name} in {wrong[name]}" in err


def test_existing_output_needs_force_and_survives_a_failed_replace(tmp_path, capsys):
    hf = str(tmp_path / "hf")
    save_model(hf, "llama")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert("import-hf", "--load", hf, "--save", out) == 2
    err = capsys.readouterr().err
    assert f"--save {out} already exists; pass --force" in err
    assert (out / "keep.txt").read_text() == "mine"
    os.remove(os.path.join(hf, "model.safetensors"))
    assert convert("import-hf", "--load", hf, "--save", out, "--force") == 2
    assert "no weights found" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"  # a failed --force run keeps the old output
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert convert("import-hf", "--load", hf, "--save", tmp_path / "hf" / "sub") == 2
    assert "overlap" in capsys.readouterr().err


def test_export_refuses_gpt2_style_and_bad_shard_size(tmp_path, capsys):
    _scratch_checkpoint(str(tmp_path / "gpt2"), normalization="LayerNorm", position_embedding_type="learned_absolute",
                        swiglu=False, disable_bias_linear=False, group_query_attention=False)
    err = _refused(capsys, tmp_path, "out", "export-hf", "--load", tmp_path / "gpt2", "--save", tmp_path / "out")
    assert "cannot be expressed" in err and "LayerNorm (Llama/Qwen2 use RMSNorm: --normalization RMSNorm)" in err
    assert "--position-embedding-type learned_absolute" in err and "--swiglu" in err
    _scratch_checkpoint(str(tmp_path / "ll"))
    err = _refused(capsys, tmp_path, "out", "export-hf", "--load", tmp_path / "ll", "--save", tmp_path / "out",
                   "--max-shard-size", "5 parsecs")
    assert "--max-shard-size" in err


def test_cli_exit_status_and_one_error_line(tmp_path):
    """As a user runs it: exit status 2, one ``error:`` line, no traceback."""
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "import-hf", "--load", str(tmp_path / "x"),
                           "--save", str(tmp_path / "y")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: --load ") and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "y")
