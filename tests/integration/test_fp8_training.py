"""``--fp8-format`` / ``--fp8-recipe`` through pretrain_gpt.py's own run(): torchao's float8 matmuls in the
transformer layers of the tiny model of the tests, on CPU (torch's float8 GEMM where this torch has one, else
torchao's emulation; the casts and scales are the GPU's).

* 20 iterations in FP8 (hybrid, tensorwise; and e4m3 rowwise) stay within a derived tolerance of the same 20
  in bf16, and learn as bf16 does; they differ from bf16 (the conversion took effect).
* TP 2 with sequence parallelism, and CP 2, in FP8 train as one process in FP8 does (fp32 runs; the sharded
  operands are scaled by the whole tensor's amax, so the same inputs quantize to the same values: iteration 1
  equal to 1e-5, exactly so at the linear in tests/distributed/test_fp8_layouts.py; the comment in the test says
  why later iterations drift by FP8's rounding).
* The checkpoint format is unchanged: an FP8 run's checkpoint holds the same tensors as a bf16 run's and
  continues without FP8, and a bf16 checkpoint continues in FP8.
* The flags' rules: Megatron-DeepSpeed's --fp8-hybrid spelling, --fp8-recipe delayed, --fp16, rowwise under TP
  or CP, LoRA.

Tolerance: an e4m3 operand carries a relative rounding error of at most u = 2^-4 (3 mantissa bits), so each
FP8 product's terms are off by at most 2u relative to bf16's (two rounded operands); the loss, a smooth function
of the layers' outputs, is held to that bound per iteration: |loss_fp8 - loss_bf16| <= 2u * loss_bf16.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, relative_diff, tiny_argv, train_body

pytestmark = pytest.mark.slow

U_E4M3 = 2.0 ** -4
FP32_RTOL = 1e-5  # what every fp32 layout test holds (test_train_layouts.py)
ITERS = 20
ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    return str(d), make_corpus(str(d))


def _argv(corpus, name: str, *extra: str, iters: int = ITERS) -> list[str]:
    d, prefix = corpus
    return tiny_argv(prefix, os.path.join(d, "cache"), iters=iters, extra=extra)


def test_fp8_stays_within_the_derived_tolerance_of_bf16_and_learns(corpus) -> None:
    runs = [_argv(corpus, "bf16", "--bf16"),
            _argv(corpus, "fp8", "--bf16", "--fp8-format", "hybrid"),
            _argv(corpus, "fp8-rowwise", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise")]
    bf16, fp8, rowwise = run_distributed(train_body, 1, args=(runs,), timeout=600, env=ENV)[0]
    for name, run in (("hybrid tensorwise", fp8), ("e4m3 rowwise", rowwise)):
        assert sorted(run["losses"]) == sorted(bf16["losses"]) == list(range(1, ITERS + 1))
        diffs = {i: abs(run["losses"][i] - bf16["losses"][i]) / bf16["losses"][i] for i in bf16["losses"]}
        assert max(diffs.values()) <= 2 * U_E4M3, (name, diffs)
        # the conversion took effect: FP8 is not bf16
        assert any(run["losses"][i] != bf16["losses"][i] for i in bf16["losses"]), name
        # and it learns as bf16 does: at least 3/4 of bf16's drop over the 20 iterations
        drop = bf16["losses"][1] - bf16["losses"][ITERS]
        assert drop > 0.5, bf16["losses"]
        assert run["losses"][1] - run["losses"][ITERS] >= 0.75 * drop, (name, run["losses"], bf16["losses"])


def test_fp8_at_tp2_with_sequence_parallelism_and_at_cp2_equals_one_process(corpus) -> None:
    """fp32, so that only FP8 rounds: the whole tensor's scale on every shard (TP: weights and the split
    activations; CP: the tokens) gives one process's FP8 values."""
    fp8 = ("--fp8-format", "hybrid")
    one, plain = run_distributed(train_body, 1, args=([_argv(corpus, "tp1", *fp8, iters=6),
                                                       _argv(corpus, "fp32", iters=6)],), timeout=600, env=ENV)[0]
    layouts = run_distributed(train_body, 2, args=([
        _argv(corpus, "tp2", *fp8, "--tensor-model-parallel-size", "2", "--sequence-parallel", iters=6),
        _argv(corpus, "cp2", *fp8, "--context-parallel-size", "2", iters=6)],), timeout=600, env=ENV)
    # Iteration 1: the same inputs quantize to the same FP8 values on every layout (exactly so at the linear:
    # tests/distributed/test_fp8_layouts.py), so loss and gradient norm equal one process's to fp32 summation
    # order. Later iterations: a layout's other sums (attention's ring merge, the all-reduces) differ from one
    # process's by fp32 rounding and move the few values that lie that close to an FP8 rounding boundary across
    # it, each by up to its format's spacing (e5m2 gradients: 2^-2), so the curves drift apart by FP8's own
    # rounding: the loss is held to the bound FP8 is held to against bf16 (2 x 2^-4).
    for rank, runs in enumerate(layouts):
        for name, res in zip(("tp2+sp", "cp2"), runs):
            for key in ("losses", "grad_norms"):
                assert abs(res[key][1] - one[key][1]) <= FP32_RTOL * abs(one[key][1]), (name, rank, key)
            assert relative_diff(res["losses"], one["losses"]) <= 2 * U_E4M3, (name, rank, res["losses"],
                                                                                one["losses"])
    # and FP8 moved the fp32 run, from iteration 1 on, by far more than fp32 rounding
    assert abs(one["losses"][1] - plain["losses"][1]) > 3 * FP32_RTOL * plain["losses"][1]


