"""LoRA acceptance 3: a tiny Hugging Face Llama (and a Qwen3, a Gemma 3, a Llama-3.2- and a Nemo-shaped model) imported, trained with LoRA (or DoRA) at TP = 2 x PP = 2
for a few iterations and exported with ``--lora peft`` gives the same logits through peft +
transformers as megatron_ru computes (<= 1e-5); ``--lora merge`` gives the same logits through a plain
transformers model; the PEFT adapter imports back (``import-hf --lora-adapter``) to the same tensors."""
import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import (TINY_MODEL_FLAGS, convert_cli, make_corpus, tiny_argv, train_body,
                                              without_flags)

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}
TOL = 1e-5


def _our_logits(ckpt: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint (adapters included) computed by megatron_ru in one process."""
    from megatron_ru.inference.model_io import open_model
    from megatron_ru.model import GPTModel
    from megatron_ru.checkpointing.layout import specs_by_name
    from megatron_ru.model.spec import canonical_named_parameters
    from megatron_ru.model.shards import layout_shard, padded_vocab_rows
    src = open_model(ckpt)
    model = GPTModel(src.cfg, src.vocab_size, None, seed=1).eval()
    specs = specs_by_name(src.cfg, src.vocab_size)
    rows = padded_vocab_rows(src.cfg, src.vocab_size, 1)
    with torch.no_grad():
        for name, p in canonical_named_parameters(model, src.cfg):
            p.copy_(layout_shard(specs[name], src.get(name).float(), rows, 1, 0))
        return model(tokens)[..., :src.vocab_size].float()


def _convert(*argv: str) -> None:
    """tools/convert_checkpoint.py in this process (the tool as a subprocess, its exit status and messages:
    test_lora_checkpoint_needs_a_lora_mode and test_convert_hf.py)."""
    from tests.integration.test_convert_hf import convert
    assert convert(*argv) == 0, argv


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


FAMILIES = ("qwen3", "gemma3", "llama32", "nemo")


def _tiny_family(path: str, family: str) -> None:
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    if family == "qwen3":      # query/key norms, head size 16 != 64 / 8, tied
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common))
    elif family == "gemma3":   # local (window 8 < the 24 tokens scored) and global layers, four (1 + w) norms, tied
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            head_dim=16, sliding_window=8, query_pre_attn_scalar=20, layer_types=["sliding_attention",
                                                                                  "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **common))
    elif family == "llama32":  # tied, llama3 RoPE scaling
        model = tf.LlamaForCausalLM(tf.LlamaConfig(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **common))
    else:                      # Mistral-Nemo's shape: head size 16 != 64 / 8, untied, no window
        model = tf.MistralForCausalLM(tf.MistralConfig(head_dim=16, sliding_window=None, tie_word_embeddings=False,
                                                       **common))
    with torch.no_grad():  # norms start at 1 in transformers: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Six LoRA runs: two from one imported Llama (fused adapters with a rank pattern and the embeddings
    and output layer trained alongside; DoRA on peft-style parts with rsLoRA), one from each family of
    FAMILIES (every linear a target; DoRA on Gemma 3, with its query norms and post-attention norms trained
    fully next to the adapters)."""
    from tests.integration.test_continue_hf import _tiny_llama
    d = tmp_path_factory.mktemp("lora_export")
    hf, imported = str(d / "hf"), str(d / "imported")
    _tiny_llama(hf, tied=False)
    for family in FAMILIES:
        _tiny_family(str(d / f"hf_{family}"), family)
    for source, target in ((hf, imported), *((str(d / f"hf_{f}"), str(d / f"imported_{f}")) for f in FAMILIES)):
        _convert("import-hf", "--load", source, "--save", target, "--target-tensor-parallel-size", "2",
                 "--target-pipeline-parallel-size", "2", "--dtype", "fp32")
    pattern = d / "ranks.json"
    pattern.write_text(json.dumps({"*.layers.3.*": 8}))
    prefix = make_corpus(str(d))
    base = without_flags(tiny_argv(prefix, str(d / "cache"), iters=3), *TINY_MODEL_FLAGS) + [
        "--load", imported, "--use-checkpoint-args", "--finetune", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--seq-length", "32", "--lora-rank", "4", "--lora-dropout", "0.1",
        "--lr", "1e-2"]
    runs = {"lora": base + ["--save", str(d / "lora"), "--lora-alpha", "8", "--lora-rank-pattern", str(pattern),
                            "--lora-modules-to-save", "embedding", "output_layer"],
            "dora": base + ["--save", str(d / "dora"), "--use-dora", "--use-rslora", "--lora-target-modules",
                            "q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            **{f: [a if a != imported else str(d / f"imported_{f}") for a in base]
               + ["--save", str(d / f), "--lora-alpha", "8"]
               + (["--use-dora", "--lora-modules-to-save", "*q_layernorm*", "*post_self_attn_layernorm*"]
                  if f == "gemma3" else [])
               for f in FAMILIES}}
    results = run_distributed(train_body, 4, args=(list(runs.values()),), timeout=600, env=ENV)[0]
    assert all(r["iteration"] == 3 for r in results)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    return {"dir": d, "hf": hf, "tokens": tokens, **{k: str(d / k) for k in runs}}


@pytest.mark.parametrize("kind", ["lora", "dora", *FAMILIES])
def test_peft_export_gives_our_logits(trained, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = str(trained["dir"] / f"{kind}_peft")
    _convert("export-hf", "--load", trained[kind], "--save", out, "--lora", "peft")
    assert sorted(os.listdir(os.path.join(out, "adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]
    ours = _our_logits(trained[kind], trained["tokens"])
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    plain = _hf_logits(base, trained["tokens"])
    model = PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    theirs = _hf_logits(model, trained["tokens"])
    assert _rel(plain, ours) > 1e-3          # the adapters (and trained embeddings) change the logits
    assert _rel(theirs, ours) <= TOL, _rel(theirs, ours)
    if kind == "gemma3":   # the norms trained next to the adapters are in the exported base; the others are not
        from safetensors.torch import load_file
        src = load_file(str(trained["dir"] / "hf_gemma3" / "model.safetensors"))
        got = load_file(os.path.join(out, "model.safetensors"))
        layer = "model.layers.0."
        for name in ("self_attn.q_norm.weight", "post_attention_layernorm.weight"):
            assert not torch.equal(got[layer + name], src[layer + name]), name
        for name in ("self_attn.k_norm.weight", "input_layernorm.weight", "pre_feedforward_layernorm.weight"):
            assert torch.equal(got[layer + name], src[layer + name]), name


@pytest.mark.parametrize("kind", ["lora", "dora", *FAMILIES])
def test_merged_export_gives_our_logits(trained, kind):
    from transformers import AutoModelForCausalLM
    out = str(trained["dir"] / f"{kind}_merged")
    _convert("export-hf", "--load", trained[kind], "--save", out, "--lora", "merge")
    assert not os.path.exists(os.path.join(out, "adapter"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert _rel(_hf_logits(model, trained["tokens"]), _our_logits(trained[kind], trained["tokens"])) <= TOL


def test_lora_checkpoint_needs_a_lora_mode(trained):
    proc = convert_cli("export-hf", "--load", trained["lora"], "--save", str(trained["dir"] / "x"))
    assert proc.returncode == 2 and "holds LoRA adapters" in proc.stderr and "--lora merge" in proc.stderr


def test_peft_adapter_imports_back(trained):
    """import-hf --lora-adapter: the exported PEFT adapter on its base becomes a checkpoint whose logits
    are ours again (at another layout, TP = 1 x PP = 2)."""
    out = str(trained["dir"] / "dora_peft_rt")
    assert convert_cli("export-hf", "--load", trained["dora"], "--save", out, "--lora", "peft").returncode == 0
    back = str(trained["dir"] / "dora_back")
    proc = convert_cli("import-hf", "--load", out, "--save", back, "--lora-adapter", os.path.join(out, "adapter"),
                    "--target-pipeline-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _our_logits(back, trained["tokens"]), _our_logits(trained["dora"], trained["tokens"])
    assert _rel(got, want) <= TOL
