"""A continued run with a new learning-rate schedule (the case users trip over: Megatron-LM stops or, with
--override-opt-param-scheduler's long-standing bugs, quietly keeps the old one): resumed at another layout, the
learning rate of every iteration is the new flags' schedule (a WSD one here), computed independently; with
--use-checkpoint-opt-param-scheduler it is the checkpoint's."""
from __future__ import annotations

import json
import math

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body

pytestmark = pytest.mark.slow


def _lrs(path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, open(path)) if r.get("type") == "train"}


def _cosine(step, max_lr=3e-3, min_lr=3e-4, warmup=2, decay=8):
    if step <= warmup:
        return max_lr * step / warmup
    r = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (max_lr - min_lr)


def _wsd_linear(step, max_lr=1e-3, min_lr=1e-4, decay=8, wsd=3):
    start = decay - wsd
    return max_lr if step <= start else min_lr + (1 - (step - start) / wsd) * (max_lr - min_lr)


@pytest.mark.timeout(600)
def test_a_new_schedule_is_followed_after_a_resume_at_another_layout(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    base = str(tmp_path / "base")
    first = tiny_argv(prefix, cache, iters=8, extra=["--zero-stage", "1", "--eval-iters", "0", "--save", base,
                                                     "--exit-interval", "4", "--metrics-file",
                                                     str(tmp_path / "first.jsonl")])
    new_flags = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear",
                 "--lr-wsd-decay-iters", "3", "--lr-warmup-iters", "0"]

    def resumed(name, *extra):
        argv = tiny_argv(prefix, cache, iters=8, extra=["--tensor-model-parallel-size", "2", "--eval-iters", "0",
                                                        "--zero-stage", "1", "--load", base, "--save",
                                                        str(tmp_path / name), "--metrics-file",
                                                        str(tmp_path / f"{name}.jsonl"), *extra])
        return argv
    results = run_distributed(train_body, 2, args=([first, resumed("flags", *new_flags),
                                                    resumed("kept", *new_flags, "--use-checkpoint-opt-param-scheduler")],),
                              timeout=600, env={"DS_ACCELERATOR": "cpu"})[0]
    assert [r["iteration"] for r in results] == [4, 8, 8]
    # DeepSpeed steps the scheduler after each update: iteration i trains at the schedule's step i - 1
    first_lrs = _lrs(tmp_path / "first.jsonl")
    assert first_lrs == pytest.approx({i: _cosine(i - 1) for i in range(1, 5)}, rel=1e-9)
    assert _lrs(tmp_path / "flags.jsonl") == pytest.approx({i: _wsd_linear(i - 1) for i in range(5, 9)}, rel=1e-9)
    assert _lrs(tmp_path / "kept.jsonl") == pytest.approx({i: _cosine(i - 1) for i in range(5, 9)}, rel=1e-9)
