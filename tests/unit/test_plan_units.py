"""The planner's pieces: parameter counts against built models, the layout, the start-up API,
optimizer-state rules, and the command line (flags, config.json, errors, JSON, the 13B search)."""
from __future__ import annotations

import json

import pytest

from megatron_ru.config.model import ModelConfig
from megatron_ru.plan import Layout, predict_memory, stage_param_counts
from megatron_ru.plan.cli import run
from megatron_ru.plan.memory import CPU_PROCESS_BYTES
from megatron_ru.plan.params import stage_params, stage_tensors
from megatron_ru.plan.states import state_bytes

LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
             ffn_hidden_size=128, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True, max_position_embeddings=32)
GPT = dict(num_layers=4, hidden_size=64, num_attention_heads=4, max_position_embeddings=32)


@pytest.mark.parametrize("kw", [LLAMA, GPT], ids=["llama", "gpt"])
def test_stage_counts_equal_the_built_model(kw):
    from megatron_ru.model.gpt import GPTModel
    cfg = ModelConfig(**kw)
    model = GPTModel(cfg, 1000)
    assert stage_param_counts(cfg, 1000, 1, 1) == [sum(p.numel() for p in model.parameters())]
    # tied embeddings on a pipeline: the word embeddings on the first and on the last stage
    counts = stage_param_counts(cfg, 1000, 2, 2)
    rows = 1024  # 1000 padded to 128 x TP 2
    if cfg.tied_embeddings:
        assert stage_params(cfg, 1000, 2, 2)[1].tied_copy == rows * 64 // 2
    assert sum(counts) > sum(p.numel() for p in model.parameters()) // 2


def test_layout_basics():
    lay = Layout(tp=2, pp=4, dp=8, micro_batch=2, global_batch=512, seq_length=2048, recompute="full", zero_stage=1,
                 precision="bf16", sequence_parallel=True)
    assert lay.num_micro_batches == 32 and lay.world_size == 64
    assert "--recompute-granularity" in lay.flags() and "--sequence-parallel" in lay.flags()
    with pytest.raises(ValueError, match="precision"):
        Layout(1, 1, 1, 1, 1, 8, precision="fp8")


def test_lora_only_adapters_get_optimizer_state():
    from megatron_ru.config.lora import LoraSpec
    cfg = ModelConfig(**LLAMA)
    cfg.lora = LoraSpec(rank=4, alpha=8.0).to_dict()
    full = ModelConfig(**LLAMA)
    lay = Layout(1, 1, 1, 1, 1, 32, precision="fp32")
    with_lora = state_bytes(stage_tensors(cfg, 1000, 1, 1)[0], lay)
    plain = state_bytes(stage_tensors(full, 1000, 1, 1)[0], lay)
    assert with_lora.parameters > plain.parameters       # adapters added
    assert with_lora.optimizer < plain.optimizer / 10    # only they are trained


def test_bf16_at_zero_0_is_not_proposed():
    from megatron_ru.plan.search import candidate_layouts
    layouts, _ = candidate_layouts(ModelConfig(**GPT), 4, 8, 32, "bf16", 8)
    assert layouts and all(lay.zero_stage > 0 for lay in layouts)


def test_summary_adds_up():
    cfg = ModelConfig(**GPT)
    pred = predict_memory(cfg, 1000, Layout(1, 2, 2, 1, 8, 32, zero_stage=1, precision="bf16"), device="cpu")
    assert pred.total_bytes == sum(pred.terms.values())
    # no CUDA context on CPU: what a CPU rank holds beyond the terms, and the fragmentation share
    assert CPU_PROCESS_BYTES < pred.terms["allowance"] < CPU_PROCESS_BYTES + pred.total_bytes // 10
    assert pred.summary().startswith("predicted peak per GPU ")
    cuda = predict_memory(cfg, 1000, Layout(1, 2, 2, 1, 8, 32, zero_stage=1, precision="bf16"), device="cuda")
    assert cuda.terms["allowance"] >= 2 ** 30


def test_cli_flags_json_and_13b(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40",
            "--max-position-embeddings", "2048", "--vocab-size", "50257", "--seq-length", "2048",
            "--global-batch-size", "512", "--num-gpus", "32", "--gpus-per-node", "4", "--gpu", "v100-16gb",
            "--zero-stage", "1", "--sequence-parallel", "off", "--max-micro-batch-size", "2", "--json", str(out)]
    assert run(argv) == 0
    text = capsys.readouterr().out
    assert "pretrain_gpt.py flags: --tensor-model-parallel-size" in text and "TP=" in text
    plan = json.loads(out.read_text())
    assert plan["num_fitting"] >= 1 and plan["best"]["flags"]
    # ZeRO 1 without sequence parallelism: every TP 4 x PP 8 layout needs recomputation
    assert any(r.startswith("TP 4 x PP 8 without recomputation") for r in plan["rejected"])
    assert not any(r.startswith("TP 4 x PP 8 with full") for r in plan["rejected"])


