"""Acceptance 4: train 6 iterations at (TP, PP, DP) = (2, 2, 1), reshard to (1, 2, 2) and (2, 1, 2), train 6
more: the losses equal 12 uninterrupted iterations (fp32, ZeRO 1) — the optimizer state came along. The
same without the reshard: a plain --load of the DeepSpeed checkpoint at (1, 2, 2) ZeRO 1, (2, 1, 2) ZeRO 2
and (1, 1, 4) ZeRO 0, and of a resharded checkpoint at another layout than its own. Also
continuing under ZeRO 2 and ZeRO 0, and a DP 4 checkpoint at DP 2 without a reshard; a weights-only load
sets the fp32 masters; and reshard rounds of ZeRO 0 fp32 (tied, PP 1 -> 2), ZeRO 1 bf16 (a frozen layer,
TP 2 x PP 2 -> DP 4) and ZeRO 1 with alignment padding whose loaded state, saved again by DeepSpeed at
the new layout, equals the source tensor by tensor. One 4-rank spawn (plus a 2-rank one) for all."""
import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import TINY_MODEL_FLAGS, make_corpus, relative_diff, tiny_argv, without_flags

pytestmark = pytest.mark.slow

LAYOUTS = {(2, 2, 1): ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           (1, 2, 2): ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"],
           (2, 1, 2): ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"],
           (1, 1, 4): ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]}


#: continuations at another layout equal the uninterrupted run to this relative difference (measured: <= 9e-8;
#: float32 sums in another order)
TOL = 5e-7


def _train(argv, world_size):
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.pretrain import run
    return run(parse_arguments(argv, world_size=world_size, device_type="cpu"))


def _reshard(rank, load, save, tp, pp):
    import torch.distributed as dist

    from megatron_ru.checkpointing import reshard
    if rank == 0:
        reshard.main(["--load", load, "--save", save, "--target-tensor-parallel-size", str(tp),
                      "--target-pipeline-parallel-size", str(pp)])
    dist.barrier()


