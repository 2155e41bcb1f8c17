"""The checkpoint reader/writer in canonical names (megatron_ru/checkpointing): write at (TP, PP) and read
back bit-identical, reshard A -> B -> A bit-identical, the TP split of SwiGLU's [gate; up] and of the QKV
groups checked against a known construction, vocabulary padding added/stripped, and every bad input
refused with its message and nothing left behind."""
import json
import os

import pytest
import torch

from megatron_ru.checkpointing import read_checkpoint, write_checkpoint
from megatron_ru.checkpointing import reshard
from megatron_ru.checkpointing.layout import layer_file, layer_optim_file
from megatron_ru.config.model import ModelConfig
from megatron_ru.model.spec import parameter_specs
from megatron_ru.checkpointing.files import CheckpointError, safe_load

V = 75  # odd: padded to 128 (divisible-by 64 x TP 2) rows, stripped back to 75


def tiny_cfg(**kw):
    base = dict(num_layers=3, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, max_position_embeddings=16, position_embedding_type="rope",
                normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                make_vocab_size_divisible_by=64)
    base.update(kw)
    return ModelConfig(**base)


def canonical_tensors(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in parameter_specs(cfg, V)}


class Optim:
    """Optimizer state of known values for the writer."""

    def __init__(self, tensors):
        self.tensors = tensors

    def optimizer_state(self, name):
        t = self.tensors[name]
        return {"fp32": t * 1.0, "exp_avg": t * 0.5, "exp_avg_sq": t * t}

    def common_state(self):
        return {"step": 7, "lr_scheduler": {"num_steps": 7}, "loss_scaler": None, "skipped_steps": 0,
                "global_steps": 7, "global_samples": 28}


def write(path, cfg, tensors, tp, pp, **kw):
    return write_checkpoint(str(path), cfg=cfg, vocab_size=V, tp=tp, pp=pp, get_tensor=tensors.__getitem__,
                            iteration=7, optimizer=Optim(tensors), **kw)


def assert_same(reader, tensors):
    assert reader.names() == list(tensors)
    opt = Optim(tensors)
    for name, full in tensors.items():
        assert torch.equal(reader.get(name), full), name
        got, want = reader.optimizer_state(name), opt.optimizer_state(name)
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_write_then_read_is_bit_identical(tmp_path, tp, pp):
    cfg = tiny_cfg(untie_embeddings_and_output_weights=pp != 3)  # tied at PP 3: word embeddings on both ends
    tensors = canonical_tensors(cfg)
    write(tmp_path / "ck", cfg, tensors, tp, pp)
    reader = read_checkpoint(str(tmp_path / "ck"))
    assert (reader.tp, reader.pp, reader.vocab_size, reader.meta.iteration) == (tp, pp, V, 7)
    assert_same(reader, tensors)
    assert reader.common_state()["step"] == 7
    # the padded vocabulary rows are zero in the files, and cut on reading
    emb = safe_load(str(tmp_path / "ck" / "iter_0000007" / layer_file(0, tp - 1)))["word_embeddings.weight"]
    assert emb.shape[0] == 128 // tp and torch.count_nonzero(emb[V - (128 - 128 // tp):]) == 0
    assert [os.path.basename(p) for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left


def _all_file_tensors(ckpt):
    out = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".pt"):
            out[name] = safe_load(os.path.join(ckpt, name))
    return out


