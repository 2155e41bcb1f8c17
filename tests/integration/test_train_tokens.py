"""Megatron-DeepSpeed's token budget and token schedule in a real run: an iteration warmup with a token decay
(--lr-warmup-iters 2 + --lr-decay-tokens) gives MDS's learning rate at every iteration, and --train-tokens ends
the run (saved, as at the end of training) at the first iteration whose consumed tokens reach it."""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body

pytestmark = pytest.mark.slow

TOKENS_PER_STEP = 4 * 32  # --global-batch-size 4 x --seq-length 32


def _mds_lr(tokens, max_lr=3e-3, min_lr=3e-4, warmup_tokens=2 * TOKENS_PER_STEP, decay_tokens=1000):
    """MDS's get_lr with a 2-iteration warmup (its last step records 256 tokens) and a token cosine decay."""
    if tokens <= warmup_tokens:
        return max_lr * tokens / warmup_tokens
    if tokens > decay_tokens:
        return min_lr
    r = (tokens - warmup_tokens) / (decay_tokens - warmup_tokens)
    return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (max_lr - min_lr)


@pytest.mark.timeout(600)
def test_train_tokens_stops_and_the_token_decay_is_mds(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    save, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    argv = tiny_argv(prefix, cache, iters=10, extra=["--eval-iters", "0", "--lr-decay-tokens", "1000",
                                                     "--train-tokens", "700", "--save", save,
                                                     "--metrics-file", str(metrics)])
    result = run_distributed(train_body, 1, args=([argv],), timeout=600, env={"DS_ACCELERATOR": "cpu"})[0][0]
    # 5 x 128 = 640 < 700 <= 6 x 128
    assert result["iteration"] == 6 and result["exit_reason"] == "--train-tokens 700"
    assert result["saved"] == [6] and os.path.isdir(os.path.join(save, "iter_0000006"))
    rows = [r for r in map(json.loads, open(metrics)) if r.get("type") == "train"]
    lrs = {r["iteration"]: r["lr"] for r in rows}
    # iteration i trains at the schedule's position after i - 1 steps
    assert lrs == pytest.approx({i: _mds_lr((i - 1) * TOKENS_PER_STEP) for i in range(1, 7)}, rel=1e-9)
    assert rows[-1]["consumed_tokens"] == 6 * TOKENS_PER_STEP
