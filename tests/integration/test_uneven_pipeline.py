"""Pipeline stages with unequal layer counts: 3 transformer layers over PP 2 (2 + 1, DeepSpeed's balanced
partition, the same rule as reshard and import-hf) train to the losses of PP 1, and the checkpoint continues
at PP 1 by a plain --load."""
import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, relative_diff, tiny_argv, train_body, without_flags

pytestmark = pytest.mark.slow


def test_three_layers_over_two_stages(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")

    def argv(pp, iters, *extra):
        base = without_flags(tiny_argv(prefix, cache, iters=iters), "--num-layers")
        return base + ["--num-layers", "3", "--pipeline-model-parallel-size", str(pp), "--zero-stage", "1",
                       "--eval-iters", "0", *extra]
    save = str(tmp_path / "pp2")
    runs = [argv(1, 8), argv(2, 8), argv(2, 8, "--save", save, "--exit-interval", "4"), argv(1, 8, "--load", save)]
    pp1, pp2, first, resumed = run_distributed(train_body, 2, args=(runs,), timeout=600,
                                               env={"DS_ACCELERATOR": "cpu"})[0]
    assert sorted(pp2["losses"]) == list(range(1, 9))
    assert relative_diff(pp2["losses"], pp1["losses"]) <= 1e-5
    assert relative_diff(resumed["losses"], {k: pp1["losses"][k] for k in range(5, 9)}) <= 1e-5
