"""Each patch of DeepSpeed's internals (megatron_ru/deepspeed_bridge/compat.py) takes effect on the
installed DeepSpeed: the attribute it replaces exists, and the patched behaviour is what runs.
DeepSpeed keeps global state, so each check runs in its own interpreter (``_run``)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import LEAVE_GROUP

from megatron_ru.deepspeed_bridge import compat as dsc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(check: str, tmp_path) -> dict:
    out = str(tmp_path / f"{check}.json")
    code = f"from tests.unit.test_deepspeed_compat import {check}; {check}({out!r}); " + LEAVE_GROUP
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def _init_single_process():
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dsc.disable_cpu_shm_comm()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)


def _engine(model, zero_stage=0, mpu=None):
    import deepspeed
    import torch
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10 ** 9,
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu, dist_init_required=False)
    return engine


# ---- version ---------------------------------------------------------------------------------------

def test_version_range_and_setup_py_agree():
    import deepspeed
    assert dsc.version_problem(deepspeed.__version__) is None  # the installed release is a tested one
    for untested in ("0.14.0", "0.18.9", "0.19.7", "0.20.0", "1.0.0"):
        msg = dsc.version_problem(untested)
        assert msg.startswith(f"DeepSpeed {untested} is installed; megatron_ru was tested with "
                              f"deepspeed>=0.19.8,<0.20"), msg
        assert "pip install 'deepspeed>=0.19.8,<0.20'" in msg
    assert dsc.version_problem("0.19.8+cpu") is None and dsc.version_problem("0.19.12") is None
    assert f'"{dsc.TESTED_RANGE_TEXT}"' in Path(REPO, "setup.py").read_text()


def test_a_patch_whose_target_is_gone_says_which_release_to_install():
    with pytest.raises(RuntimeError, match=r"has no DeepSpeedEngine.clip_fp32_gradients, which megatron_ru "
                                           r"patches .*install deepspeed>=0.19.8,<0.20"):
        dsc.install_fp32_clipping(object(), lambda params: None)
    with pytest.raises(RuntimeError, match="has no engine.checkpoint_engine with load/save"):
        dsc.install_checkpoint_io(object(), lambda p, m: None)
    with pytest.raises(RuntimeError, match="has no PipelineModule.load_state_dir"):
        dsc.install_exact_layer_loading(object())
    with pytest.raises(RuntimeError, match="has no DeepSpeedEngine._get_all_ckpt_names"):
        dsc.install_numeric_model_file_order(object())


# ---- 1. shared-memory op --------------------------------------------------------------------------

def check_shm(out):
    import importlib

    import deepspeed.ops
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    dsc.disable_cpu_shm_comm()
    json.dump({"name": builder.NAME if builder is not None else None,
               "flag": deepspeed.ops.__compatible_ops__.get(builder.NAME) if builder is not None else None,
               "built": ds_torch_comm.build_shm_op() is not None}, open(out, "w"))


def test_shm_comm_op_is_not_built_on_cpu(tmp_path):
    """The key we set is the one ``deepspeed.comm.torch.build_shm_op`` reads, and it then builds nothing
    (unpatched, it JIT-compiles for ~50 s)."""
    r = _run("check_shm", tmp_path)
    assert r == {"name": "deepspeed_shm_comm", "flag": False, "built": False}


# ---- 1a. DeepSpeed's compiled helpers compiled lazily --------------------------------------------------

def check_lazy_compile(out):
    import sys

    import torch
    _init_single_process()
    dsc.compile_lazily()
    dsc.compile_lazily()  # twice: one wrapper
    engine = _engine(torch.nn.Linear(4, 4), zero_stage=1)  # imports DeepSpeed's Muon module
    loss = engine(torch.randn(2, 4)).pow(2).sum()
    engine.backward(loss)
    engine.step()
    from deepspeed.runtime.zero.muon import original_muon
    json.dump({"muon": "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules,
               "inductor": "torch._inductor.compile_fx" in sys.modules,
               "wrapped": original_muon.muon_update.__wrapped__.__module__,
               "stage": engine.zero_optimization_stage()}, open(out, "w"))


def test_deepspeed_compiles_its_kernels_when_first_called(tmp_path):
    """A ZeRO 1 engine imports DeepSpeed's Muon module, and with the patch that import no longer brings in
    torch's inductor (its kernels are handed to torch.compile when first called: never, with AdamW)."""
    r = _run("check_lazy_compile", tmp_path)
    assert r == {"muon": True, "inductor": False, "wrapped": "deepspeed.runtime.zero.muon.original_muon",
                 "stage": 1}, r