def test_cli_hf_config(tmp_path, capsys):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
          "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert run(["--hf-config", str(path), "--num-gpus", "8", "--gpu", "a100-80gb", "--global-batch-size", "64",
                "--seq-length", "256", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["vocab_size"] == 1000 and plan["best"]["layout"]["precision"] == "bf16"


def test_cli_errors_name_the_flag(capsys):
    assert run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--max-position-embeddings", "32", "--num-gpus", "2", "--gpu", "h100-80gb",
                "--global-batch-size", "8"]) == 2
    assert "--vocab-size" in capsys.readouterr().err
    assert run(["--use-checkpoint-args", "--num-gpus", "2", "--gpu", "h100-80gb", "--global-batch-size", "8"]) == 2
    assert "--load" in capsys.readouterr().err
    assert run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--position-embedding-type",
                "rope", "--vocab-size", "100", "--num-gpus", "2", "--gpu", "h100-80gb", "--global-batch-size", "8"]) == 2
    assert "--seq-length" in capsys.readouterr().err


def test_cli_model_from_checkpoint(tmp_path, capsys):
    from megatron_ru.model.spec import model_args_dict
    it = tmp_path / "iter_0000000"
    it.mkdir()
    meta = dict(iteration=0, consumed_train_samples=0, consumed_valid_samples=0, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=0, args={}, files={},
                model_args=model_args_dict(ModelConfig(**LLAMA)), vocab_size=777)
    (it / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0\n")
    base = ["--load", str(tmp_path), "--use-checkpoint-args", "--num-gpus", "4", "--gpu", "a100-40gb",
            "--global-batch-size", "16", "--seq-length", "32", "--json", "-"]
    assert run(base) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["vocab_size"] == 777 and plan["model"]["config"]["swiglu"] is True
    assert run(base + ["--hidden-size", "128"]) == 2  # contradicts the checkpoint
    assert "--hidden-size" in capsys.readouterr().err


def test_layout_for_arguments_refuses_a_world_size_tp_pp_does_not_divide():
    """No silent clamp: the planner's layout of a command line follows the one DP rule."""
    import pytest

    from megatron_ru.plan.api import layout_for_arguments

    class _Args:  # what layout_for_arguments reads of Arguments
        world_size, tp, pp, cp, sequence_parallel, precision = 8, 2, 2, 1, False, "bf16"

    args = _Args()
    args.parallel = type("P", (), {"cp_comm_type": "p2p"})()
    args.training = type("T", (), {"global_batch_size": None, "micro_batch_size": 1, "zero_stage": 1})()
    args.data = type("D", (), {"seq_length": 128})()
    args.model = type("M", (), {"recompute": False, "recompute_granularity": None, "distribute_saved_activations": False})()
    assert layout_for_arguments(args).dp == 2
    with pytest.raises(ValueError, match=r"WORLD_SIZE=6 is not divisible by TP x PP = 2 x 2 = 4"):
        layout_for_arguments(args, world_size=6)


def test_hf_config_parameter_count_is_transformers(capsys, tmp_path):
    """The planner's parameters of every imported family (Qwen3's query/key norms and query width, tied and
    untied, GQA and not) are the parameters transformers builds from the same config.json."""
    from transformers import AutoModelForCausalLM

    from megatron_ru.convert.hf_mapping import model_config_from_hf
    from megatron_ru.plan.params import total_param_count
    from tests.unit.test_hf_families import CASES
    for case, make in CASES.items():
        config = make()
        hf = {**config.to_dict(), "architectures": [AutoModelForCausalLM._model_mapping[type(config)].__name__]}
        cfg, vocab = model_config_from_hf(hf)
        want = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())  # a tied matrix once
        assert total_param_count(cfg, vocab) == want, case
        path = tmp_path / f"{case}.json"
        path.write_text(json.dumps(hf))
        assert run(["--hf-config", str(path), "--num-gpus", "2", "--gpu", "a100-80gb", "--global-batch-size", "8",
                    "--seq-length", "32", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["model"]["parameters"] == want, case


# google/gemma-3-1b-pt's config.json as published (transformers 4 spelling: sliding_window_pattern,
# rope_local_base_freq): a 262,144-row tied vocabulary, one KV head, head size 256 != 1152 / 4, 22 local layers
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
             "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
             "sliding_window": 512, "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000,
             "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
             "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
             "rope_scaling": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16"}


def test_gemma3_1b_plan(capsys, tmp_path):
    """The planner on Gemma 3 1B's own config.json: transformers' parameter count (999,885,952), the 262k
    vocabulary unpadded, FLOPs with 22 local layers (window 512) and 4 global ones at sequence 4096."""
    from megatron_ru.convert.hf_mapping import model_config_from_hf
    from megatron_ru.model.flops import ModelShape, flops_per_token
    cfg, vocab = model_config_from_hf(GEMMA3_1B)
    shape = ModelShape.of(cfg, vocab, 4096)
    assert (vocab, shape.window, shape.local_layers) == (262144, 512, 22)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_1B))
    assert run(["--hf-config", str(path), "--num-gpus", "8", "--gpu", "h100-80gb", "--global-batch-size", "64",
                "--seq-length", "4096", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["parameters"] == 999_885_952 and plan["model"]["vocab_size"] == 262144
    assert plan["best"]["layout"]["tp"] == 1   # one KV head: TP 1 only
    global_keys = 4 * 4096 + 22 * 512
    assert flops_per_token(shape) == 3 * (26 * (2 * 1152 * (1024 + 512) + 2 * 1024 * 1152 + 2 * 1152 * 6912 * 3)
                                          + 4 * 1024 * global_keys + 2 * 1152 * 262144)


LLAMA3_8B = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                 group_query_attention=True, num_query_groups=8, max_position_embeddings=65536,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                 untie_embeddings_and_output_weights=True)


def test_context_parallel_layout_holds_a_cp_share_of_the_tokens():
    """A rank at CP 4 saves what a rank of a 4x shorter sequence saves, plus the ring's key/value block in flight
    (2 x tokens x KV width); ZeRO partitions over DP x CP (DP 1 x CP 4 holds what DP 4 holds); the flags, the
    label and the sequence rule."""
    from megatron_ru.plan import activations as act
    cfg = ModelConfig(**LLAMA3_8B)
    rt = act.Runtime("cuda", "fused")
    base = dict(tp=1, pp=1, micro_batch=1, global_batch=4, zero_stage=1, precision="bf16")
    cp4 = Layout(dp=1, cp=4, seq_length=16384, **base)
    short = Layout(dp=4, seq_length=4096, **base)
    kw = 8 * 128
    terms4, terms_short = act.layer_terms(cfg, cp4, rt), act.layer_terms(cfg, short, rt)
    assert terms4["attention"] == terms_short["attention"] + 2 * 2 * 4096 * kw
    assert {k: v for k, v in terms4.items() if k != "attention"} == \
        {k: v for k, v in terms_short.items() if k != "attention"}
    whole = Layout(dp=4, seq_length=16384, **base)
    assert sum(act.layer_terms(cfg, whole, rt).values()) > 3.9 * sum(terms_short.values())
    p4, p1 = predict_memory(cfg, 128256, cp4), predict_memory(cfg, 128256, whole)
    assert p4.terms["optimizer"] == p1.terms["optimizer"] and p4.terms["parameters"] == p1.terms["parameters"]
    assert p4.terms["activations"] < 0.3 * p1.terms["activations"]
    assert cp4.world_size == 4 and cp4.data_axis == 4 and cp4.grid.cp == 4
    assert "--context-parallel-size 4" in " ".join(cp4.flags()) and cp4.short() == "TP1 PP1 DP1 CP4 mb1 ZeRO1"
    with pytest.raises(ValueError, match=r"--seq-length 16000 is not divisible by 2 x --context-parallel-size = 12"):
        Layout(dp=1, cp=6, seq_length=16000, **base)


def test_planner_searches_context_parallelism_for_a_long_sequence():
    """Llama-3-8B at 64K tokens on 16 H100s: no layout without CP fits as fast (the best uses CP); limited to
    CP 1 the best is another (slower) layout; a CP size the sequence does not split into 2 x CP is named."""
    from megatron_ru.plan.hardware import PRESETS
    from megatron_ru.plan.search import SearchSpace, plan_layouts
    cfg = ModelConfig(**LLAMA3_8B)
    plan = plan_layouts(cfg, 128256, PRESETS["h100-80gb"], 16, 16, 65536, "bf16")
    best = plan.best.layout
    assert best.cp > 1 and best.world_size == 16, best
    assert "--context-parallel-size" in best.flags()
    assert any(" x CP " in r for r in plan.rejected)
    no_cp = plan_layouts(cfg, 128256, PRESETS["h100-80gb"], 16, 16, 65536, "bf16",
                         space=SearchSpace(context_parallel=(1,)))
    assert all(c.layout.cp == 1 for c in no_cp.fitting)
    assert no_cp.best.time.tokens_per_second_per_gpu < plan.best.time.tokens_per_second_per_gpu
    odd = plan_layouts(ModelConfig(**{**LLAMA, "max_position_embeddings": 64}), 1000, PRESETS["h100-80gb"], 3, 3, 64,
                       "bf16", space=SearchSpace(context_parallel=(1, 3)))
    assert "CP 3: --seq-length 64 is not divisible by 2 x CP = 6" in odd.invalid
