"""Checkpoint directory logic, atomic pointer, weights-only loading, crash during a save."""
import errno
import glob
import json
import os
import pickle
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_ru.training import checkpoint as ckpt
from tests.fixtures.filesystems import small_tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _meta(it, tp=1, pp=1, dp=1, zero=0):
    return ckpt.CheckpointMeta(iteration=it, consumed_train_samples=8 * it, consumed_valid_samples=0,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               data_parallel_size=dp, zero_stage=zero, args={"x": 1})


def test_pointer_is_written_atomically_and_parsed(tmp_path):
    d = str(tmp_path)
    assert ckpt.read_latest_iteration(d) is None
    ckpt.write_text_atomic(os.path.join(d, ckpt.TRACKER_FILE), "10\n")
    assert ckpt.read_latest_iteration(d) == 10
    assert os.listdir(d) == [ckpt.TRACKER_FILE]  # no temporary file left behind
    open(os.path.join(d, ckpt.TRACKER_FILE), "w").write("garbage")
    with pytest.raises(ValueError, match="should hold an iteration number, found 'garbage'"):
        ckpt.read_latest_iteration(d)
    open(os.path.join(d, ckpt.TRACKER_FILE), "w").write("release")
    with pytest.raises(ValueError, match="Megatron-LM release checkpoint"):
        ckpt.read_latest_iteration(d)


def test_keep_last_prunes_oldest(tmp_path):
    for it in (2, 4, 6, 8):
        os.makedirs(tmp_path / ckpt.iteration_dir_name(it))
    assert ckpt.iteration_dir_name(8) == "iter_0000008"
    assert ckpt.prune_checkpoints(str(tmp_path), 2, 8) == [2, 4]
    assert ckpt.list_iterations(str(tmp_path)) == [6, 8]


def test_missing_checkpoint_is_an_error_unless_load_is_also_save(tmp_path):
    """Was: --finetune --load TYPO trained from random weights, exit 0."""
    kw = dict(zero_stage=0, load_optim=True)
    save = str(tmp_path / "run")
    # resume-or-start: --load DIR --save DIR with nothing there yet
    assert ckpt.load_checkpoint(None, save, finetune=False, save_dir=save, **kw) is None
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(None, str(tmp_path / "init"), finetune=False, save_dir=save, **kw)
    assert str(e.value) == (
        f"--load {tmp_path / 'init'} does not exist: --load names a checkpoint to start from and is not the --save "
        f"directory, and there is none. Point --load at a directory written by --save (it holds "
        f"latest_checkpointed_iteration.txt), pass the same directory to --save and --load to resume-or-start, or "
        f"drop --load to start from scratch")
    os.makedirs(tmp_path / "run" / "iter_0000004")
    with pytest.raises(ckpt.CheckpointError, match="holds iter_. directories but no latest_checkpointed_iteration"
                                                   ".txt .no save there completed.: --finetune starts"):
        ckpt.load_checkpoint(None, save, finetune=True, save_dir=save, **kw)
    ckpt.write_text_atomic(os.path.join(save, ckpt.TRACKER_FILE), "8\n")
    with pytest.raises(ckpt.CheckpointError, match="latest_checkpointed_iteration.txt says 8, but .*iter_0000008 does "
                                                   "not exist; there is no complete checkpoint there"):
        ckpt.load_checkpoint(None, save, finetune=False, save_dir=save, **kw)


def test_weights_only_with_zero3_is_refused_up_front(tmp_path):
    """Was ``ValueError: Unable to find 'latest' file`` from inside DeepSpeed."""
    save = str(tmp_path / "run")
    os.makedirs(os.path.join(save, "iter_0000004"))
    ckpt.write_text_atomic(os.path.join(save, "iter_0000004", ckpt.METADATA_FILE),
                           json.dumps(_meta(4, dp=2, zero=3).__dict__))
    ckpt.write_text_atomic(os.path.join(save, ckpt.TRACKER_FILE), "4\n")
    for zero, flags in ((3, dict(finetune=True, load_optim=True)), (1, dict(finetune=False, load_optim=False))):
        with pytest.raises(ckpt.CheckpointError, match=r"with ZeRO stage 3 \(the checkpoint's stage 3, this run's "
                                                       rf"{zero}\) is not supported.*resume the full state"):
            ckpt.load_checkpoint(None, save, SimpleNamespace(rank=0, tp_size=1, pp_size=1, dp_size=2), zero_stage=zero,
                                 **flags)


