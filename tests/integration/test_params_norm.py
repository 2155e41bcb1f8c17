"""--log-params-norm and the other Megatron-LM logging switches in a real run: the params norm logged at
TP 2 (2 gloo ranks, TP-replicated norms counted once) equals a single-process run's at the same iterations;
at iteration 1 (the warmup's first step has learning rate 0, so the weights are the initial ones) it equals
torch.linalg.vector_norm over a same-seed GPTModel built here; the other tags land in TensorBoard and
metrics.jsonl."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}
FLAGS = ["--log-params-norm", "--log-batch-size-to-tensorboard", "--log-world-size-to-tensorboard",
         "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard"]


def _fresh_model_norm(argv: list[str]) -> float:
    from megatron_ru.flags.arguments import parse_arguments
    from megatron_ru.model.gpt import GPTModel
    from megatron_ru.training.pretrain import model_vocab_size
    args = parse_arguments(argv, world_size=1, device_type="cpu")
    vocab = model_vocab_size(args, args.built_tokenizer().vocab_size)
    model = GPTModel(args.model, vocab, None, False, seed=args.training.seed, device=torch.device("cpu"))
    sq = sum(torch.linalg.vector_norm(p.detach(), dtype=torch.float64) ** 2 for p in model.parameters())
    return math.sqrt(float(sq))


def test_params_norm_tp2_equals_single_process(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    prefix = make_corpus(str(tmp_path))
    base = tiny_argv(prefix, str(tmp_path / "cache"), iters=3,
                     extra=[*FLAGS, "--eval-interval", "3", "--lr-warmup-iters", "2"])
    tp2 = base + ["--tensor-model-parallel-size", "2", "--metrics-file", str(tmp_path / "tp2.jsonl"),
                  "--tensorboard-dir", str(tmp_path / "tb")]
    one = base + ["--metrics-file", str(tmp_path / "one.jsonl")]
    run_distributed(train_body, 2, args=([tp2],), timeout=300, env=ENV)
    run_distributed(train_body, 1, args=([one],), timeout=300, env=ENV)
    recs = {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")] for name in ("tp2", "one")}
    norms = {name: {r["iteration"]: r["params_norm"] for r in rs if r["type"] == "train"} for name, rs in recs.items()}
    assert sorted(norms["tp2"]) == [1, 2, 3]
    for it in (1, 2, 3):
        assert norms["tp2"][it] == pytest.approx(norms["one"][it], rel=1e-5)
    assert norms["one"][2] != norms["one"][1]  # the second step moved the weights
    assert norms["one"][1] == pytest.approx(_fresh_model_norm(one), rel=1e-6)

    train = [r for r in recs["tp2"] if r["type"] == "train"]
    assert all(r["world_size"] == 2 and r["batch_size"] == 4 and r["iteration_time"] > 0
               and r["mem_max_rss_bytes"] > 0 for r in train)
    ev = [r for r in recs["tp2"] if r["type"] == "eval"][-1]
    assert ev["consumed_samples"] == 12
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("params-norm")] == pytest.approx([norms["tp2"][i] for i in (1, 2, 3)],
                                                                          rel=1e-6)
    assert [e.step for e in acc.Scalars("params-norm vs samples")] == [4, 8, 12]
    assert [e.value for e in acc.Scalars("world-size")] == [2.0] * 3
    assert [e.value for e in acc.Scalars("batch-size")] == [4.0] * 3
    assert acc.Scalars("iteration-time")[0].value > 0
    assert acc.Scalars("mem-max-rss-bytes")[0].value > 0
    ppl = acc.Scalars("lm loss validation ppl")
    assert [e.step for e in ppl] == [3]
    assert ppl[0].value == pytest.approx(math.exp(ev["val_loss"]), rel=1e-6)
    assert [e.step for e in acc.Scalars("lm loss validation ppl vs samples")] == [12]
