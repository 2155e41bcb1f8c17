"""Issue 9 §3/§4: a damaged checkpoint of a real 4-rank TP2 × PP2 run is refused before anything is
loaded, with one error (on every rank) naming the files and the fix; never another rank's weights.

One spawn of 4 gloo ranks: train 3 iterations and save, then for each fault rank 0 damages the real
files (delete / truncate / poison / rewrite), every rank tries to resume, and rank 0 repairs them.
"""
import json
import os
import shutil

import pytest

from tests.dist_utils import run_distributed
from tests.fixtures.filesystems import small_tmpfs
from tests.integration._train_helpers import make_corpus, tiny_argv

pytestmark = pytest.mark.slow

LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--hidden-dropout", "0.1"]


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _poison(path):
    import pickle
    import subprocess  # noqa: F401 - the payload names it

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", os.path.dirname(os.path.dirname(path)) + ".pwned"],))
    with open(path, "wb") as f:
        pickle.dump({"module": Evil()}, f, protocol=2)


def _old_metadata(ckpt_dir):
    """A checkpoint saved before metadata.json listed its files."""
    path = os.path.join(ckpt_dir, "metadata.json")
    meta = json.load(open(path))
    del meta["files"]
    json.dump(meta, open(path, "w"))


def _faults(ckpt, fmt):
    """name -> (damage function, extra flags of the resume), for a checkpoint in ``fmt``."""
    def rm(name):
        return lambda: os.remove(os.path.join(ckpt, name))
    # training's own format (by canonical name) / DeepSpeed's files (--ckpt-format deepspeed)
    optim, weights = (("optim_states-pp01-tp01-dp000.pt", "layer_01-model_01-model_states.pt") if fmt == "megatron_ru"
                      else ("mp_rank_03_model_states.pt", "mp_rank_01_model_states.pt"))
    return {
        "tp_shard_deleted": (rm("layer_04-model_01-model_states.pt"), []),
        "tp_shard_deleted_old_metadata": (
            lambda: (_old_metadata(ckpt), os.remove(os.path.join(ckpt, "layer_02-model_01-model_states.pt"))), []),
        "layer_truncated": (lambda: _truncate(os.path.join(ckpt, "layer_03-model_00-model_states.pt")), []),
        "model_file_deleted": (rm(optim), []),
        "model_file_poisoned": (lambda: _poison(os.path.join(ckpt, weights)), []),
        "rng_deleted": (rm("rng_rank_00003.pt"), []),
        "rng_deleted_no_load_rng": (rm("rng_rank_00003.pt"), ["--no-load-rng"]),
        "metadata_truncated": (lambda: _truncate(os.path.join(ckpt, "metadata.json")), []),
    }


def _body(rank, world_size, prefix, cache, root):
    import torch.distributed as dist

    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.checkpoint import CheckpointError
    from megatron_ru.training.pretrain import run

    out = {}
    for fmt in ("megatron_ru", "deepspeed"):
        save, backup = os.path.join(root, fmt, "ckpt"), os.path.join(root, fmt, "backup")

        def train(iters, extra):
            return run(parse_arguments(tiny_argv(prefix, cache, iters=iters,
                                                 extra=[*LAYOUT, "--ckpt-format", fmt, *extra]),
                                       world_size=world_size, device_type="cpu"))

        res = out[fmt] = {"first": train(3, ["--save", save]).losses}
        ckpt = os.path.join(save, "iter_0000003")
        if rank == 0:
            shutil.copytree(ckpt, backup)
        for name, (damage, extra) in _faults(ckpt, fmt).items():
            dist.barrier()
            if rank == 0:
                damage()
            dist.barrier()
            try:
                result = train(5, ["--load", save, *extra])
                res[name] = {"iteration": result.iteration, "losses": result.losses}
            except CheckpointError as e:
                res[name] = {"error": str(e)}
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
                shutil.copytree(backup, ckpt)
        # --finetune with a mistyped directory (the job scripts' INIT_CHECKPOINT) and with an empty one
        for name, load in (("finetune_typo", save + "_typo"), ("finetune_empty", backup + "_empty")):
            if rank == 0:
                os.makedirs(backup + "_empty", exist_ok=True)
            dist.barrier()
            try:
                train(5, ["--load", load, "--finetune"])
                res[name] = {"error": None}
            except CheckpointError as e:
                res[name] = {"error": str(e)}
        res["intact"] = train(5, ["--load", save]).losses  # the repaired checkpoint resumes
    return out