# ---- 2. fp32 clipping -------------------------------------------------------------------------------

def check_clipping(out):
    import torch
    _init_single_process()
    torch.manual_seed(0)
    engine = _engine(torch.nn.Linear(4, 4))
    calls = []

    def clip(params):
        calls.append(len(list(params)))
        return torch.tensor(123.0)
    dsc.install_fp32_clipping(engine, clip)
    loss = engine(torch.randn(2, 4)).pow(2).sum()
    engine.backward(loss)
    engine.step()
    json.dump({"calls": calls, "norm": float(engine.get_global_grad_norm())}, open(out, "w"))


def test_fp32_clipping_patch_is_what_the_engine_runs(tmp_path):
    r = _run("check_clipping", tmp_path)
    assert r == {"calls": [2], "norm": 123.0}  # weight and bias; DeepSpeed reports our norm


# ---- 1b. no gradient all-reduce over one data-parallel replica -----------------------------------------

def check_single_replica_allreduce(out):
    import torch
    _init_single_process()
    result = {}
    for stage in (0, 1):
        engine = _engine(torch.nn.Linear(4, 4), zero_stage=stage)
        skipped = dsc.skip_single_replica_allreduce(engine, dp_size=1)
        calls = []
        original = engine.allreduce_gradients
        engine.allreduce_gradients = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
        x = torch.randn(2, 4)
        before = engine.module.weight.detach().clone()
        engine.backward(engine(x).square().sum())
        engine.step()
        result[f"zero{stage}"] = {"skipped": skipped, "allreduce_calls": len(calls),
                                  "stepped": bool((engine.module.weight != before).any())}
    result["dp2"] = dsc.skip_single_replica_allreduce(engine, dp_size=2)
    json.dump(result, open(out, "w"))


def test_single_replica_skips_only_the_bucket_copy(tmp_path):
    r = _run("check_single_replica_allreduce", tmp_path)
    # no-ZeRO: DeepSpeed's all-reduce over one rank is a bucket copy, skipped; the step still happens.
    # ZeRO 1 moves gradients into its partitions in reduce_gradients: kept. More than one replica: kept.
    assert r == {"zero0": {"skipped": True, "allreduce_calls": 0, "stepped": True},
                 "zero1": {"skipped": False, "allreduce_calls": 1, "stepped": True}, "dp2": False}


# ---- 1c. the bf16 optimizer's loops as multi-tensor kernels --------------------------------------------

class _SometimesUnused:
    """A model whose second branch takes part only when ``use_extra`` is set (its gradients are then
    missing in some steps), made a torch module on first use."""

    @staticmethod
    def build():
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
                self.extra = torch.nn.Linear(8, 4)
                self.use_extra = False

            def forward(self, x):
                y = self.body(x)
                return y + self.extra(x) if self.use_extra else y

        return Model()


def check_batched_bf16_step(out):
    import deepspeed
    import torch
    _init_single_process()
    runs = {}
    for accum in (1, 2):
        for name in ("deepspeed", "batched"):
            torch.manual_seed(0)
            model = _SometimesUnused.build()
            cfg = {"train_batch_size": 2 * accum, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                   "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
                   "data_types": {"grad_accum_dtype": "fp32"}}
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
            installed = dsc.install_batched_bf16_step(engine) if name == "batched" else False
            g = torch.Generator().manual_seed(1)
            norms = []
            # clipped, not clipped, clipped; the extra branch joins in the second step only
            for step, scale in enumerate((10.0, 1e-3, 3.0)):
                if step == 2:  # gradients set to None (as zero_grad(set_to_none=True) leaves them): stale fp32 ones
                    for p in engine.module.extra.parameters():
                        p.grad = None
                for _ in range(accum):
                    engine.module.use_extra = step == 1
                    x = torch.randn(2, 8, generator=g).to(torch.bfloat16)
                    engine.backward(engine(x).float().square().sum() * scale)
                    engine.step()
                norms.append(float(engine.get_global_grad_norm()))
            runs[f"{name}-accum{accum}"] = {
                "installed": installed, "type": type(engine.optimizer).__name__, "norms": norms,
                "weights": [p.detach().float().flatten().tolist() for p in engine.module.parameters()],
                "masters": [m.detach().flatten().tolist() for m in engine.optimizer.fp32_groups_flat_partition],
                "patched": sorted(a for a in ("step", "update_hp_grads", "clear_hp_grads")
                                  if a in vars(engine.optimizer))}
    json.dump(runs, open(out, "w"))