def _body(rank, world_size, tmp):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    prefix, cache = make_corpus(tmp), os.path.join(tmp, "cache")

    def argv(layout, iters, *extra):
        out = tiny_argv(prefix, cache, iters=iters, extra=[*LAYOUTS[layout], "--eval-iters", "0"])
        out = without_flags(out, *[f for f in extra if f.startswith("--")]) + list(extra)  # extra overrides
        return without_flags(out, "--untie-embeddings-and-output-weights", "--tied") if "--tied" in extra else out

    out = {}
    # acceptance 4 (ZeRO 1, fp32)
    z1 = ["--zero-stage", "1"]
    out["full"] = _train(argv((2, 2, 1), 12, *z1), world_size).losses
    src = os.path.join(tmp, "z1")
    out["first"] = _train(argv((2, 2, 1), 12, *z1, "--save", src, "--exit-interval", "6"), world_size).losses
    # a plain --load at another TP/PP/DP and ZeRO stage: no conversion step
    for layout, stage in (((1, 2, 2), "1"), ((2, 1, 2), "2"), ((1, 1, 4), "0")):
        out[("direct", *layout)] = _train(argv(layout, 12, "--zero-stage", stage, "--load", src), world_size).losses
    # DeepSpeed's own files (--ckpt-format deepspeed; what training wrote before the layer format): the same
    # run continues from them at another layout through the legacy reader
    legacy = os.path.join(tmp, "z1_ds")
    _train(argv((2, 2, 1), 12, *z1, "--save", legacy, "--exit-interval", "6", "--ckpt-format", "deepspeed"),
           world_size)
    out["legacy"] = _train(argv((1, 1, 4), 12, "--zero-stage", "2", "--load", legacy), world_size).losses
    for layout in ((1, 2, 2), (2, 1, 2)):
        dst = os.path.join(tmp, "z1_%d%d%d" % layout)
        _reshard(rank, src, dst, layout[0], layout[1])
        resume = argv(layout, 12, *z1, "--load", dst)
        if layout == (1, 2, 2):  # the model flags from the resharded checkpoint's metadata
            resume = without_flags(resume, *TINY_MODEL_FLAGS) + ["--use-checkpoint-args"]
        out[layout] = _train(resume, world_size).losses
    # the resharded checkpoint continues under ZeRO 2 as well (DeepSpeed's same fragment mapping)
    out["zero2"] = _train(argv((2, 1, 2), 12, "--zero-stage", "2", "--load", os.path.join(tmp, "z1_212")),
                          world_size).losses
    # no reshard needed for another ZeRO stage (1 -> 0) or DP size (4 here -> 2 in _dp2_body) at the same TP/PP
    out["zero0"] = _train(argv((2, 2, 1), 12, "--zero-stage", "0", "--load", os.path.join(tmp, "z1")),
                          world_size).losses
    _train(argv((1, 1, 4), 12, *z1, "--save", os.path.join(tmp, "dp4"), "--exit-interval", "6"), world_size)
    # weights only (--no-load-optim) under ZeRO 1: the fp32 masters must be the loaded weights; saved at
    # once (no step) to be compared offline
    _train(argv((2, 1, 2), 6, *z1, "--load", os.path.join(tmp, "z1_212"), "--no-load-optim", "--save",
                os.path.join(tmp, "weights_only")), world_size)
    # one round each of ZeRO 0 fp32 (PP 1 -> 2) and ZeRO 1 bf16 (TP 2 x PP 2 -> DP 4): load the resharded
    # checkpoint, save it again at once (no step) through DeepSpeed, compare with the source offline
    # (ZeRO 0 with tied embeddings: at PP 2 both end stages hold the word embeddings; bf16 with a frozen
    # layer: no optimizer state for it, zero moments after the reshard)
    # and ZeRO 1 over 4 ranks with a group that needs alignment padding (9 norms x 52 values = 468, not a
    # multiple of 8): the partitions are cut and joined where DeepSpeed put them
    padded = ["--zero-stage", "1", "--hidden-size", "52", "--num-attention-heads", "2", "--num-query-groups", "2",
              "--ffn-hidden-size", "44"]
    rounds = {"z0": ((2, 1, 2), (1, 2, 2), ["--zero-stage", "0", "--tied"]),
              "pad": ((1, 1, 4), (1, 1, 4), [*padded, "--ckpt-format", "deepspeed"]),
              "bf16": ((2, 2, 1), (1, 1, 4), ["--zero-stage", "1", "--bf16", "--freeze", "decoder.layers.1.*"])}
    for name, (a, b, flags) in rounds.items():
        src, mid, back = (os.path.join(tmp, name + s) for s in ("_src", "_mid", "_back"))
        _train(argv(a, 3, *flags, "--save", src), world_size)
        _reshard(rank, src, mid, b[0], b[1])
        _train(argv(b, 3, *without_flags(flags, "--ckpt-format"), "--load", mid, "--save", back), world_size)
    # a resharded checkpoint (layer format) at another layout than its own loads as well
    out["layers_other_layout"] = _train(argv((2, 2, 1), 12, *z1, "--load", os.path.join(tmp, "z1_122")),
                                        world_size).losses
    return out


def _dp2_body(rank, world_size, tmp):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    prefix, cache = make_corpus(tmp), os.path.join(tmp, "cache")
    return _train(tiny_argv(prefix, cache, iters=12, extra=["--zero-stage", "1", "--eval-iters", "0", "--load",
                                                            os.path.join(tmp, "dp4")]), world_size).losses


def _same_checkpoints(a, b):
    from megatron_ru.checkpointing import read_checkpoint
    ra, rb = read_checkpoint(a), read_checkpoint(b)
    assert ra.names() == rb.names()
    for name in ra.names():
        assert torch.equal(ra.get(name), rb.get(name)), name
        sa, sb = ra.optimizer_state(name), rb.optimizer_state(name)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (name, key)
    ca, cb = ra.common_state(), rb.common_state()
    for key in ("step", "lr_scheduler", "loss_scaler"):
        assert ca[key] == cb[key], key
    assert ra.meta.consumed_train_samples == rb.meta.consumed_train_samples
    assert ra.meta.iteration == rb.meta.iteration


