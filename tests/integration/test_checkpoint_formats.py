"""Training's checkpoint format (tensors and each rank's optimizer fragments by canonical name) holds exactly
the state DeepSpeed's own files hold: the same run saved both ways, read back by the offline reader, tensor by
tensor — weights, fp32 masters, both Adam moments (of both optimizer groups: DeepSpeed's ZeRO 1/2 links the
moments of groups after the first to nothing, so they must be read from the optimizer's state), the step,
the LR schedule and the loss scaler. ZeRO 1 over two data-parallel ranks (fragments joined), in fp32 and
bf16 (fp32 masters apart from the weights), ZeRO 0 at TP 2 with a frozen layer (no optimizer state for it).
(ZeRO 2's files are DeepSpeed's own to read; its exact resume is in test_train_resume.py.)"""
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv

pytestmark = pytest.mark.slow

RUNS = {"zero1": ["--zero-stage", "1"],
        "zero1_bf16": ["--zero-stage", "1", "--bf16"],
        "tp2_zero0_frozen": ["--tensor-model-parallel-size", "2", "--freeze", "decoder.layers.1.*"]}


def _body(rank, world_size, tmp):
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.pretrain import run
    prefix, cache = make_corpus(tmp), os.path.join(tmp, "cache")
    for name, flags in RUNS.items():
        for fmt in ("megatron_ru", "deepspeed"):
            argv = tiny_argv(prefix, cache, iters=3, extra=[*flags, "--eval-iters", "0", "--ckpt-format", fmt,
                                                           "--save", os.path.join(tmp, f"{name}_{fmt}")])
            run(parse_arguments(argv, world_size=world_size, device_type="cpu"))


def test_layer_format_holds_what_deepspeeds_files_hold(tmp_path):
    from megatron_ru.checkpointing import read_checkpoint
    run_distributed(_body, 2, args=(str(tmp_path),), timeout=600, env={"DS_ACCELERATOR": "cpu"})
    for name in RUNS:
        ours, ds = read_checkpoint(str(tmp_path / f"{name}_megatron_ru")), read_checkpoint(str(tmp_path / f"{name}_deepspeed"))
        assert ours.meta.format == "megatron_ru.layers" and ds.meta.format is None
        assert ours.meta.optimizer_fragments == (1 if name.startswith("tp2") else 2)
        frozen = [n for n in ours.names() if n.startswith("decoder.layers.1.")] if name.startswith("tp2") else []
        for n in ours.names():
            assert torch.equal(ours.get(n), ds.get(n)), (name, n)
            a, b = ours.optimizer_state(n), ds.optimizer_state(n)
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a[key], b[key]), (name, n, key)
            if n in frozen:
                assert not a["exp_avg"].any(), (name, n)
            elif n.endswith("layernorm.weight"):  # the second optimizer group (no weight decay) was trained
                assert a["exp_avg"].abs().sum() > 0, (name, n)
        if name == "zero1_bf16":  # the masters are not the bf16 weights
            n = "decoder.layers.0.mlp.linear_fc1.weight"
            assert not torch.equal(ours.optimizer_state(n)["fp32"], ours.get(n).float())
        ca, cb = ours.common_state(), ds.common_state()
        for key in ("step", "lr_scheduler", "loss_scaler", "global_steps", "skipped_steps"):
            assert ca[key] == cb[key], (name, key)
