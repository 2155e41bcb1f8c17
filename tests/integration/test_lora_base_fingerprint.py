"""A LoRA checkpoint records its base by content (a SHA-256 per weight file), not only by path: with
another model of the same shape put at the base's path, the LoRA resume and ``export-hf --lora merge``
used to exit 0 (training on, or merging onto, the wrong weights). Both now refuse, naming the LoRA
checkpoint and the base; with the original base back, both work."""
import json
import os
import shutil

import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import (TINY_MODEL_FLAGS, convert_cli, make_corpus, tiny_argv, train_body,
                                              without_flags)

pytestmark = pytest.mark.slow
ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.timeout(600)
def test_a_replaced_base_is_refused_by_resume_and_export(tmp_path):
    from megatron_ru.training.checkpoint import CheckpointMeta, iteration_dir_name
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    base, other, lora = str(tmp_path / "base"), str(tmp_path / "other"), str(tmp_path / "lora")
    common = ["--eval-iters", "0", "--lr-warmup-iters", "1"]
    cont = without_flags(tiny_argv(prefix, cache, iters=4), *TINY_MODEL_FLAGS, "--seq-length")
    cont += ["--seq-length", "32", "--use-checkpoint-args", "--lora-rank", "4", *common]
    runs = [tiny_argv(prefix, cache, iters=2, extra=[*common, "--save", base]),
            without_flags(tiny_argv(prefix, cache, iters=2, extra=[*common, "--save", other]), "--seed")
            + ["--seed", "8"],
            cont + ["--load", base, "--finetune", "--save", lora, "--exit-interval", "2"]]
    results = run_distributed(train_body, 2, args=(runs,), timeout=400, env=ENV)[0]
    assert results[2]["iteration"] == 2

    meta = CheckpointMeta.read(os.path.join(lora, iteration_dir_name(2)))
    recorded = meta.lora_base["fingerprint"]
    assert meta.lora_base["load"] == os.path.abspath(base) and meta.lora_base["iteration"] == 2
    assert recorded["algorithm"] == "sha256" and recorded["files"]
    assert all(not n.startswith("rng_") and "optim" not in n for n in recorded["files"])

    # another model of the same shape at the base's path
    shutil.move(base, str(tmp_path / "original"))
    shutil.copytree(other, base)
    resume = cont + ["--load", lora, "--save", lora]
    (error,) = run_distributed(train_body, 2, args=([["expect-error", *resume]],), timeout=300, env=ENV)[0]
    message = error["error"]
    assert lora in message and os.path.abspath(base) in message and "is not that base" in message, message
    proc = convert_cli("export-hf", "--load", lora, "--save", str(tmp_path / "hf"), "--lora", "merge")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is not that base" in proc.stderr and lora in proc.stderr and os.path.abspath(base) in proc.stderr
    assert not os.path.exists(tmp_path / "hf")

    # the original base back: both work
    shutil.rmtree(base)
    shutil.move(str(tmp_path / "original"), base)
    proc = convert_cli("export-hf", "--load", lora, "--save", str(tmp_path / "hf"), "--lora", "merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (done,) = run_distributed(train_body, 2, args=([resume],), timeout=300, env=ENV)[0]
    assert done["iteration"] == 4
    saved = CheckpointMeta.read(os.path.join(lora, iteration_dir_name(4)))
    assert saved.lora_base == meta.lora_base  # the record is carried, fingerprint included
    assert json.loads(json.dumps(saved.lora_base)) == saved.lora_base