def test_file_check_lists_every_problem_and_the_fix(tmp_path):
    d = tmp_path / "iter_0000006"
    d.mkdir()
    for name, size in {"mp_rank_00_model_states.pt": 10, "rng_rank_00000.pt": 5, "rng_rank_00001.pt": 5}.items():
        (d / name).write_bytes(b"x" * size)
    (d / "rng_rank_00001.pt").write_bytes(b"x" * 3)
    expected = {"mp_rank_00_model_states.pt": 10, "rng_rank_00000.pt": 5, "rng_rank_00001.pt": 5,
                "rng_rank_00002.pt": 5, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 7}
    check = dict(pointer="P", earlier=[2, 4])
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.check_files(str(d), expected, kinds={"model", "rng"}, **check)
    assert str(e.value) == (
        f"checkpoint {d} is damaged, nothing was loaded: 1 file(s) missing: rng_rank_00002.pt; 1 file(s) truncated "
        f"or overwritten: rng_rank_00001.pt (3 bytes, saved as 5). To continue: restore the files from a copy of the "
        f"checkpoint; or resume from an earlier checkpoint by writing its iteration (2, 4 exist) into P; or pass "
        f"--no-load-rng to resume with fresh random states (the resumed run is then no longer bit-exact with an "
        f"uninterrupted run when dropout is on)")
    ckpt.check_files(str(d), expected, kinds={"model"}, **check)  # weights only, fresh RNG: nothing missing
    with pytest.raises(ckpt.CheckpointError, match="missing: zero_pp_rank_0_mp_rank_00_optim_states.pt.*"
                                                   "pass --no-load-optim"):
        ckpt.check_files(str(d), expected, kinds={"model", "optim"}, **check)


def test_layout_mismatch_messages():
    # another TP/PP is not a problem here: it is loaded by canonical names (training/checkpoint.py)
    assert ckpt.zero_partition_problems(_meta(4, tp=2, pp=1), dp=2, zero_stage=0, load_optim=False) == []
    msg = ckpt.zero_partition_problems(_meta(4, dp=2, zero=2), dp=4, zero_stage=2, load_optim=True,
                               load_dir="/ck")
    assert len(msg) == 1 and "--no-load-optim" in msg[0] and "ZeRO stage 2 over 2" in msg[0]
    assert "re-partitioned by name only from ZeRO stage 0 or 1 checkpoints" in msg[0]
    assert ckpt.zero_partition_problems(_meta(4, dp=2, zero=1), dp=4, zero_stage=1, load_optim=False) == []
    assert ckpt.zero_partition_problems(_meta(4, dp=2, zero=0), dp=4, zero_stage=0, load_optim=True) == []


def test_missing_metadata_is_a_clear_error(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="not a complete megatron_ru checkpoint"):
        ckpt.CheckpointMeta.read(str(tmp_path))


def test_damaged_metadata_names_the_file(tmp_path):
    """Was a bare JSONDecodeError."""
    path = tmp_path / "iter_0000004" / ckpt.METADATA_FILE
    path.parent.mkdir()
    path.write_text('{"iteration": 4, "consumed_tr')
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.CheckpointMeta.read(str(path.parent))
    assert f"{path} is damaged (JSONDecodeError" in str(e.value)
    assert "restore it from a copy" in str(e.value) and ckpt.TRACKER_FILE in str(e.value)
    path.write_text('{"iteration": 4}')
    with pytest.raises(ckpt.CheckpointError, match="is damaged .TypeError"):
        ckpt.CheckpointMeta.read(str(path.parent))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_safe_load_refuses_code(tmp_path):
    path = str(tmp_path / "evil.pt")
    torch.save({"x": _Evil()}, path)  # a torch.save archive whose pickle runs a command
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.safe_load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path} refers to code (posix.system)") and "nothing in it ran" in msg
    assert "weights_only" not in msg  # torch's advice to unpickle it anyway is never passed on
    with open(path, "wb") as f:  # a bare pickle (torch's legacy format): never unpickled at all
        pickle.dump({"x": _Evil()}, f, protocol=2)
    with pytest.raises(ckpt.CheckpointError, match=r"evil\.pt: not a torch checkpoint .it does not start as a torch"):
        ckpt.safe_load(path)