def test_reshard_resumes_training_exactly(tmp_path):
    out = run_distributed(_body, 4, args=(str(tmp_path),), timeout=900, env={"DS_ACCELERATOR": "cpu"})[0]
    full = out["full"]
    assert sorted(out["first"]) == list(range(1, 7))
    assert [out["first"][k] for k in range(1, 7)] == [full[k] for k in range(1, 7)]
    for layout in ((1, 2, 2), (2, 1, 2)):
        assert sorted(out[layout]) == list(range(7, 13)), layout
        assert relative_diff(out[layout], {k: full[k] for k in range(7, 13)}) <= TOL, layout
    for layout in ((1, 2, 2), (2, 1, 2), (1, 1, 4)):  # plain --load at another layout, ZeRO 1, 2 and 0
        assert sorted(out[("direct", *layout)]) == list(range(7, 13)), layout
        assert relative_diff(out[("direct", *layout)], {k: full[k] for k in range(7, 13)}) <= TOL, layout
    assert relative_diff(out["legacy"], {k: full[k] for k in range(7, 13)}) <= TOL
    assert relative_diff(out["layers_other_layout"], {k: full[k] for k in range(7, 13)}) <= TOL
    assert relative_diff(out["zero0"], {k: full[k] for k in range(7, 13)}) <= TOL
    assert relative_diff(out["zero2"], {k: full[k] for k in range(7, 13)}) <= TOL
    dp2 = run_distributed(_dp2_body, 2, args=(str(tmp_path),), timeout=600, env={"DS_ACCELERATOR": "cpu"})[0]
    assert relative_diff(dp2, {k: full[k] for k in range(7, 13)}) <= TOL
    from megatron_ru.checkpointing import read_checkpoint
    src, wo = read_checkpoint(str(tmp_path / "z1")), read_checkpoint(str(tmp_path / "weights_only"))
    assert wo.meta.iteration == 6 and wo.meta.data_parallel_size == 2
    for name in src.names():
        assert torch.equal(wo.optimizer_state(name)["fp32"], src.get(name)), name
        assert torch.equal(wo.get(name), src.get(name)), name
    _bad_inputs(tmp_path, "z1", "optim_states-pp01-tp01-dp000.pt")
    _bad_inputs(tmp_path, "z1_ds", "zero_pp_rank_0_mp_rank_03_optim_states.pt")
    for name in ("z0", "bf16", "pad"):
        # the save at the new layout (each rank's fragments) holds exactly the state of the source layout
        _same_checkpoints(str(tmp_path / f"{name}_src"), str(tmp_path / f"{name}_back"))
        assert read_meta(tmp_path / f"{name}_back").data_parallel_size > 1
    from megatron_ru.checkpointing.files import safe_load
    last = safe_load(str(tmp_path / "pad_src" / "iter_0000003" / "zero_pp_rank_3_mp_rank_00_optim_states.pt"))
    assert last["optimizer_state_dict"]["group_paddings"][1] > 0
    pad = read_checkpoint(str(tmp_path / "pad_src"))
    for name in pad.names():  # fp32 run: the masters are the weights, wherever the partitions split them
        assert torch.equal(pad.optimizer_state(name)["fp32"], pad.get(name)), name


def _bad_inputs(tmp_path, source, optim_file):
    """A real TP 2 x PP 2 ZeRO 1 checkpoint (``source``: training's layer format, or DeepSpeed's files) damaged
    three ways (an optimizer file truncated, a TP shard missing, a tensor of the wrong shape): reshard names the
    file or the tensor and leaves nothing behind."""
    import shutil

    from megatron_ru.checkpointing import reshard
    from megatron_ru.checkpointing.files import safe_load
    src, out = tmp_path / f"bad_{source}", tmp_path / f"bad_{source}_out"
    shutil.copytree(tmp_path / source, src)
    ckpt = src / "iter_0000006"

    def fails(match):
        with pytest.raises(ValueError, match=match):
            reshard.main(["--load", str(src), "--save", str(out), "--target-tensor-parallel-size", "1",
                          "--target-pipeline-parallel-size", "1"])
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(out.name)]

    optim = ckpt / optim_file
    data = optim.read_bytes()
    optim.write_bytes(data[:1000])
    fails(rf"1 file\(s\) truncated or overwritten: {optim_file} \(1000 bytes")
    optim.write_bytes(data)
    (ckpt / "layer_02-model_01-model_states.pt").unlink()
    fails(r"1 file\(s\) missing: layer_02-model_01-model_states.pt")
    shutil.copy(ckpt / "layer_02-model_00-model_states.pt", ckpt / "layer_02-model_01-model_states.pt")
    layer = safe_load(str(ckpt / "layer_03-model_00-model_states.pt"))
    layer["mlp.linear_fc1.weight"] = layer["mlp.linear_fc1.weight"][:10]
    torch.save(layer, ckpt / "layer_03-model_00-model_states.pt")
    meta = json.loads((ckpt / "metadata.json").read_text())
    for name in ("layer_02-model_01-model_states.pt", "layer_03-model_00-model_states.pt"):
        meta["files"][name] = (ckpt / name).stat().st_size
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    fails(r"layer_03-model_00-model_states.pt: 'mlp.linear_fc1.weight' has shape \[10, 64\], expected \[128, 64\]")


def read_meta(path):
    from megatron_ru.checkpointing import read_checkpoint
    return read_checkpoint(str(path)).meta
