"""LoRA acceptance 2 and bad input: with B = 0 the model's output is bit-identical to the base; after
training the frozen base weights are bit-identical and the optimizer holds state only for the
trainable parameters; flags that match nothing or cannot be honoured are refused by name."""
import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}


def _tiny_cfg(**lora):
    from megatron_ru.config.lora import LoraSpec
    from megatron_ru.config.model import ModelConfig
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                      num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, make_vocab_size_divisible_by=4)
    if lora:
        cfg.lora = LoraSpec(**lora).to_dict()
    return cfg


@pytest.mark.parametrize("lora", [dict(rank=4, alpha=8, dropout=0.1),
                                  dict(rank=4, alpha=4, use_dora=True, targets=["q_proj", "v_proj", "down_proj"]),
                                  dict(rank=2, alpha=2, init="gaussian", use_rslora=True)])
def test_zero_b_output_is_the_base(lora):
    from megatron_ru.model import GPTModel
    from megatron_ru.model.lora import init_dora_magnitudes
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    base = GPTModel(_tiny_cfg(), 40, None, seed=3).eval()
    adapted = GPTModel(_tiny_cfg(**lora), 40, None, seed=3).eval()
    init_dora_magnitudes(adapted)
    assert any(".lora." in n for n, _ in adapted.named_parameters())
    with torch.no_grad():
        assert torch.equal(base(tokens), adapted(tokens))


def _train_and_inspect(rank, world_size, argv):
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.model.spec import canonical_named_parameters
    from megatron_ru.training.pretrain import setup
    args = parse_arguments(argv, world_size=world_size, device_type="cpu")
    trainer = setup(args)
    module = trainer.engine.module
    before = {n: p.detach().clone() for n, p in canonical_named_parameters(module, args.model)}
    trainable = {n for n, p in canonical_named_parameters(module, args.model) if p.requires_grad}
    trainer.train()
    after = {n: p.detach().clone() for n, p in canonical_named_parameters(module, args.model)}
    opt = trainer.engine.optimizer
    opt = getattr(opt, "optimizer", opt)
    in_optimizer = sum(len(g["params"]) for g in opt.param_groups)
    with_state = sum(1 for s in opt.state.values() if s)
    state_values = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    trainer.metrics.close()
    return {"changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
            "trainable": sorted(trainable), "frozen": sorted(set(before) - trainable),
            "in_optimizer": in_optimizer, "with_state": with_state, "state_values": state_values,
            "trainable_values": sum(after[n].numel() for n in trainable)}


def test_frozen_base_and_optimizer_state(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    argv = tiny_argv(prefix, cache, iters=3, extra=["--eval-iters", "0", "--lora-rank", "4", "--lora-dropout", "0.1",
                                                    "--use-dora", "--lora-modules-to-save", "output_layer"])
    (r,) = run_distributed(_train_and_inspect, 1, args=(argv,), timeout=300, env=ENV)
    assert r["frozen"] and all(".lora." not in n and not n.startswith("output_layer.") for n in r["frozen"])
    assert set(r["changed"]) == set(r["trainable"])          # every trained tensor moved, no frozen one did
    assert all(".lora." in n or n.startswith("output_layer.") for n in r["trainable"])
    assert r["in_optimizer"] == r["with_state"] == len(r["trainable"])
    assert r["state_values"] == 2 * r["trainable_values"]   # Adam: two moments per trainable value, none else


def _errors(rank, world_size, argvs):
    from megatron_ru.flags.arguments import parse_arguments
    out = []
    for argv in argvs:
        with pytest.raises(ValueError) as e:
            parse_arguments(argv, world_size=world_size, device_type="cpu")
        out.append(str(e.value))
    return out


def test_bad_lora_flags_are_refused(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    pattern = tmp_path / "p.json"
    pattern.write_text(json.dumps({"*.nothing.*": 8}))
    base = tiny_argv(prefix, cache, iters=1)
    cases = [
        (["--lora-rank", "4", "--lora-target-modules", "qproj"], "--lora-target-modules 'qproj' matches no layer"),
        (["--lora-rank", "4", "--lora-target-modules", "lm_head"], "use --lora-modules-to-save"),
        (["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "q_proj"], "both a whole fused layer"),
        (["--lora-rank", "4", "--lora-rank-pattern", str(pattern)], "--lora-rank-pattern: the pattern '*.nothing.*'"),
        (["--use-dora"], "--use-dora need adapters: add --lora-rank R"),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1)"),
        (["--lora-rank", "4", "--train-only-embeddings"], "use --lora-modules-to-save"),
    ]
    got = _errors(0, 1, [base + extra for extra, _ in cases])
    for (extra, want), message in zip(cases, got):
        assert want in message, (extra, message)


def test_lora_on_an_imported_model_starts_as_the_base_tp2_pp2(tmp_path):
    """--finetune from an imported Hugging Face Llama (no adapters in the checkpoint) with DoRA adapters
    at TP = 2 x PP = 2: the adapters start fresh (B = 0, magnitudes = the loaded rows' norms), so the
    first loss is transformers' loss on the same batches."""
    from tests.integration._train_helpers import TINY_MODEL_FLAGS, convert_cli, train_body, without_flags
    from tests.integration.test_continue_hf import _first_batches, _hf_loss, _tiny_llama
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "imported")
    _tiny_llama(hf, tied=False)
    proc = convert_cli("import-hf", "--load", hf, "--save", ckpt, "--target-tensor-parallel-size", "2",
                       "--target-pipeline-parallel-size", "2", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix = make_corpus(str(tmp_path))
    argv = without_flags(tiny_argv(prefix, str(tmp_path / "cache"), iters=3), *TINY_MODEL_FLAGS) + [
        "--load", ckpt, "--use-checkpoint-args", "--finetune", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--seq-length", "32", "--lora-rank", "4", "--use-dora",
        "--lora-modules-to-save", "embedding", "output_layer", "--zero-stage", "1"]
    (result,) = run_distributed(train_body, 4, args=([argv],), timeout=600, env=ENV)[0]
    want = _hf_loss(hf, _first_batches(argv, 4))
    assert abs(result["losses"][1] - want) / want <= 1e-5, (result["losses"][1], want)
    assert result["iteration"] == 3


def test_modules_to_save_matching_nothing_is_refused_on_every_stage(tmp_path):
    """Checked where the model exists (a pipeline: over all stages), before any training."""
    from tests.integration._train_helpers import train_body
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    argv = tiny_argv(prefix, cache, iters=3, extra=["--pipeline-model-parallel-size", "2", "--lora-rank", "4",
                                                    "--lora-modules-to-save", "embedding.position_embeddings.*"])
    out = run_distributed(train_body, 2, args=([["expect-error", *argv]],), timeout=300, env=ENV)
    for (r,) in out:
        assert "--lora-modules-to-save 'embedding.position_embeddings.*' matches no parameter" in r["error"]