def test_safe_load_names_damaged_and_missing_files(tmp_path):
    """Was ``PytorchStreamReader failed reading zip archive`` / ``OSError: [Errno 22]`` / EOFError."""
    good = str(tmp_path / "good.pt")
    torch.save({"w": torch.arange(1000.0)}, good)
    data = open(good, "rb").read()
    cases = {"truncated.pt": data[: len(data) // 2], "empty.pt": b"", "garbage.pt": b"\x00" * 300,
             "random.pt": bytes(range(256)) * 4, "text.pt": b"garbage" * 100}
    # was, for the garbage files: "mmap can only be used with files saved with `torch.save(PATH,
    # _use_new_zipfile_serialization=True)..." (torch's text with our path spliced in)
    for mmap in (False, True):
        for name, content in cases.items():
            path = str(tmp_path / name)
            open(path, "wb").write(content)
            with pytest.raises(ckpt.CheckpointError) as e:
                ckpt.safe_load(path, mmap=mmap)
            if name == "truncated.pt":
                assert str(e.value).startswith(f"{path} ({len(content)} bytes) is truncated or overwritten"), str(e.value)
            else:
                what = "it is empty" if not content else f"it does not start as a torch.save archive: first bytes"
                assert str(e.value).startswith(f"{path}: not a torch checkpoint ({what}"), str(e.value)
                assert f"{len(content)} bytes)" in str(e.value)
            assert "restore it from a copy" in str(e.value) and ckpt.TRACKER_FILE in str(e.value)
            assert "weights_only" not in str(e.value) and "_use_new_zipfile" not in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="missing.pt is missing"):
        ckpt.safe_load(str(tmp_path / "missing.pt"))
    assert torch.equal(ckpt.safe_load(good)["w"], torch.arange(1000.0))


# ---- end to end with a DeepSpeed engine (in subprocesses: one of them is killed mid-save) -----

def _engine(zero_stage):
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch.distributed as dist

    from megatron_ru.deepspeed_bridge.compat import disable_cpu_shm_comm
    from megatron_ru.config.lr_schedule import LRSchedule
    from megatron_ru.training.lr import MegatronLRScheduler
    disable_cpu_shm_comm()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = LRSchedule(max_lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10, decay_style="cosine")
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10 ** 9,
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                      lr_scheduler=lambda o: MegatronLRScheduler(o, sched))
    return engine


def _step(engine, it):
    g = torch.Generator().manual_seed(it)
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _worker(mode, save_dir, out_json, zero_stage):
    """mode=crash: steps 1-2, save; steps 3-4 (losses recorded), save killed before the pointer.
    mode=resume: load latest, steps 3-4."""
    from megatron_ru.parallel.random import get_rng_state
    engine = _engine(zero_stage)
    out = {}
    if mode == "crash":
        for it in (1, 2):
            _step(engine, it)
        ckpt.save_checkpoint(engine, save_dir, 2, _meta(2, zero=zero_stage), get_rng_state())
        out["losses"] = [_step(engine, it) for it in (3, 4)]
        json.dump(out, open(out_json, "w"))

        def die():
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save_checkpoint(engine, save_dir, 4, _meta(4, zero=zero_stage), get_rng_state(), before_commit=die)
    elif mode == "diskfull":
        for it in (1, 2):
            _step(engine, it)
        ckpt.save_checkpoint(engine, save_dir, 2, _meta(2, zero=zero_stage), get_rng_state())
        _step(engine, 3)
        _fill(save_dir)
        try:
            ckpt.save_checkpoint(engine, save_dir, 3, _meta(3, zero=zero_stage), get_rng_state())
            out["error"] = None
        except ckpt.CheckpointSaveError as e:
            out["error"] = str(e)
        json.dump(out, open(out_json, "w"))
    else:
        meta, rng = ckpt.load_checkpoint(engine, save_dir, zero_stage=zero_stage,
                                         load_optim=True, finetune=False)
        out["iteration"] = meta.iteration
        out["rng_keys"] = sorted(rng)
        out["lr_steps"] = engine.lr_scheduler.num_steps
        out["losses"] = [_step(engine, it) for it in (3, 4)]
        json.dump(out, open(out_json, "w"))
    # a clean exit: gloo's threads joined before the interpreter ends (under load, leaving the group to the
    # interpreter's exit aborted the process once: "terminate called without an active exception")
    import torch.distributed as dist
    dist.destroy_process_group()


def _fill(directory):
    """Write a filler file until the file system says ENOSPC."""
    try:
        with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


def _run_worker(*args):
    code = f"from tests.unit.test_checkpoint import _worker; _worker{args!r}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow  # trains in a subprocess
