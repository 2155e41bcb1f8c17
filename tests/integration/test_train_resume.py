"""Acceptance 2: 12 iterations in one go vs 6 + stop + resume + 6: iterations 7-12 identical
(fp32, CPU), for PP = 1 (DP = 2, ZeRO 1, 2 and 3) and PP = 2 layouts, with dropout on (RNG restored) and
evaluations in between (validation position restored)."""
import json
import os

import pytest

from megatron_ru.training.checkpoint import CheckpointMeta, read_latest_iteration
from megatron_ru.checkpointing.files import derive_expected, list_files
from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body

pytestmark = pytest.mark.slow


def test_resume_is_exact_for_pp1_and_pp2(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    # pp2 also keeps only the newest checkpoint (--keep-last 1)
    layouts = {"pp1": ["--zero-stage", "1"], "pp2": ["--pipeline-model-parallel-size", "2", "--keep-last", "1"],
               "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"]}
    runs = []
    for name, layout in layouts.items():
        save = str(tmp_path / name)
        extra = [*layout, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-interval", "4",
                 "--eval-iters", "1"]
        runs.append(tiny_argv(prefix, cache, iters=12, extra=extra))
        runs.append(tiny_argv(prefix, cache, iters=12, extra=[*extra, "--save", save, "--exit-interval", "6",
                                                              "--metrics-file", str(tmp_path / f"{name}.jsonl")]))
        runs.append(tiny_argv(prefix, cache, iters=12, extra=[*extra, "--save", save, "--load", save,
                                                              "--metrics-file", str(tmp_path / f"{name}.jsonl")]))
    pp1, pp2 = str(tmp_path / "pp1"), str(tmp_path / "pp2")
    # weights only: --finetune restarts at iteration 0; --no-load-optim keeps the position
    runs.append(tiny_argv(prefix, cache, iters=3, extra=["--zero-stage", "1", "--load", pp1, "--finetune"]))
    runs.append(tiny_argv(prefix, cache, iters=14, extra=["--zero-stage", "1", "--load", pp1, "--no-load-optim"]))
    # another pipeline layout: the PP 2 checkpoint continues at PP 1 by a plain --load
    runs.append(tiny_argv(prefix, cache, iters=14, extra=["--load", pp2]))
    # a time limit: both ranks agree to stop after the first iteration and save
    runs.append(tiny_argv(prefix, cache, iters=50, extra=["--exit-duration-in-mins", "1e-6", "--eval-iters", "0",
                                                          "--save", str(tmp_path / "timed")]))
    results = run_distributed(train_body, 2, args=(runs,), timeout=600, env={"DS_ACCELERATOR": "cpu"})[0]
    finetune, no_optim, other_layout, timed = results[3 * len(layouts):]
    assert timed["iteration"] == 1 and timed["exit_reason"] == "--exit-duration-in-mins 1e-06"
    assert timed["saved"] == [1] and read_latest_iteration(str(tmp_path / "timed")) == 1
    assert sorted(finetune["losses"]) == [1, 2, 3]
    assert finetune["losses"][1] < results[0]["losses"][1] - 0.2  # starts from the trained weights
    assert sorted(no_optim["losses"]) == [13, 14]
    assert sorted(other_layout["losses"]) == [13, 14]
    for i, name in enumerate(layouts):
        full, first, second = results[3 * i: 3 * i + 3]
        assert first["iteration"] == 6 and sorted(first["losses"]) == list(range(1, 7))
        assert sorted(second["losses"]) == list(range(7, 13))
        assert [first["losses"][k] for k in range(1, 7)] == [full["losses"][k] for k in range(1, 7)]
        assert [second["losses"][k] for k in range(7, 13)] == [full["losses"][k] for k in range(7, 13)], name
        full_evals = {e["iteration"]: e["val_loss"] for e in full["evals"]}
        resumed = {e["iteration"]: e["val_loss"] for e in first["evals"] + second["evals"]}
        assert resumed == full_evals and sorted(full_evals) == [4, 8, 12]
        assert read_latest_iteration(str(tmp_path / name)) == 12
        recs = [json.loads(x) for x in open(tmp_path / f"{name}.jsonl")]
        assert [r["iteration"] for r in recs if r["type"] == "train"] == list(range(1, 13))
        assert os.path.isdir(tmp_path / name / "iter_0000006") == (name != "pp2")
        assert os.path.isdir(tmp_path / name / "iter_0000012")
        # metadata.json lists every file with its size; the list derived for older checkpoints agrees
        ckpt_dir = str(tmp_path / name / "iter_0000012")
        meta = CheckpointMeta.read(ckpt_dir)
        assert meta.files == list_files(ckpt_dir), name
        # training writes tensors by canonical name; ZeRO 3's state exists only in DeepSpeed's files
        assert meta.format == (None if name == "zero3" else "megatron_ru.layers"), name
        if meta.format is None:
            assert sorted(derive_expected(meta.tensor_model_parallel_size, meta.pipeline_model_parallel_size,
                                          meta.data_parallel_size, meta.zero_stage, meta.files)) == sorted(meta.files)
