"""``--auto-layout``: the planner's best layout chosen at start-up, and a job resubmitted on another number of
ranks choosing again and continuing exactly.

The device memory given (``--gpu-memory-gib``) is just below what pure data parallelism needs on 4 ranks, as the
planner itself predicts it (``python -m megatron_ru.plan ... --device cpu --json -``, the reference the choice
must equal), so the 4-rank job must split the model; the same command on 2 ranks then picks its own layout and
continues the checkpoint. Iterations 1-3 (4 ranks) and 4-6 (2 ranks) equal one process's uninterrupted run (fp32,
1e-5 relative): plainly, with a batch ramp still in progress at the checkpoint, and with ZeRO 1's optimizer state
(--zero-stage 1 given: a constraint the choice keeps)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from megatron_ru.plan.memory import CPU_PROCESS_BYTES
from megatron_ru.plan.search import MEMORY_MARGIN
from tests.dist_utils import run_distributed
from tests.integration._train_helpers import (REPO, TINY_MODEL_FLAGS, make_corpus, relative_diff, tiny_argv, train_body,
                                              without_flags)

pytestmark = pytest.mark.slow

GIB = 2 ** 30
RTOL = 1e-5
CASES = {"plain": [], "ramp": ["--rampup-batch-size", "2", "2", "8"], "zero1": ["--zero-stage", "1"]}
VOCAB = 96  # NullTokenizer --vocab-size 95 and its end-of-document id


def _model_flags(argv: list[str]) -> list[str]:
    """The model flags of ``argv`` (its dropout included: the planner counts the masks), as the planner takes them."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in TINY_MODEL_FLAGS + ("--hidden-dropout", "--attention-dropout"):
            takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            i += 1
    return out


def _planner(argv: list[str], num_gpus: int, memory_gib: float, extra: list[str]) -> dict:
    """The planner CLI's JSON for the tiny model on ``num_gpus`` CPU ranks of ``memory_gib``."""
    from megatron_ru.plan.cli import run
    cli = [*_model_flags(argv), "--vocab-size", str(VOCAB), "--seq-length", "32", "--global-batch-size", "4",
           "--fp32", "--num-gpus", str(num_gpus), "--gpus-per-node", "4", "--gpu-memory-gib", repr(memory_gib),
           "--peak-tflops", "1", "--device", "cpu", "--top", "1000", "--json", "-"]
    if "--rampup-batch-size" in extra:
        i = extra.index("--rampup-batch-size")
        cli += extra[i:i + 4]
    for flag in ("--zero-stage", "--memory-margin"):
        if flag in extra:
            cli += [flag, extra[extra.index(flag) + 1]]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run(cli) == 0
    return json.loads(buf.getvalue())


