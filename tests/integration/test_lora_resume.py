"""LoRA acceptance 4 and the adapter checkpoints: at TP = 2 x PP = 2, 8 iterations in one go vs 4 +
stop + resume + 4 give identical losses and adapters (fp32, dropout on in the adapters and the
model); the checkpoints of a run started from a base checkpoint hold only the trained tensors plus a
reference to the base (a fraction of the base's bytes), read back at any layout through it; a missing
base is a clear error. Without dropout, the adapters' checkpoint continues by a plain --load at (TP, PP, DP) =
(1, 2, 2) ZeRO 1, (2, 1, 2) ZeRO 2 and (1, 1, 4) ZeRO 0, equal to the uninterrupted run."""
import os
import shutil

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import (TINY_MODEL_FLAGS, make_corpus, relative_diff, tiny_argv, train_body,
                                              without_flags)

pytestmark = pytest.mark.slow
ENV = {"DS_ACCELERATOR": "cpu"}


def _model_bytes(ckpt_iter_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(ckpt_iter_dir, f)) for f in os.listdir(ckpt_iter_dir)
               if "model" in f and f.endswith(".pt"))


def test_lora_resume_is_exact_and_stores_only_the_adapters(tmp_path):
    from megatron_ru.inference.model_io import open_model
    from megatron_ru.training.checkpoint import CheckpointMeta, iteration_dir_name
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    base = str(tmp_path / "base")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    lora = ["--lora-rank", "4", "--lora-dropout", "0.1", "--use-dora", "--lora-init", "random",
            "--lora-modules-to-save", "output_layer", "--hidden-dropout", "0.1", "--eval-iters", "0", "--zero-stage",
            "1"]
    # the base: a few full iterations, saved (by canonical name) at this layout
    runs = [tiny_argv(prefix, cache, iters=3, extra=[*layout, "--eval-iters", "0", "--save", base])]
    cont = without_flags(tiny_argv(prefix, cache, iters=8), *TINY_MODEL_FLAGS, "--seq-length")
    cont += ["--seq-length", "32", "--use-checkpoint-args", *layout, *lora]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    runs.append(cont + ["--load", base, "--finetune", "--save", full])
    runs.append(cont + ["--load", base, "--finetune", "--save", part, "--exit-interval", "4"])
    runs.append(without_flags(cont, "--lora-rank", "--lora-dropout", "--use-dora", "--lora-init",
                              "--lora-modules-to-save") + ["--load", part, "--save", part])
    # without dropout, a plain --load of the adapters' checkpoint at another layout (TP 1 x PP 2 x DP 2)
    # continues the uninterrupted run (random states are re-seeded there, so dropout would differ)
    nodrop = without_flags(cont, "--lora-dropout", "--hidden-dropout") + ["--lora-dropout", "0", "--hidden-dropout", "0"]
    full0, part0 = str(tmp_path / "full0"), str(tmp_path / "part0")
    runs.append(nodrop + ["--load", base, "--finetune", "--save", full0])
    runs.append(nodrop + ["--load", base, "--finetune", "--save", part0, "--exit-interval", "4"])
    elsewhere = ((1, 2, "1"), (2, 1, "2"), (1, 1, "0"))  # (TP, PP, ZeRO stage); DP = 4 / (TP x PP)
    for tp, pp, zero in elsewhere:
        runs.append(without_flags(nodrop, "--lora-rank", "--lora-dropout", "--use-dora", "--lora-init",
                                  "--lora-modules-to-save", "--tensor-model-parallel-size",
                                  "--pipeline-model-parallel-size", "--zero-stage")
                    + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                       "--zero-stage", zero, "--load", part0])
    results = run_distributed(train_body, 4, args=(runs,), timeout=900, env=ENV)[0]
    _, one_go, first, second, one_go0, _, *moved = results
    for layout, cont in zip(elsewhere, moved):
        assert cont["iteration"] == 8, layout
        assert relative_diff({k: cont["losses"][k] for k in range(5, 9)},
                             {k: one_go0["losses"][k] for k in range(5, 9)}) <= 5e-7, layout
    assert first["iteration"] == 4 and second["iteration"] == 8
    assert [first["losses"][k] for k in range(1, 5)] == [one_go["losses"][k] for k in range(1, 5)]
    assert [second["losses"][k] for k in range(5, 9)] == [one_go["losses"][k] for k in range(5, 9)]

    meta = CheckpointMeta.read(os.path.join(part, iteration_dir_name(8)))
    assert {k: meta.lora_base[k] for k in ("load", "iteration")} == {"load": os.path.abspath(base), "iteration": 3}
    assert meta.lora_base["fingerprint"]["files"]  # the base by content too (test_lora_base_fingerprint.py)
    assert meta.model_args["lora"]["rank"] == 4
    small = _model_bytes(os.path.join(part, iteration_dir_name(8)))
    assert small < 0.5 * _model_bytes(os.path.join(base, iteration_dir_name(3)))
    a, b = open_model(full), open_model(part)
    for name in a.names():
        assert torch.equal(a.get(name), b.get(name)), name   # frozen tensors come from the base
    frozen = "decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(b.get(frozen), open_model(base).get(frozen))

    shutil.move(base, str(tmp_path / "moved"))
    with pytest.raises(Exception) as e:
        open_model(part).get(frozen)
    assert "lora_base" in str(e.value) and os.path.abspath(base) in str(e.value)