@pytest.mark.slow  # DeepSpeed engines built and stepped (20-30 CPU-s): make test, not the edit-test loop
def test_batched_bf16_step_is_deepspeeds_arithmetic(tmp_path):
    r = _run("check_batched_bf16_step", tmp_path)
    for accum in (1, 2):
        ds, ours = r[f"deepspeed-accum{accum}"], r[f"batched-accum{accum}"]
        assert ds["type"] == ours["type"] == "BF16_Optimizer"
        assert ours["installed"] and ours["patched"] == ["clear_hp_grads", "step", "update_hp_grads"]
        assert not ds["installed"] and ds["patched"] == []
        assert ds["norms"][0] > 1.0 and ds["norms"][1] < 1.0 and ds["norms"][2] > 1.0  # both clipping branches
        assert ours["norms"] == ds["norms"], accum  # bit for bit
        assert ours["masters"] == ds["masters"] and ours["weights"] == ds["weights"], accum


# ---- 3. checkpoint engine load/save -----------------------------------------------------------------

def check_checkpoint_io(out):
    import torch
    from megatron_ru.checkpointing.files import CheckpointError, safe_load
    _init_single_process()
    engine = _engine(torch.nn.Linear(4, 4), zero_stage=1)
    save_dir = os.path.join(os.path.dirname(out), "ckpt")
    recorder = dsc.SaveRecorder()
    saved, loaded = [], []
    original = engine.checkpoint_engine.save
    engine.checkpoint_engine.save = lambda sd, path: (saved.append(os.path.basename(path)), original(sd, path))
    dsc.install_checkpoint_io(engine, lambda p, m: (loaded.append(os.path.basename(p)), safe_load(p, m))[1],
                              recorder)
    engine.save_checkpoint(save_dir, tag="t1", save_latest=False)
    engine.load_checkpoint(save_dir, tag="t1")
    saved_by_deepspeed = list(saved)
    # a write that fails is recorded, not raised, so DeepSpeed finishes its collectives
    dsc.install_checkpoint_io(engine, safe_load, recorder)
    engine.checkpoint_engine.save({"x": torch.zeros(1)}, os.path.join(save_dir, "gone", "new.pt"))
    path, error = recorder.failure if recorder.failure else (None, None)
    # a damaged file read by DeepSpeed is our error, naming it
    victim = os.path.join(save_dir, "t1", "mp_rank_00_model_states.pt")
    open(victim, "wb").write(b"PK\x03\x04 not a zip")
    try:
        engine.load_checkpoint(save_dir, tag="t1")
        damaged = None
    except CheckpointError as e:
        damaged = str(e)
    json.dump({"saved": saved_by_deepspeed, "loaded": loaded, "failed_path": path, "error": type(error).__name__,
               "damaged": damaged}, open(out, "w"))


@pytest.mark.slow  # DeepSpeed engines built and stepped (20-30 CPU-s): make test, not the edit-test loop
def test_checkpoint_engine_reads_and_writes_through_our_functions(tmp_path):
    r = _run("check_checkpoint_io", tmp_path)
    assert sorted(r["saved"]) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert "mp_rank_00_model_states.pt" in r["loaded"] and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in r["loaded"]
    assert r["failed_path"] == str(tmp_path / "ckpt" / "gone" / "new.pt") and r["error"] == "RuntimeError"
    assert r["damaged"].startswith(str(tmp_path / "ckpt" / "t1" / "mp_rank_00_model_states.pt"))
    assert "is truncated or overwritten" in r["damaged"]


def check_model_file_order(out):
    import torch
    _init_single_process()
    engine = _engine(torch.nn.Linear(4, 4))
    ckpt = os.path.join(os.path.dirname(out), "many", "t")
    os.makedirs(ckpt)
    for m in range(128):  # e.g. TP 8 x PP 16
        open(os.path.join(ckpt, f"mp_rank_{m:02d}_model_states.pt"), "w").close()
    before = [os.path.basename(p) for p in engine._get_all_ckpt_names(os.path.dirname(ckpt), "t")]
    dsc.install_numeric_model_file_order(engine)
    after = [os.path.basename(p) for p in engine._get_all_ckpt_names(os.path.dirname(ckpt), "t")]
    json.dump({"before": before, "after": after}, open(out, "w"))