def _equal_nested(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
        return
    assert isinstance(a, dict) and isinstance(b, dict) and sorted(a) == sorted(b), where
    for k in a:
        _equal_nested(a[k], b[k], f"{where}/{k}")


def test_reshard_a_b_a_is_bit_identical(tmp_path):
    cfg = tiny_cfg(disable_bias_linear=False, normalization="LayerNorm")  # biases (fc1's with stride 2) too
    tensors = {k: v.to(torch.bfloat16) for k, v in canonical_tensors(cfg).items()}
    write(tmp_path / "a", cfg, tensors, 2, 2)
    for src, dst, tp, pp in (("a", "b", 1, 3), ("b", "a2", 2, 2)):
        reshard.main(["--load", str(tmp_path / src), "--save", str(tmp_path / dst),
                      "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)])
    a, a2 = _all_file_tensors(tmp_path / "a" / "iter_0000007"), _all_file_tensors(tmp_path / "a2" / "iter_0000007")
    assert sorted(a) == sorted(a2)
    _equal_nested(a, a2)
    meta_a, meta_a2 = (json.load(open(tmp_path / d / "iter_0000007" / "metadata.json")) for d in ("a", "a2"))
    assert meta_a["optimizer"] == meta_a2["optimizer"] and meta_a["files"] == meta_a2["files"]
    assert read_checkpoint(str(tmp_path / "b")).get("embedding.word_embeddings.weight").dtype == torch.bfloat16


def test_tp_split_keeps_swiglu_halves_and_qkv_groups_together(tmp_path):
    """A known construction: every row of fc1 and QKV is labelled with what it is; rank t's file must
    hold gate rows t and up rows t (not a contiguous slice of [gate; up]), and whole query groups.
    Fails if a reshard permutes the halves or the groups."""
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    d, nq, ng, ffn, h = cfg.head_dim, 4, 2, 48, 32
    r = nq // ng
    gate = torch.arange(ffn).float()[:, None].expand(ffn, h) + 1000
    up = torch.arange(ffn).float()[:, None].expand(ffn, h) + 2000
    tensors["decoder.layers.1.mlp.linear_fc1.weight"] = torch.cat([gate, up]).clone()
    # QKV rows: group g, then within it q heads, k, v; label = 100 * g + 10 * kind + row within the kind
    rows = []
    for gi in range(ng):
        rows += [100 * gi + 0 + i for i in range(r * d)] + [100 * gi + 30 + i for i in range(d)] + \
                [100 * gi + 60 + i for i in range(d)]
    tensors["decoder.layers.1.self_attention.linear_qkv.weight"] = torch.tensor(rows).float()[:, None].repeat(1, h)
    write(tmp_path / "tp1", cfg, tensors, 1, 1)
    reshard.main(["--load", str(tmp_path / "tp1"), "--save", str(tmp_path / "tp2"),
                  "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"])
    for t in range(2):
        shard = safe_load(str(tmp_path / "tp2" / "iter_0000007" / layer_file(2, t)))
        fc1 = shard["mlp.linear_fc1.weight"][:, 0]
        half = ffn // 2
        mine = torch.arange(t * half, (t + 1) * half)
        expect = torch.cat([mine + 1000, mine + 2000])  # gate rows t, then up rows t
        assert torch.equal(fc1, expect.float()), t
        qkv = shard["self_attention.linear_qkv.weight"][:, 0]
        assert torch.equal(qkv, torch.tensor(rows[t * (r + 2) * d:(t + 1) * (r + 2) * d]).float()), t
        opt = safe_load(str(tmp_path / "tp2" / "iter_0000007" / layer_optim_file(2, t)))
        assert torch.equal(opt["mlp.linear_fc1.weight"]["exp_avg"][:, 0], expect.float() * 0.5)
    # and back: TP 2 -> TP 1 restores the canonical order exactly
    reshard.main(["--load", str(tmp_path / "tp2"), "--save", str(tmp_path / "back"),
                  "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    assert_same(read_checkpoint(str(tmp_path / "back")), tensors)


def test_logits_survive_a_reshard(tmp_path):
    """A GPTModel built from a TP 2 -> TP 1 resharded checkpoint computes the source model's logits."""
    from megatron_ru.model.gpt import GPTModel
    cfg = tiny_cfg()
    model = GPTModel(cfg, V, None, False, seed=3, device=torch.device("cpu"))
    with torch.no_grad():  # the two halves of fc1 differ (init draws them independently)
        # the model holds the padded vocabulary rows (zeros past V); canonical tensors hold V
        tensors = {n: p.detach()[:V].clone() if "word_embeddings" in n or n.startswith("output_layer") else
                   p.detach().clone() for n, p in model.named_parameters()}
    write(tmp_path / "src", cfg, tensors, 1, 2)
    for src, dst, tp in (("src", "tp2", 2), ("tp2", "tp1", 1)):
        reshard.main(["--load", str(tmp_path / src), "--save", str(tmp_path / dst), "--target-tensor-parallel-size",
                      str(tp), "--target-pipeline-parallel-size", "1"])
    reader = read_checkpoint(str(tmp_path / "tp1"))
    other = GPTModel(cfg, V, None, False, seed=99, device=torch.device("cpu"))
    with torch.no_grad():
        for n, p in other.named_parameters():
            p.zero_()
            p[: reader.get(n).shape[0]].copy_(reader.get(n))
    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval(), other.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), other(tokens))


# ---- bad input -----------------------------------------------------------------------------------------

def _leftovers(parent, keep):
    return sorted(n for n in os.listdir(parent) if n not in keep)


def test_writer_refuses_a_mis_shaped_tensor_and_leaves_nothing(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    tensors["decoder.layers.2.mlp.linear_fc2.weight"] = torch.zeros(32, 47)
    with pytest.raises(ValueError, match=r"'decoder.layers.2.mlp.linear_fc2.weight' has shape \[32, 47\], "
                                         r"expected \[32, 48\]"):
        write(tmp_path / "out", cfg, tensors, 2, 2)
    assert os.listdir(tmp_path) == []


def test_writer_refuses_existing_output_unless_force(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already exists: choose a new directory, or pass --force"):
        write(tmp_path / "out", cfg, tensors, 1, 1)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    write(tmp_path / "out", cfg, tensors, 1, 1, force=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    assert _leftovers(tmp_path, {"out"}) == []


def test_writer_refuses_a_layout_the_model_cannot_take(tmp_path):
    cfg = tiny_cfg()
    with pytest.raises(ValueError, match=r"--num-query-groups \(2\) must be divisible by --target-tensor-parallel-size "
                                         r"\(4\).*--target-pipeline-parallel-size \(5\) exceeds --num-layers \(3\)"):
        write(tmp_path / "out", cfg, canonical_tensors(cfg), 4, 5)
    assert os.listdir(tmp_path) == []


def _source(tmp_path):
    cfg = tiny_cfg()
    write(tmp_path / "src", cfg, canonical_tensors(cfg), 2, 2)
    return tmp_path / "src" / "iter_0000007"


def _reshard_fails(tmp_path, match, *extra, keep=("src",)):
    with pytest.raises((ValueError, FileNotFoundError, FileExistsError), match=match):
        reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"),
                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1", *extra])
    assert _leftovers(tmp_path, set(keep)) == []


def test_reshard_refuses_missing_and_truncated_files(tmp_path):
    ckpt = _source(tmp_path)
    victim = ckpt / layer_file(3, 1)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    _reshard_fails(tmp_path, r"damaged, nothing was loaded: 1 file\(s\) truncated or overwritten: "
                             r"layer_03-model_01-model_states.pt")
    victim.unlink()
    _reshard_fails(tmp_path, r"1 file\(s\) missing: layer_03-model_01-model_states.pt")
    victim.write_bytes(data)
    (ckpt / layer_optim_file(1, 0)).unlink()
    _reshard_fails(tmp_path, r"missing: layer_01-model_00-optim_states.pt")


def test_reshard_refuses_a_mis_shaped_tensor_in_a_file(tmp_path):
    ckpt = _source(tmp_path)
    path = ckpt / layer_file(2, 0)
    state = safe_load(str(path))
    state["self_attention.linear_proj.weight"] = torch.zeros(32, 8)
    torch.save(state, path)
    meta = json.load(open(ckpt / "metadata.json"))
    meta["files"][path.name] = path.stat().st_size
    json.dump(meta, open(ckpt / "metadata.json", "w"))
    _reshard_fails(tmp_path, r"layer_02-model_00-model_states.pt: 'self_attention.linear_proj.weight' has shape "
                             r"\[32, 8\], expected \[32, 16\]")
    state["self_attention.linear_proj.weight"] = torch.zeros(32, 16)
    state["self_attention.extra.weight"] = torch.zeros(2)
    torch.save(state, path)
    meta["files"][path.name] = path.stat().st_size
    json.dump(meta, open(ckpt / "metadata.json", "w"))
    _reshard_fails(tmp_path, r"layer_02-model_00-model_states.pt holds self_attention.extra.weight, which layer 2 "
                             r"of the model in metadata.json does not have")


def test_reshard_refuses_bad_arguments(tmp_path):
    _source(tmp_path)
    (tmp_path / "dst").mkdir()
    _reshard_fails(tmp_path, "already exists: choose a new directory, or pass --force", keep=("src", "dst"))
    assert os.listdir(tmp_path / "dst") == []
    (tmp_path / "dst").rmdir()
    with pytest.raises(ValueError, match="--save .* lies inside --load"):
        reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "src" / "x"),
                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reshard.main(["--load", str(tmp_path / "nope"), "--save", str(tmp_path / "dst"),
                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    with pytest.raises(CheckpointError, match=r"iter_0000003 does not exist: the checkpoint of iteration 3 is "
                                              r"missing"):
        reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"), "--iteration", "3",
                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no latest_checkpointed_iteration.txt"):
        reshard.main(["--load", str(tmp_path / "empty"), "--save", str(tmp_path / "dst"),
                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    assert _leftovers(tmp_path, {"src", "empty"}) == []


def test_weights_only_checkpoint_has_no_optimizer_state(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    write_checkpoint(str(tmp_path / "src"), cfg=cfg, vocab_size=V, tp=1, pp=1, get_tensor=tensors.__getitem__)
    report = reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"),
                           "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"])
    assert report["optimizer_state"] is False
    reader = read_checkpoint(str(tmp_path / "dst"))
    assert not reader.has_optimizer_state
    assert all(torch.equal(reader.get(n), t) for n, t in tensors.items())


def _fake_deepspeed_pp1(path, cfg, tensors, tp, zero_stage, precision="fp32"):
    """DeepSpeed's PP = 1 layout: ``mp_rank_{t}_model_states.pt`` whose ``module`` holds TP shard t of
    every parameter under its canonical name (vocabulary rows padded)."""
    from megatron_ru.checkpointing.writer import tp_shards
    from megatron_ru.model.spec import model_args_dict
    from megatron_ru.parallel.utils import pad_vocab_size
    ckpt = path / "iter_0000005"
    ckpt.mkdir(parents=True)
    rows = pad_vocab_size(V, cfg.make_vocab_size_divisible_by, tp)
    modules = [{} for _ in range(tp)]
    for spec in parameter_specs(cfg, V):
        for t, shard in enumerate(tp_shards(spec, tensors[spec.name], tp, rows)):
            modules[t][spec.name] = shard.clone()
    files = {}
    for t in range(tp):
        torch.save({"module": modules[t], "lr_scheduler": {"num_steps": 5}}, ckpt / f"mp_rank_{t:02d}_model_states.pt")
        files[f"mp_rank_{t:02d}_model_states.pt"] = (ckpt / f"mp_rank_{t:02d}_model_states.pt").stat().st_size
    meta = dict(iteration=5, consumed_train_samples=20, consumed_valid_samples=0, tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=1, data_parallel_size=2, zero_stage=zero_stage,
                args={"training": {"bf16": precision == "bf16"}}, files=files, model_args=model_args_dict(cfg),
                vocab_size=V)
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    (path / "latest_checkpointed_iteration.txt").write_text("5\n")


def test_deepspeed_pp1_files_are_read_and_unsupported_optimizer_state_is_named(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    _fake_deepspeed_pp1(tmp_path / "src", cfg, tensors, tp=2, zero_stage=2, precision="bf16")
    reader = read_checkpoint(str(tmp_path / "src"))
    assert reader.kind == "ds_mp" and all(torch.equal(reader.get(n), t) for n, t in tensors.items())
    _reshard_fails(tmp_path, r"holds the optimizer state of ZeRO stage 2 with bf16, which megatron_ru cannot "
                             r"convert \(supported: ZeRO stage 0 with fp32, ZeRO stage 1 with fp32, bf16 or fp16\): "
                             r"convert the weights only \(--no-load-optim\), or train with --zero-stage 1")
    reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"), "--no-load-optim",
                  "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"])
    out = read_checkpoint(str(tmp_path / "dst"))
    assert out.meta.consumed_train_samples == 20 and out.meta.iteration == 5
    assert all(torch.equal(out.get(n), t) for n, t in tensors.items())


def test_tokenizer_files_named_relative_to_the_checkpoint_come_along(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)

    def add_tokenizer(tmp):
        os.makedirs(os.path.join(tmp, "tokenizer"))
        open(os.path.join(tmp, "tokenizer", "tokenizer.json"), "w").write("{}")
    tok = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer"}
    write(tmp_path / "src", cfg, tensors, 1, 1, extra_meta={"tokenizer": tok}, extra_files=add_tokenizer)
    reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"),
                  "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"])
    assert open(tmp_path / "dst" / "tokenizer" / "tokenizer.json").read() == "{}"
    assert read_checkpoint(str(tmp_path / "dst")).meta.tokenizer == tok
    import shutil
    shutil.rmtree(tmp_path / "src" / "tokenizer")
    with pytest.raises(FileNotFoundError, match=r"tokenizer is missing: the checkpoint's metadata.json names it"):
        reshard.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst2"),
                      "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"])
    assert _leftovers(tmp_path, {"src", "dst"}) == []


def test_convert_checkpoint_cli_reshard(tmp_path, capsys):
    import importlib.util
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint_cli", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = tiny_cfg()
    write(tmp_path / "src", cfg, canonical_tensors(cfg), 2, 1)
    argv = ["reshard", "--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"),
            "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]
    assert mod.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["target"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
    assert report["optimizer_state"] is True and report["iteration"] == 7
    assert mod.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: --save {tmp_path / 'dst'} already exists" in err


# ---- loading the layer format into a (DeepSpeed-less) engine: ZeRO 0 fp32 path, and its refusals --------

class _Sched:
    def __init__(self):
        self.state = None

    def load_state_dict(self, state):
        self.state = state


def _engine(cfg):
    from types import SimpleNamespace

    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.training.engine import optimizer_param_groups
    model = GPTModel(cfg, V, None, False, seed=1, device=torch.device("cpu"))
    opt = torch.optim.AdamW(optimizer_param_groups(model, 0.1), lr=1e-3, foreach=False)
    return SimpleNamespace(module=model, optimizer=opt, lr_scheduler=_Sched(), global_steps=0, global_samples=0,
                           skipped_steps=0)


def _load(engine, path, **kw):
    from megatron_ru.training.checkpoint import load_checkpoint
    args = dict(zero_stage=0, load_optim=True, finetune=False)
    args.update(kw)
    return load_checkpoint(engine, str(path), **args)


def test_layer_format_loads_weights_and_zero0_optimizer_state_by_canonical_name(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    write(tmp_path / "ck", cfg, tensors, 1, 1)
    engine = _engine(cfg)
    _assert_loaded(engine, _load(engine, tmp_path / "ck"), tensors)
    assert engine.lr_scheduler.state == {"num_steps": 7}
    engine.optimizer.step()  # the state has the shapes and types torch's AdamW expects


def _assert_loaded(engine, loaded, tensors):
    """Iteration 7 of the writer's Optim(tensors): weights (padding rows zero) and Adam state by name."""
    meta, rng = loaded
    assert meta.iteration == 7 and rng is None and engine.global_steps == 7
    for name, p in engine.module.named_parameters():
        full = tensors[name]
        assert torch.equal(p[: full.shape[0]], full) and torch.count_nonzero(p[full.shape[0]:]) == 0, name
        state = engine.optimizer.state[p]
        assert float(state["step"]) == 7
        assert torch.equal(state["exp_avg"][: full.shape[0]], full * 0.5), name
        assert torch.equal(state["exp_avg_sq"][: full.shape[0]], full * full), name


def test_layer_format_at_another_layout_loads_by_canonical_name(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    for tp, pp in ((2, 1), (1, 2), (2, 2)):  # saved at another TP and/or PP: no reshard step
        write(tmp_path / f"ck{tp}{pp}", cfg, tensors, tp, pp)
        engine = _engine(cfg)
        _assert_loaded(engine, _load(engine, tmp_path / f"ck{tp}{pp}"), tensors)


def test_layer_format_load_refusals(tmp_path):
    cfg = tiny_cfg()
    engine = _engine(cfg)
    write(tmp_path / "ck1", cfg, canonical_tensors(cfg), 1, 1)
    with pytest.raises(CheckpointError, match="--zero-stage 3: a checkpoint written by megatron_ru's checkpoint "
                                              "writer .* loads with ZeRO stage 0, 1 or 2"):
        _load(engine, tmp_path / "ck1", zero_stage=3)
    other = _engine(tiny_cfg(ffn_hidden_size=32))  # another model than the checkpoint's
    with pytest.raises(CheckpointError, match=r"layer_01-model_00-model_states.pt: 'mlp.linear_fc1.weight' has "
                                              r"shape \[96, 32\], this run's parameter has \[64, 32\]"):
        _load(other, tmp_path / "ck1")
    (tmp_path / "ck1" / "iter_0000007" / layer_optim_file(2, 0)).unlink()
    with pytest.raises(CheckpointError, match=r"missing: layer_02-model_00-optim_states.pt.*--no-load-optim"):
        _load(engine, tmp_path / "ck1")
    _load(engine, tmp_path / "ck1", load_optim=False)  # weights only need no optimizer file


def test_reader_takes_an_iteration_directory_and_refuses_zero3(tmp_path):
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)
    write(tmp_path / "ck", cfg, tensors, 2, 1)
    reader = read_checkpoint(str(tmp_path / "ck" / "iter_0000007"))
    assert torch.equal(reader.get("output_layer.weight"), tensors["output_layer.weight"])
    _fake_deepspeed_pp1(tmp_path / "z3", cfg, tensors, tp=1, zero_stage=3)
    with pytest.raises(CheckpointError, match="saved with ZeRO stage 3 .* cannot read offline: resume it at its own "
                                              "layout with --zero-stage 3, or train with --zero-stage 0 or 1"):
        read_checkpoint(str(tmp_path / "z3"))


def test_interrupted_or_full_disk_write_leaves_nothing(tmp_path):
    from megatron_ru.checkpointing.files import CheckpointSaveError
    from tests.fixtures.filesystems import small_tmpfs
    cfg = tiny_cfg()
    tensors = canonical_tensors(cfg)

    def interrupted(name):
        if name.startswith("decoder.layers.2"):
            raise KeyboardInterrupt
        return tensors[name]
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(str(tmp_path / "out"), cfg=cfg, vocab_size=V, tp=1, pp=1, get_tensor=interrupted)
    assert os.listdir(tmp_path) == []
    with small_tmpfs(tmp_path / "small_fs", "200k") as mnt:
        with pytest.raises(CheckpointSaveError, match=r"no space left on tmpfs \(mounted at .*small_fs.*\) while "
                                                      r"writing .*out.tmp-.*\d+/iter_0000007/layer_.*: nothing was "
                                                      r"written under the output name"):
            write(os.path.join(mnt, "out"), cfg, tensors, 2, 2)
        assert os.listdir(mnt) == []


def test_dynamic_loss_scale_carries_over_only_into_a_dynamic_run(tmp_path):
    from types import SimpleNamespace
    cfg = tiny_cfg()

    class Fp16Optim(Optim):
        def common_state(self):
            return {**super().common_state(), "loss_scaler": {"cur_scale": 1024.0, "cur_iter": 5, "dynamic": True}}
    write_checkpoint(str(tmp_path / "ck"), cfg=cfg, vocab_size=V, tp=1, pp=1, iteration=7,
                     get_tensor=canonical_tensors(cfg).__getitem__, optimizer=Fp16Optim(canonical_tensors(cfg)))
    for dynamic, expect in ((True, 1024.0), (False, 1.0)):
        engine = _engine(cfg)
        engine.optimizer.loss_scaler = SimpleNamespace(dynamic=dynamic, cur_scale=1.0 if not dynamic else 65536.0,
                                                       cur_iter=0)
        _load(engine, tmp_path / "ck")
        assert engine.optimizer.loss_scaler.cur_scale == expect
        assert engine.optimizer.loss_scaler.cur_iter == (5 if dynamic else 0)
