"""Resuming with other model flags names each flag and both values, before the model is built (issue 31,
item 8); it used to print one ``size mismatch`` line per tensor from DeepSpeed's loader."""
import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, tiny_argv, train_body, without_flags

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.timeout(300)
def test_resume_with_other_model_flags_names_them(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    save = str(tmp_path / "ckpt")
    first = tiny_argv(prefix, cache, iters=4, extra=["--eval-iters", "0", "--save", save, "--exit-interval", "2"])
    other = without_flags(first, "--hidden-size", "--ffn-hidden-size") + [
        "--hidden-size", "32", "--ffn-hidden-size", "64", "--load", save]
    same_shape = first + ["--load", save, "--hidden-dropout", "0.1"]  # a run choice, not a shape: resumes
    results = run_distributed(train_body, 1, args=([first, ["expect-error", *other], same_shape],), timeout=240,
                              env=ENV)[0]
    message = results[1]["error"]
    assert f"--load {save}: the checkpoint (iteration 2) holds another model than this run builds" in message
    assert "--hidden-size: the checkpoint has 64, this run 32" in message
    assert "--ffn-hidden-size: the checkpoint has 128, this run 64" in message
    assert "size mismatch" not in message and "--use-checkpoint-args" in message
    assert results[2]["iteration"] == 4
