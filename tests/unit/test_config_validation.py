"""Every invalid configuration fails before any process group work, naming the flags."""
import json

import pytest
import torch.distributed as dist

from megatron_ru.flags.arguments import parse_arguments
from tests.fixtures.datasets import write_dataset


@pytest.fixture
def data_prefix(tmp_path):
    return write_dataset(str(tmp_path / "corpus_text_document"))


def _argv(prefix, **over):
    flags = {"--num-layers": 4, "--hidden-size": 64, "--num-attention-heads": 4, "--max-position-embeddings": 64,
             "--seq-length": 32, "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 10,
             "--tokenizer-type": "NullTokenizer", "--vocab-size": 100, "--data-path": prefix, "--lr": 1e-3}
    switches = []
    for k, v in over.items():
        flag = "--" + k.replace("_", "-") if not k.startswith("--") else k
        if v is True:
            switches.append(flag)
        elif v is None:
            flags.pop(flag, None)
        else:
            flags[flag] = v
    out = []
    for k, v in flags.items():
        out += [k, str(v)]
    return out + switches


def _error(prefix, world_size=4, device_type="cpu", **over):
    with pytest.raises(ValueError) as e:
        parse_arguments(_argv(prefix, **over), world_size=world_size, device_type=device_type)
    assert not dist.is_initialized()  # validation happens before any process group work
    return str(e.value)


def test_valid_config_resolves_derived_values(data_prefix):
    a = parse_arguments(_argv(data_prefix, tensor_model_parallel_size=2), world_size=4, device_type="cpu")
    assert (a.tp, a.pp, a.dp, a.global_batch_size, a.grad_accum, a.train_iters) == (2, 1, 2, 8, 2, 10)
    a = parse_arguments(_argv(data_prefix, global_batch_size=None, train_iters=None, train_samples=64,
                              micro_batch_size=4), world_size=4, device_type="cpu")
    assert (a.global_batch_size, a.grad_accum, a.train_iters) == (16, 1, 4)
    # the deepspeed launcher's --local_rank is accepted
    a = parse_arguments(_argv(data_prefix) + ["--local_rank=0", "--deepspeed"], world_size=4, device_type="cpu")
    assert a.training.deepspeed


def test_zero_2_and_3_with_pipeline(data_prefix):
    for stage in (2, 3):
        msg = _error(data_prefix, zero_stage=stage, pipeline_model_parallel_size=2)
        assert f"--zero-stage {stage} cannot be combined with --pipeline-model-parallel-size 2" in msg
    parse_arguments(_argv(data_prefix, zero_stage=1, pipeline_model_parallel_size=2), world_size=4, device_type="cpu")


def test_checkpoint_format_that_cannot_hold_the_state_is_refused_at_start(data_prefix):
    """--ckpt-format megatron_ru where only DeepSpeed's files hold the optimizer state: refused before training,
    not at the first save; auto (the default) and deepspeed accept it."""
    msg = _error(data_prefix, zero_stage=3, ckpt_format="megatron_ru")
    assert "--ckpt-format megatron_ru cannot hold --zero-stage 3's state" in msg and "--ckpt-format auto" in msg
    msg = _error(data_prefix, fp16=True, ckpt_format="megatron_ru", device_type="cuda")
    assert "--ckpt-format megatron_ru cannot hold --fp16's optimizer state at --zero-stage 0" in msg
    for fmt in ("auto", "deepspeed"):
        parse_arguments(_argv(data_prefix, zero_stage=3, ckpt_format=fmt), world_size=4, device_type="cpu")
    parse_arguments(_argv(data_prefix, fp16=True, zero_stage=1, ckpt_format="megatron_ru"), world_size=4,
                    device_type="cuda")


def test_fp16_on_cpu(data_prefix):
    assert "--fp16 needs a GPU" in _error(data_prefix, fp16=True)
    parse_arguments(_argv(data_prefix, fp16=True), world_size=4, device_type="cuda")


def test_sequence_parallel_with_tp_1_is_turned_off_as_megatron_does(data_prefix):
    """Was refused; Megatron-LM turns it off with a warning, and its scripts pass it at every TP."""
    args = parse_arguments(_argv(data_prefix, sequence_parallel=True), world_size=4, device_type="cpu")
    assert args.sequence_parallel is False
    assert args.notices == ["--sequence-parallel at --tensor-model-parallel-size 1 does nothing: turned off (as "
                            "Megatron does)"]


def test_heads_not_divisible_by_tp(data_prefix):
    msg = _error(data_prefix, num_attention_heads=6, hidden_size=48, tensor_model_parallel_size=4)
    assert "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)" in msg


def test_more_stages_than_layers(data_prefix):
    msg = _error(data_prefix, num_layers=3, pipeline_model_parallel_size=4)
    assert "--pipeline-model-parallel-size (4) exceeds --num-layers (3)" in msg
    # an uneven split is accepted: the stages take 2 and 1 layers, as reshard and import-hf lay them out
    a = parse_arguments(_argv(data_prefix, num_layers=3, pipeline_model_parallel_size=2), world_size=4,
                        device_type="cpu")
    assert a.pp == 2


def test_global_batch_not_divisible(data_prefix):
    msg = _error(data_prefix, global_batch_size=10, micro_batch_size=2)
    assert "--global-batch-size (10) must be divisible by --micro-batch-size (2) x data-parallel size (4" in msg


def test_world_not_divisible_by_tp_pp(data_prefix):
    msg = _error(data_prefix, world_size=6, tensor_model_parallel_size=4)
    assert "WORLD_SIZE=6 is not divisible by TP x PP = 4 x 1" in msg