def _tensors(save: str) -> dict[str, tuple]:
    """Every tensor of the latest checkpoint in ``save``: file-relative name -> (dtype, shape)."""
    out = {}
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        step = f.read().strip()
    root = os.path.join(save, f"iter_{int(step):07d}")
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.endswith((".pt", ".bin")):
                continue
            obj = torch.load(path, map_location="cpu", weights_only=False)

            def walk(prefix, o):
                if isinstance(o, torch.Tensor):
                    out[prefix] = (o.dtype, tuple(o.shape))
                elif isinstance(o, dict):
                    for k, v in o.items():
                        walk(f"{prefix}/{k}", v)
                elif isinstance(o, (list, tuple)):
                    for i, v in enumerate(o):
                        walk(f"{prefix}/{i}", v)
            walk(os.path.relpath(path, root), obj)
    return out


def test_checkpoints_are_unchanged_and_continue_either_way(corpus, tmp_path) -> None:
    fp8, saves = ("--fp8-format", "hybrid"), {k: str(tmp_path / k) for k in ("fp8", "bf16")}
    runs = [_argv(corpus, "fp8", "--bf16", *fp8, "--save", saves["fp8"], "--save-interval", "4", iters=4),
            _argv(corpus, "bf16", "--bf16", "--save", saves["bf16"], "--save-interval", "4", iters=4),
            # each continues in the other precision
            _argv(corpus, "fp8->bf16", "--bf16", "--load", saves["fp8"], iters=6),
            _argv(corpus, "bf16->fp8", "--bf16", *fp8, "--load", saves["bf16"], iters=6),
            # and in its own: the reference for the continued iterations
            _argv(corpus, "fp8->fp8", "--bf16", *fp8, "--load", saves["fp8"], iters=6),
            _argv(corpus, "bf16->bf16", "--bf16", "--load", saves["bf16"], iters=6)]
    res = run_distributed(train_body, 1, args=(runs,), timeout=600, env=ENV)[0]
    a, b = _tensors(saves["fp8"]), _tensors(saves["bf16"])
    assert a and a == b  # the same files, tensors, dtypes and shapes
    fp8_to_bf16, bf16_to_fp8, fp8_to_fp8, bf16_to_bf16 = res[2:]
    for run in res[2:]:
        assert sorted(run["losses"]) == [5, 6] and run["iteration"] == 6
    # continuing from the same weights, the first continued step differs only by the matmuls' precision
    for x, y in ((fp8_to_bf16, fp8_to_fp8), (bf16_to_fp8, bf16_to_bf16)):
        assert abs(x["losses"][5] - y["losses"][5]) <= 2 * U_E4M3 * y["losses"][5]
        assert x["losses"][5] != y["losses"][5]
    # the bf16 continuation of the FP8 checkpoint starts where FP8 left off, not from the bf16 run's weights
    assert fp8_to_bf16["losses"][5] != bf16_to_bf16["losses"][5]


@pytest.mark.parametrize("extra, message", [
    (("--fp8-format", "hybrid", "--fp8-recipe", "delayed"), "--fp8-recipe delayed is TransformerEngine's scaling"),
    (("--fp8-hybrid", "--fp8-recipe", "delayed"), "--fp8-recipe delayed is TransformerEngine's scaling"),
    (("--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--tensor-model-parallel-size", "2"),
     "--fp8-recipe rowwise scales along the contraction dimension, which tensor parallelism (2) splits"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--context-parallel-size", "2"),
     "--fp8-recipe rowwise scales the weight gradient's operands along the tokens, which context parallelism (2)"),
    (("--fp8-format", "hybrid", "--lora-rank", "4"), "--fp8-format with --lora-rank"),
    (("--fp8-format", "hybrid", "--fp16"), "--fp8-format with --fp16"),
    (("--fp8-e4m3", "--fp8-format", "hybrid"), "--fp8-e4m3 means --fp8-format e4m3, but --fp8-format hybrid is given"),
])
def test_fp8_rules(corpus, extra, message) -> None:
    from megatron_ru.flags.arguments import parse_arguments
    with pytest.raises(ValueError) as e:
        parse_arguments(_argv(corpus, "rules", *extra), world_size=2, device_type="cpu")
    assert message in str(e.value), str(e.value)


def test_fp8_spellings(corpus) -> None:
    from megatron_ru.flags.arguments import parse_arguments
    for flag, fmt in (("--fp8-hybrid", "hybrid"), ("--fp8-e4m3", "e4m3")):
        args = parse_arguments(_argv(corpus, "spelling", "--bf16", flag), world_size=1, device_type="cpu")
        assert (args.training.fp8_format, args.training.fp8_recipe) == (fmt, "tensorwise")