def auto_body(rank: int, world_size: int, runs: list[list[str]]) -> list[dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ru.plan.auto import parse_with_auto_layout
    from megatron_ru.training.pretrain import run
    out = []
    for argv in runs:
        args = parse_with_auto_layout(argv, world_size=world_size, device_type="cpu")
        result = run(args)
        out.append({"losses": result.losses, "auto": args.auto_layout, "iteration": result.iteration,
                    "layout": (args.tp, args.pp, args.cp, args.dp, args.training.micro_batch_size,
                               args.training.zero_stage)})
    return out


def test_resubmitted_on_fewer_ranks_it_chooses_again_and_continues_exactly(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    base = without_flags(tiny_argv(prefix, cache, iters=6, extra=["--eval-iters", "0"]), "--micro-batch-size")
    commands, expected = {}, {}
    # pure data parallelism (any ZeRO stage) does not fit on 4 ranks; with the ramp it cannot run at all there
    pure_dp = [c["memory_bytes"] for c in _planner(base, 4, 1000.0, [])["fitting"] if c["layout"]["dp"] == 4]
    memory_gib = (min(pure_dp) - 64) / (1 - MEMORY_MARGIN) / GIB  # what a layout may use: 64 bytes short of it
    for name, extra in CASES.items():
        plans = {n: _planner(base, n, memory_gib, extra) for n in (4, 2)}
        for n, plan in plans.items():
            assert plan["best"] is not None, (name, n, plan["rejected"])
        assert all(c["layout"]["dp"] < 4 for c in plans[4]["fitting"]), name
        expected[name] = {n: plan["best"]["flags"] for n, plan in plans.items()}
        save = str(tmp_path / f"ckpt_{name}")
        commands[name] = [*base, *extra, "--auto-layout", "--gpu-memory-gib", repr(memory_gib), "--peak-tflops", "1",
                          "--gpus-per-node", "4", "--save", save, "--load", save, "--exit-interval", "3",
                          "--metrics-file", str(tmp_path / f"{name}.jsonl")]
    first = run_distributed(auto_body, 4, args=(list(commands.values()),), timeout=600)[0]
    second = run_distributed(auto_body, 2, args=(list(commands.values()),), timeout=600)[0]
    refs = run_distributed(train_body, 1, args=([[*base, *extra] for extra in CASES.values()],), timeout=600)[0]
    for (name, extra), a, b, ref in zip(CASES.items(), first, second, refs):
        # exactly the planner's best flags for those inputs, on each number of ranks, the constraint kept
        assert a["auto"]["flags"] == expected[name][4] and b["auto"]["flags"] == expected[name][2], name
        tp, pp, cp, dp, _, zero = a["layout"]
        assert tp * pp * cp > 1 and dp < 4, (name, a["layout"])
        if name == "zero1":
            assert a["layout"][5] == b["layout"][5] == 1 and a["auto"]["constraints"] == ["zero_stage"]
        assert a["iteration"] == 3 and b["iteration"] == 6 and sorted(b["losses"]) == [4, 5, 6], name
        assert relative_diff(a["losses"], {k: ref["losses"][k] for k in (1, 2, 3)}) < RTOL, (name, a, ref)
        assert relative_diff(b["losses"], {k: ref["losses"][k] for k in (4, 5, 6)}) < RTOL, (name, b, ref)
        # recorded in the metrics file (one record per job) and the checkpoint's arguments
        records = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        chosen = [r for r in records if r["type"] == "auto_layout"]
        assert [r["world_size"] for r in chosen] == [4, 2] and chosen[0]["flags"] == expected[name][4]
        meta = json.loads(open(tmp_path / f"ckpt_{name}" / "iter_0000006" / "metadata.json").read())
        assert meta["args"]["resolved"]["auto_layout"]["flags"] == expected[name][2]
    block = first[0]["auto"]["block"]
    assert block.startswith("--auto-layout: 4 ranks, 4 per node") and "chosen:" in block and "runner-up:" in block
    assert "does not fit: TP 1 x PP 1" in block, block


def test_a_job_that_fits_nowhere_is_refused_in_one_line_and_writes_nothing(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    save = tmp_path / "ckpt"
    argv = without_flags(tiny_argv(prefix, cache, iters=6), "--micro-batch-size")
    # 0.00147 GiB left to the model's terms (what a CPU rank holds beyond them added, the margin kept): 2 ranks need
    # 0.001477 GiB each at best, 3 ranks 0.001460
    memory = (0.00147 * GIB + CPU_PROCESS_BYTES) / (1 - MEMORY_MARGIN) / GIB
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv, "--auto-layout", "--gpu-memory-gib", repr(memory),
                           "--peak-tflops", "1", "--gpus-per-node", "4", "--save", str(save),
                           "--metrics-file", str(tmp_path / "m.jsonl")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(lines) == 1 and f"no layout fits 1 x custom ({memory:.4g} GiB)" in lines[0], proc.stderr[-3000:]
    # 2 ranks are not enough; 3 are, as 3 pipeline stages
    assert "the smallest job of these devices it fits is 3 (TP1 PP3 DP1 mb1 recompute ZeRO0, 0.05" in lines[0], lines[0]
    assert not save.exists() and not (tmp_path / "m.jsonl").exists()
    # on a machine without a GPU the device must be named
    from megatron_ru.plan.auto import parse_with_auto_layout
    with pytest.raises(ValueError, match="--auto-layout on a machine without a GPU plans for a device you name"):
        parse_with_auto_layout([*argv, "--auto-layout"], world_size=1, device_type="cpu")
    with pytest.raises(ValueError, match="describe the devices --auto-layout plans for"):
        from megatron_ru.flags.arguments import parse_arguments
        parse_arguments([*argv, "--gpu-memory-gib", "8"], world_size=1, device_type="cpu")
    with pytest.raises(ValueError, match=r"--memory-margin must be a share in \[0, 1\)"):
        parse_arguments([*argv, "--auto-layout", "--gpu-memory-gib", "8", "--peak-tflops", "1", "--memory-margin",
                         "1"], world_size=1, device_type="cpu")


def oom_body(rank: int, world_size: int, argv: list[str]) -> str:
    """The chosen layout's first step runs out of device memory (raised where CUDA raises it: a GPU condition)."""
    import torch

    from megatron_ru.plan.auto import parse_with_auto_layout
    from megatron_ru.training.loop import Trainer
    from megatron_ru.training.pretrain import run

    def out_of_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    Trainer.train_step = out_of_memory
    try:
        run(parse_with_auto_layout(argv, world_size=world_size, device_type="cpu"))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_chosen_layout_that_runs_out_of_memory_says_so_and_names_the_next(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    argv = [*without_flags(tiny_argv(prefix, cache, iters=6), "--micro-batch-size"), "--auto-layout",
            "--gpu-memory-gib", "1", "--peak-tflops", "1", "--gpus-per-node", "2", "--memory-margin", "0.2"]
    message = run_distributed(oom_body, 2, args=(argv,), timeout=300)[0]
    plan = _planner(argv, 2, 1.0, ["--memory-margin", "0.2"])
    best, runner_up = plan["fitting"][0], plan["fitting"][1]
    assert message.startswith(f"--auto-layout's choice ({best['label']}) ran out of memory: predicted "
                              f"{best['memory_bytes'] / GIB:.2f} GiB per device, the peak reached "), message
    assert f"try the runner-up ({runner_up['label']}) with its flags instead of --auto-layout, or a --memory-margin " \
           f"above 0.2" in message, message


def test_megatron_spellings_and_abbreviations_are_what_they_mean(tmp_path):
    """A layout flag in Megatron's spelling is a constraint as ours is, and an abbreviation argparse takes for
    --auto-layout is --auto-layout (it ran on the default layout, unchosen)."""
    from megatron_ru.plan.auto import parse_with_auto_layout
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    argv = [*without_flags(tiny_argv(prefix, cache, iters=6), "--micro-batch-size"), "--gpu-memory-gib", "1",
            "--peak-tflops", "1", "--gpus-per-node", "4"]
    plain = parse_with_auto_layout([*argv, "--auto-layout"], world_size=4, device_type="cpu")
    short = parse_with_auto_layout([*argv, "--auto-lay"], world_size=4, device_type="cpu")
    assert short.auto_layout is not None and short.auto_layout["flags"] == plain.auto_layout["flags"]
    spelled = parse_with_auto_layout([*argv, "--auto-layout", "--recompute-activations", "--use-distributed-optimizer",
                                      "--no-pipeline-parallel"], world_size=4, device_type="cpu")
    ours = parse_with_auto_layout([*argv, "--auto-layout", "--recompute-granularity", "selective", "--zero-stage", "1",
                                   "--pipeline-model-parallel-size", "1"], world_size=4, device_type="cpu")
    assert spelled.auto_layout["constraints"] == ours.auto_layout["constraints"] == [
        "pipeline_model_parallel_size", "recompute_granularity", "zero_stage"]
    assert spelled.auto_layout["flags"] == ours.auto_layout["flags"]
    assert (spelled.pp, spelled.model.recompute_granularity, spelled.training.zero_stage) == (1, "selective", 1)
