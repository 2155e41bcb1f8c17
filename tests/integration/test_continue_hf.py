"""Continued pretraining of a Hugging Face model (acceptance 2 of the interop issue): import a tiny
LlamaForCausalLM at TP = 2 x PP = 2, train with ``--use-checkpoint-args --finetune``; the first
iteration's loss is the loss transformers computes on the same batch (fp32, <= 1e-5)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import (TINY_MODEL_FLAGS, VOCAB, convert_cli, make_corpus, tiny_argv, train_body,
                                              without_flags)

pytestmark = pytest.mark.slow

HF_VOCAB = 101  # more rows than the tokenizer's 96 ids, as Qwen's config.json has


def _tiny_llama(path: str, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1 in transformers: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


def _hf_loss(path: str, batches: list[torch.Tensor]) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss for b in batches]
    return float(torch.stack(losses).mean())


def _first_batches(argv: list[str], n: int) -> list[torch.Tensor]:
    """The token sequences (inputs + the last label) of the first ``n`` micro batches of size 1."""
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.data import build_datasets, micro_batches
    args = parse_arguments(argv, world_size=4, device_type="cpu")
    train, _, _ = build_datasets(args, is_builder_rank=True, barrier=lambda: None, vocab_size=HF_VOCAB)
    it = micro_batches(train, 0, 1, 0, 1, torch.device("cpu"))
    out = []
    for _ in range(n):
        b = next(it)
        out.append(torch.cat([b.tokens, b.labels[:, -1:]], dim=1))
        assert torch.equal(b.tokens[:, 1:], b.labels[:, :-1])
    return out


def test_first_loss_after_import_equals_transformers_tp2_pp2(tmp_path):
    hf = str(tmp_path / "hf")
    _tiny_llama(hf, tied=False)
    ckpt = str(tmp_path / "imported")
    proc = convert_cli("import-hf", "--load", hf, "--save", ckpt, "--target-tensor-parallel-size", "2",
                       "--target-pipeline-parallel-size", "2", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix = make_corpus(str(tmp_path))
    base = tiny_argv(prefix, str(tmp_path / "cache"), iters=3)
    assert "--micro-batch-size" in base and base[base.index("--global-batch-size") + 1] == "4"
    argv = without_flags(base, *TINY_MODEL_FLAGS) + [
        "--load", ckpt, "--use-checkpoint-args", "--finetune", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--seq-length", "32"]
    (result,) = run_distributed(train_body, 4, args=([argv],), timeout=600)[0]
    ours = result["losses"][1]
    want = _hf_loss(hf, _first_batches(argv, 4))
    assert abs(ours - want) / want <= 1e-5, (ours, want)
    assert VOCAB <= HF_VOCAB
