"""Exit paths and parameter freezing: SIGTERM with --exit-signal-handler saves and exits 0;
--train-only-embeddings / --freeze choose what the optimizer updates."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_ru.training.checkpoint import read_latest_iteration
from tests.integration._train_helpers import REPO, VOCAB, make_corpus, tiny_argv, trained_iterations
from tests.integration.schedulers.system import wait_for_exit, wait_while_running

pytestmark = pytest.mark.slow


def test_sigterm_saves_and_exits_zero(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    metrics, save = tmp_path / "m.jsonl", str(tmp_path / "ckpt")
    args = tiny_argv(prefix, cache, iters=10000, extra=["--eval-iters", "0", "--metrics-file", str(metrics),
                                                        "--save", save, "--exit-signal-handler"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = tmp_path / "out.txt"
    with open(log, "w") as out_file:
        proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=env, stdout=out_file,
                                stderr=subprocess.STDOUT)
    try:
        wait_while_running(proc, lambda: trained_iterations(metrics) >= 2, 180, "2 iterations trained",
                           log.read_text, interval=0.3)
        proc.send_signal(signal.SIGTERM)
        wait_for_exit(proc, 120, "exit after SIGTERM", log.read_text)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "exiting at iteration" in out and "exit signal" in out
    last = [json.loads(x) for x in open(metrics)][-1]["iteration"]
    assert read_latest_iteration(save) == last >= 2
    meta = json.load(open(os.path.join(save, f"iter_{last:07d}", "metadata.json")))
    assert meta["iteration"] == last and meta["consumed_train_samples"] == 4 * last


def test_train_only_embeddings_and_freeze_patterns():
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.training.engine import build_optimizer
    from megatron_ru.training.freeze import apply_freezing
    args = parse_arguments(tiny_argv("/nonexistent", "/tmp"), world_size=1, device_type="cpu", validate=False)
    model = GPTModel(args.model, VOCAB - 1)
    frozen = apply_freezing(model, args.model, train_only_embeddings=True)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert len(frozen) == len(list(model.parameters())) - 2
    opt = build_optimizer(model, args.optimizer)
    assert sum(len(g["params"]) for g in opt.param_groups) == 2

    model = GPTModel(args.model, VOCAB - 1)
    apply_freezing(model, args.model, freeze=["decoder.layers.0.*", "*final_layernorm*"])
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert names and all(n.startswith("decoder.layers.0.") or "final_layernorm" in n for n in names)
    assert any(n.startswith("decoder.layers.1.") for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="--freeze pattern 'decoder.layer.0.*' matches no parameter"):
        apply_freezing(model, args.model, freeze=["decoder.layer.0.*"])
    # pipeline stages name layers by index; the patterns still use the canonical names
    from megatron_ru.model.gpt import pipeline_layers
    layers = torch.nn.Sequential(*[spec.build() for spec in pipeline_layers(args.model, VOCAB - 1)])
    apply_freezing(layers, args.model, train_only_embeddings=True)
    trainable = sorted(n for n, p in layers.named_parameters() if p.requires_grad)
    assert trainable == ["0.word_embeddings.weight", f"{len(layers) - 1}.weight"]
    layers = torch.nn.Sequential(*[spec.build() for spec in pipeline_layers(args.model, VOCAB - 1)])
    frozen = apply_freezing(layers, args.model, freeze=["decoder.layers.1.*", "output_layer.weight"])
    assert sorted(frozen) == sorted(n for n, _ in model.named_parameters()
                                    if n.startswith("decoder.layers.1.") or n == "output_layer.weight")
    assert sorted(n for n, p in layers.named_parameters() if not p.requires_grad) == \
        sorted(n for n, _ in layers.named_parameters() if n.startswith("2.") or n == f"{len(layers) - 1}.weight")
    # nothing trainable left in the whole model is a clear error, not a DeepSpeed crash
    with pytest.raises(ValueError, match=r"--freeze \* leaves nothing to train in the whole model"):
        apply_freezing(GPTModel(args.model, VOCAB - 1), args.model, freeze=["*"])
    # a pipeline stage left with nothing to train keeps its smallest parameter in the optimizer, with a
    # zero gradient and no weight decay (other stages train: DeepSpeed steps every stage's optimizer)
    from megatron_ru.training.freeze import ANCHOR_ATTR, keep_optimizer_busy
    stage = torch.nn.Sequential(*[spec.build() for spec in pipeline_layers(args.model, VOCAB - 1)[2:4]])
    for p in stage.parameters():
        p.requires_grad_(False)
    keep_optimizer_busy(list(stage.named_parameters()))
    (anchor,) = [p for p in stage.parameters() if p.requires_grad]
    assert getattr(anchor, ANCHOR_ATTR) and anchor.numel() == min(p.numel() for p in stage.parameters())
    opt = build_optimizer(stage, args.optimizer)
    assert [[p is anchor for p in g["params"]] for g in opt.param_groups] == [[True]]
    assert opt.param_groups[0]["weight_decay"] == 0.0
    before = anchor.detach().clone()
    anchor.sum().mul(3.0).backward()
    assert torch.equal(anchor.grad, torch.zeros_like(anchor))
    opt.step()
    assert torch.equal(anchor, before)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_during_start_up_saves_after_the_first_iteration(tmp_path, signum):
    """The signal arrives while the process still imports torch (before any log line): the handler
    is already installed, training stops after its first iteration with a checkpoint, exit 0."""
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    save, out_path = str(tmp_path / "ckpt"), tmp_path / "out.txt"
    args = tiny_argv(prefix, cache, iters=10000, extra=["--eval-iters", "0", "--save", save,
                                                        "--exit-signal-handler"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        # as soon as a handler exists, or (before the fix) the first log line shows start-up is under way
        wait_while_running(proc, lambda: _catches(proc.pid, signum) or out_path.read_text(), 60,
                           f"a handler for {signum.name} or a first log line", out_path.read_text, interval=0.02)
        proc.send_signal(signum)
        before = out_path.read_text()
        wait_for_exit(proc, 180, f"exit after {signum.name}", out_path.read_text)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out_path.read_text()
    assert "training from iteration" not in before  # the signal came during start-up
    assert proc.returncode == 0, text[-3000:]
    assert "exiting at iteration 1: exit signal" in text, text[-3000:]
    assert read_latest_iteration(save) == 1