def test_precision_length_and_lr_problems_listed_together(data_prefix):
    msg = _error(data_prefix, bf16=True, fp16=True, train_iters=None, lr_decay_style="cosine",
                 lr_warmup_iters=20, lr_decay_iters=10, min_lr=1.0)
    assert "--bf16 and --fp16 are exclusive" in msg
    assert "--train-iters N or --train-samples N" in msg
    assert "--min-lr (1.0) must not exceed --lr" in msg
    assert msg.startswith("invalid configuration (")  # one error listing every problem
    assert msg.count("\n  - ") >= 4


def test_lr_decay_shorter_than_warmup(data_prefix):
    msg = _error(data_prefix, lr_decay_style="linear", lr_warmup_iters=10)
    assert "must exceed the warmup (10)" in msg and "--lr-decay-iters" in msg


def test_seq_length_over_positions(data_prefix):
    assert "--seq-length (128) exceeds --max-position-embeddings (64)" in _error(data_prefix, seq_length=128)


def test_checkpoint_flag_dependencies(data_prefix):
    msg = _error(data_prefix, finetune=True, exit_signal_handler=True, save_interval=5)
    assert "--finetune loads weights from --load" in msg
    assert "--exit-signal-handler saves a checkpoint before exiting: add --save DIR" in msg
    assert "--save-interval needs a directory: add --save DIR" in msg


def test_deepspeed_config_must_agree_with_flags(data_prefix, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 2}}))
    msg = _error(data_prefix, deepspeed_config=str(cfg))
    assert "sets train_batch_size=16 but the flags give 8" in msg
    assert "has bf16.enabled=True but --bf16 is not set" in msg
    assert "zero_optimization.stage=2 but --zero-stage is 0" in msg
    assert "file not found" in _error(data_prefix, deepspeed_config=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{")
    assert "is not valid JSON" in _error(data_prefix, deepspeed_config=str(tmp_path / "bad.json"))


def test_freeze_flags_exclusive(data_prefix):
    msg = _error(data_prefix, **{"--train-only-embeddings": True, "--freeze": "decoder.*"})
    assert "--train-only-embeddings and --freeze are exclusive" in msg


def test_train_embedding_rows_new_needs_train_only_embeddings(data_prefix):
    msg = _error(data_prefix, **{"--train-embedding-rows": "new"})
    assert "--train-embedding-rows new trains part of the embedding and output rows: add --train-only-embeddings" \
        in msg


def test_seq_length_over_positions_with_rope(data_prefix):
    msg = _error(data_prefix, seq_length=128, position_embedding_type="rope")
    assert "--seq-length (128) exceeds --max-position-embeddings (64) with --position-embedding-type rope" in msg
    # rope without a declared maximum has nothing to compare against
    parse_arguments(_argv(data_prefix, seq_length=128, position_embedding_type="rope", max_position_embeddings=None),
                    world_size=4, device_type="cpu")


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-1", "-.5"])
def test_negative_numbers_are_values_and_reach_validation(data_prefix, value):
    """argparse took '-1e-3' for an option ('expected one argument'); now every flag reads it."""
    assert "--lr and --min-lr must be >= 0" in _error(data_prefix, lr=value)
    assert f"--init-method-std must be > 0, got {float(value)}" in _error(data_prefix, init_method_std=value)


def test_parse_returns_resolved_blend_split_and_layout(data_prefix, tmp_path):
    from megatron_ru.data.checks import DataBlend
    other = write_dataset(str(tmp_path / "other"), seed=1)
    a = parse_arguments(_argv(data_prefix, tensor_model_parallel_size=2, split="98,2,0"), world_size=8,
                        device_type="cpu")
    assert a.blend == DataBlend((data_prefix,), None)
    assert a.split == pytest.approx((0.98, 0.02, 0.0))
    assert (a.layout.world_size, a.layout.tp, a.layout.pp, a.layout.dp) == (8, 2, 1, 4) and a.dp == 4
    argv = _argv(data_prefix, tensor_model_parallel_size=2, sequence_parallel=True)
    argv[argv.index("--data-path") + 1:argv.index("--data-path") + 2] = ["0.7", data_prefix, "0.3", other]
    a = parse_arguments(argv, world_size=4, device_type="cpu")
    assert a.blend == DataBlend((data_prefix, other), (0.7, 0.3)) and a.sequence_parallel


def test_derived_values_are_exact_and_invalid_ones_are_refused_not_clamped(data_prefix, tmp_path):
    """dp/grad_accum/train_iters used to be max(1, ...): now validation refuses what would need it,
    and every rule copes with a layout that has no DP size (no ZeroDivisionError)."""
    a = parse_arguments(_argv(data_prefix, global_batch_size=24, micro_batch_size=3, train_iters=None,
                              train_samples=100), world_size=4, device_type="cpu")
    assert (a.dp, a.grad_accum, a.train_iters) == (4, 2, 4)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8}))
    msg = _error(data_prefix, world_size=2, tensor_model_parallel_size=4, deepspeed_config=str(ds))
    assert "WORLD_SIZE=2 is not divisible by TP x PP = 4 x 1" in msg
    assert "--train-samples (4) is smaller than one global batch (8)" in _error(
        data_prefix, train_iters=None, train_samples=4)
    assert "--micro-batch-size must be >= 1 (got 0)" in _error(data_prefix, micro_batch_size=0, deepspeed_config=str(ds))