@pytest.mark.parametrize("fmt", ["megatron_ru", "deepspeed"])
def test_damaged_tp2_pp2_checkpoint_is_refused_with_the_files_named(tmp_path, fmt, request):
    """Both formats: training's own (by canonical name) and DeepSpeed's files (the legacy reader). One spawn
    serves both parameters (the second reads the first's results)."""
    cache_key = "damaged_tp2_pp2_results"
    if not hasattr(request.config, cache_key):
        prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
        setattr(request.config, cache_key, (str(tmp_path), run_distributed(
            _body, 4, args=(prefix, cache, str(tmp_path)), timeout=600, env={"DS_ACCELERATOR": "cpu"})))
    root, results = getattr(request.config, cache_key)
    save, backup = os.path.join(root, fmt, "ckpt"), os.path.join(root, fmt, "backup")
    ckpt = os.path.join(save, "iter_0000003")
    pointer = os.path.join(save, "latest_checkpointed_iteration.txt")
    for rank, out in enumerate(results):
        for name in ("tp_shard_deleted", "tp_shard_deleted_old_metadata", "layer_truncated", "model_file_deleted",
                     "model_file_poisoned", "rng_deleted", "metadata_truncated"):
            assert "error" in out[fmt][name], (rank, name, out[fmt][name])  # every rank refuses, none trains on
    r = results[0][fmt]
    assert r["tp_shard_deleted"]["error"] == (
        f"checkpoint {ckpt} is damaged, nothing was loaded: 1 file(s) missing: "
        f"layer_04-model_01-model_states.pt. To continue: restore the files from a copy of the checkpoint")
    assert "1 file(s) missing: layer_02-model_01-model_states.pt" in r["tp_shard_deleted_old_metadata"]["error"]
    assert "truncated or overwritten: layer_03-model_00-model_states.pt (" in r["layer_truncated"]["error"]
    if fmt == "megatron_ru":
        deleted = r["model_file_deleted"]["error"]
        assert "missing: optim_states-pp01-tp01-dp000.pt" in deleted and "pass --no-load-optim" in deleted
        poisoned = r["model_file_poisoned"]["error"]
        assert "truncated or overwritten: layer_01-model_01-model_states.pt" in poisoned
    else:
        assert "missing: mp_rank_03_model_states.pt" in r["model_file_deleted"]["error"]
        poisoned = r["model_file_poisoned"]["error"]
        assert "truncated or overwritten: mp_rank_01_model_states.pt" in poisoned
    assert "weights_only" not in poisoned
    assert not os.path.exists(save + ".pwned")
    rng = r["rng_deleted"]["error"]
    assert "missing: rng_rank_00003.pt" in rng and "pass --no-load-rng" in rng and "no longer bit-exact" in rng
    assert sorted(r["rng_deleted_no_load_rng"]["losses"]) == [4, 5]  # the user's choice: proceed
    meta_err = r["metadata_truncated"]["error"]
    assert meta_err.startswith(f"{os.path.join(ckpt, 'metadata.json')} is damaged (JSONDecodeError") and \
        pointer in meta_err
    assert r["finetune_typo"]["error"] == (
        f"--load {save}_typo does not exist: --finetune starts from the weights of a checkpoint, and there is "
        f"none. Point --load at a directory written by --save (it holds latest_checkpointed_iteration.txt)")
    assert r["finetune_empty"]["error"].startswith(f"--load {backup}_empty holds no latest_checkpointed_iteration"
                                                   f".txt (it is empty): --finetune")
    assert sorted(r["intact"]) == [4, 5]
    assert r["intact"] == {k: v for k, v in results[0]["megatron_ru"]["intact"].items()}  # both formats alike
    # the save recorded every file with its size; the layout-derived list (old checkpoints) agrees
    from megatron_ru.training.checkpoint import CheckpointMeta
    from megatron_ru.checkpointing.files import list_files
    meta = CheckpointMeta.read(os.path.join(backup))
    assert meta.files == list_files(backup) and len(meta.files) == 7 * 2 + 4 + 4
    files, meta.files = meta.files, None
    assert sorted(meta.expected_files(sorted(files))) == sorted(files)


def _disk_full_body(rank, world_size, prefix, cache, save):
    import torch.distributed as dist

    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.training.checkpoint import CheckpointSaveError
    from megatron_ru.training.pretrain import run

    def train(iters, extra):
        argv = tiny_argv(prefix, cache, iters=iters, extra=["--zero-stage", "1", "--save", save, *extra])
        return run(parse_arguments(argv, world_size=world_size, device_type="cpu"))

    train(3, [])
    dist.barrier()
    if rank == 0:  # leave room for about half a checkpoint
        size = sum(os.path.getsize(os.path.join(save, "iter_0000003", n)) for n in
                   os.listdir(os.path.join(save, "iter_0000003")))
        st = os.statvfs(save)
        with open(os.path.join(save, "filler"), "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - size // 2))
    dist.barrier()
    try:
        train(5, ["--load", save])
        return None
    except CheckpointSaveError as e:
        return str(e)


def test_disk_full_during_a_2_rank_save_ends_on_every_rank_and_keeps_the_previous(tmp_path):
    """Both ranks give up the save together (no rank waits in a collective for one that failed)."""
    from megatron_ru.training.checkpoint import list_iterations, read_latest_iteration
    with small_tmpfs(tmp_path / "small_fs", "8m") as mnt:
        prefix, cache, save = make_corpus(str(tmp_path)), str(tmp_path / "cache"), os.path.join(mnt, "ckpt")
        errors = run_distributed(_disk_full_body, 2, args=(prefix, cache, save), timeout=300,
                                 env={"DS_ACCELERATOR": "cpu"})
        for msg in errors:
            assert msg is not None and msg.startswith(f"no space left on tmpfs (mounted at {mnt} ("), msg
            assert f"while writing {save}/iter_0000005/" in msg
            assert f"iteration 3 ({save}/iter_0000003) is still the current checkpoint" in msg
        assert read_latest_iteration(save) == 3 and list_iterations(save) == [3]