def test_crash_during_save_keeps_previous_checkpoint_and_resume_is_exact(tmp_path):
    save, first, second = str(tmp_path / "ckpt"), str(tmp_path / "a.json"), str(tmp_path / "b.json")
    proc = _run_worker("crash", save, first, 1)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert ckpt.read_latest_iteration(save) == 2  # the pointer never moved to the half-written 4
    assert os.path.isdir(os.path.join(save, "iter_0000004"))  # the crashed save did write files
    files = glob.glob(os.path.join(save, "iter_0000002", "*.pt"))
    assert any("optim_states" in f for f in files) and any("model_states" in f for f in files)
    for f in files:
        ckpt.safe_load(f)  # every file loads without unpickling code
    proc = _run_worker("resume", save, second, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.load(open(first)), json.load(open(second))
    assert b["iteration"] == 2 and b["lr_steps"] == 2 and b["rng_keys"] == ["cpu", "keyed_calls", "tracker"]
    assert b["losses"] == a["losses"]  # iterations 3-4 identical after resume


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB file system that fills up."""
    with small_tmpfs(tmp_path / "small_fs", "2m") as mnt:
        yield mnt


def test_a_small_file_written_to_a_full_file_system_is_no_space(small_fs):
    """torch.save of a small object onto a file system with no byte left fails at the ofstream's flush with
    ``basic_ios::clear: iostream error`` (not inline_container's ``unexpected pos``): seen when the other rank
    of a 2-rank save filled the disk first, and reported as a failed write of unknown cause."""
    from megatron_ru.checkpointing.files import describe_write_failure
    st = os.statvfs(small_fs)
    with open(os.path.join(small_fs, "filler"), "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize))
    path = os.path.join(small_fs, "small.pt")
    with pytest.raises(RuntimeError) as e:
        torch.save({"x": torch.zeros(10)}, path)
    assert "iostream error" in str(e.value)  # torch's wording: if this changes, the rule below may be dead
    assert describe_write_failure(path, e.value).startswith(
        f"no space left on tmpfs (mounted at {small_fs} (0 bytes free of 2.0 MiB)) while writing {path}")
    os.remove(os.path.join(small_fs, "filler"))  # the same error with room left is not called a full disk
    assert describe_write_failure(path, e.value) == (
        f"writing {path} failed (RuntimeError: basic_ios::clear: iostream error)")


@pytest.mark.slow  # trains in a subprocess
def test_disk_full_during_save_names_device_and_path_and_keeps_previous(small_fs, tmp_path):
    """Was ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0``."""
    save, out = os.path.join(small_fs, "ckpt"), str(tmp_path / "full.json")
    proc = _run_worker("diskfull", save, out, 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = json.load(open(out))["error"]
    assert msg is not None and msg.startswith(f"no space left on tmpfs (mounted at {small_fs} (0 bytes free of "
                                              f"2.0 MiB)) while writing {save}/iter_0000003/"), msg
    assert f"the save of iteration 3 was abandoned and its partial directory {save}/iter_0000003 removed; " \
           f"iteration 2 ({save}/iter_0000002) is still the current checkpoint" in msg
    assert "--keep-last" in msg and "--save" in msg
    assert ckpt.read_latest_iteration(save) == 2 and ckpt.list_iterations(save) == [2]
    os.remove(os.path.join(save, "filler"))
    proc = _run_worker("resume", save, str(tmp_path / "resumed.json"), 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(tmp_path / "resumed.json"))["iteration"] == 2


def test_safe_load_from_two_threads(tmp_path):
    """Loads in two threads at once (the checkpoint reader reads the next layer in the background)
    both see DeepSpeed's allow-listed classes: torch's safe_globals context manager, used before,
    restored the allow-list when one thread's load ended, under the other's load."""
    import threading

    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from megatron_ru.checkpointing.files import safe_load
    with_scaler, plain = str(tmp_path / "scaler.pt"), str(tmp_path / "plain.pt")
    torch.save({"scaler": LossScaler(1.0), "x": torch.zeros(4)}, with_scaler)
    torch.save({"x": torch.ones(4)}, plain)
    errors: list[BaseException] = []

    def loop(path: str) -> None:
        try:
            for _ in range(300):
                safe_load(path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=loop, args=(p,)) for p in (with_scaler, plain, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_metadata_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """Every reader of a checkpoint (--use-checkpoint-args, the loader, the offline reader) asks for
    metadata.json; the file is parsed once per process, and again only when it changes."""
    import json as _json

    from megatron_ru.checkpointing import meta as meta_module
    from megatron_ru.checkpointing.meta import METADATA_FILE, CheckpointMeta
    parsed = []
    real_load = _json.load
    monkeypatch.setattr(meta_module.json, "load", lambda f: parsed.append(1) or real_load(f))
    path = tmp_path / METADATA_FILE
    fields = dict(consumed_train_samples=0, consumed_valid_samples=0, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=0, model_args={}, args={})

    def write(iteration: int) -> None:
        path.write_text(_json.dumps({"iteration": iteration, **fields}))
    write(3)
    first, second = CheckpointMeta.read(str(tmp_path)), CheckpointMeta.read(str(tmp_path))
    assert first.iteration == second.iteration == 3 and len(parsed) == 1
    first.iteration = 99  # each reader has its own copy
    assert CheckpointMeta.read(str(tmp_path)).iteration == 3 and len(parsed) == 1
    write(40)
    assert CheckpointMeta.read(str(tmp_path)).iteration == 40 and len(parsed) == 2