def test_model_files_are_listed_in_rank_order(tmp_path):
    """DeepSpeed picks ``names[mp_rank]``: unpatched, rank 10 would read ``mp_rank_100``."""
    r = _run("check_model_file_order", tmp_path)
    assert r["before"][10] == "mp_rank_100_model_states.pt"  # DeepSpeed's string order
    assert r["after"] == [f"mp_rank_{m:02d}_model_states.pt" for m in range(128)]


# ---- 4. a pipeline stage reads exactly its own layer file -------------------------------------------

def check_layer_loading(out):
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron_ru.checkpointing.files import CheckpointError, safe_load
    _init_single_process()
    torch.manual_seed(0)
    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1)
    module = PipelineModule(layers=[torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)], topology=topo,
                            loss_fn=lambda x, y: x.sum())
    module.checkpoint_parallel_write_pipeline = False  # set by DeepSpeed's engine otherwise
    ckpt = os.path.join(os.path.dirname(out), "layers")
    os.makedirs(ckpt)

    class Engine:  # what load_state_dir needs of DeepSpeed's checkpoint engine
        def load(self, path, map_location=None):
            return safe_load(path, map_location or "cpu")
    module.save_state_dict(ckpt, checkpoint_engine=type("E", (), {
        "makedirs": staticmethod(lambda d, exist_ok: os.makedirs(d, exist_ok=exist_ok)),
        "preserves_storage_sharing": staticmethod(lambda: False),
        "save": staticmethod(lambda state_dict, path: torch.save(state_dict, path))})())
    names = sorted(os.listdir(ckpt))
    own = {k: v.clone() for k, v in module.forward_funcs[0].state_dict().items()}
    # another TP rank's shard of layer 0 next to ours: DeepSpeed's loader sees two files for one rank
    torch.save({k: v + 100 for k, v in own.items()}, os.path.join(ckpt, "layer_00-model_01-model_states.pt"))

    def layer0_after_load():
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        try:
            module.load_state_dir(ckpt, checkpoint_engine=Engine())
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            return f"{type(e).__name__}: {e}"
        sd = module.forward_funcs[0].state_dict()
        return "own" if all(torch.equal(sd[k], own[k]) for k in own) else "other"
    unpatched = layer0_after_load()
    dsc.install_exact_layer_loading(module)
    patched = layer0_after_load()
    os.remove(os.path.join(ckpt, "layer_00-model_00-model_states.pt"))  # our own shard gone
    try:
        module.load_state_dir(ckpt, checkpoint_engine=Engine())
        missing = None
    except CheckpointError as e:
        missing = str(e)
    json.dump({"names": names, "unpatched": unpatched, "patched": patched, "missing": missing}, open(out, "w"))


def test_pipeline_layers_load_exactly_this_ranks_file(tmp_path):
    r = _run("check_layer_loading", tmp_path)
    assert r["names"] == ["layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt"]
    assert r["unpatched"] != "own"  # DeepSpeed merges the two files (or fails): never our weights alone
    assert r["patched"] == "own"
    assert r["missing"].startswith(str(tmp_path / "layers" / "layer_00-model_00-model_states.pt") + " is missing")


# ---- 5. the mpu interface ------------------------------------------------------------------------------

def test_mpu_has_every_method_deepspeed_calls():
    import deepspeed
    root = Path(deepspeed.__file__).parent
    called = set()
    for path in root.rglob("*.py"):
        called |= set(re.findall(r"\bmpu\.(get_[a-z_]+)\(", path.read_text(errors="ignore")))
    ulysses = {m for m in called if "sequence" in m}
    assert called - ulysses and not [m for m in called - ulysses if not callable(getattr(dsc.DeepSpeedMpu, m, None))]
    assert not any(hasattr(dsc.DeepSpeedMpu, m) for m in ulysses)  # deliberately absent (class docstring)


def check_mpu(out):
    import torch
    from megatron_ru.parallel.state import ParallelState
    _init_single_process()
    state = ParallelState.build(1, 1)
    engine = _engine(torch.nn.Linear(4, 4), zero_stage=1, mpu=state)
    json.dump({"is_ours": engine.mpu is state and isinstance(state, dsc.DeepSpeedMpu),
               "dp": engine.dp_world_size, "mp": engine.mp_world_size}, open(out, "w"))


def test_deepspeed_uses_parallel_state_as_mpu(tmp_path):
    assert _run("check_mpu", tmp_path) == {"is_ours": True, "dp": 1, "mp": 1}
