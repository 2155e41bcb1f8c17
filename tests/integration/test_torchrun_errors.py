"""Item 1 of issue 33: under torchrun our one-line error is what the user reads.

``python -m megatron_ru.launch`` (torchrun's flags, torchrun's code) ends a failed job on the failing
worker's own line and its exit status (2 for a bad flag or input); bare torchrun shows that line in
its failure report (torch's elastic error file) instead of "To enable traceback", and exits 1."""
import os
import subprocess
import sys

import pytest

from tests.dist_utils import free_port
from tests.integration._train_helpers import REPO

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
TYPO = "error: unknown flag --tensor-model-paralel-size; did you mean --tensor-model-parallel-size?"


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{env.get('PATH', '')}", "PYTHONPATH": REPO})
    env.pop("DS_ACCELERATOR", None)  # as a user's shell has it
    return env


def _run(launcher, *argv):
    cmd = [*launcher, "--nproc-per-node", "2", "--master-port", str(free_port()), *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    return proc.returncode, (proc.stdout + proc.stderr).rstrip().splitlines()


LAUNCH = [sys.executable, "-m", "megatron_ru.launch"]


def test_launch_ends_on_our_line_with_status_2():
    code, lines = _run(LAUNCH, "pretrain_gpt.py", "--tensor-model-paralel-size", "1")
    assert code == 2, lines[-20:]
    assert lines[-1] == TYPO
    assert not any("Traceback" in line or "ChildFailedError" in line for line in lines), lines
    assert not any("Setting accelerator" in line for line in lines), lines  # DeepSpeed's notice: debug only


def test_launch_ends_on_a_validation_error_and_a_missing_checkpoint():
    code, lines = _run(LAUNCH, "pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "3", "--seq-length", "16",
                       "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
                       "--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                       "--data-path", "/nonexistent/corpus_text_document")
    assert code == 2, lines[-20:]
    start = max(i for i, line in enumerate(lines) if line.startswith("error: invalid configuration"))
    assert any("--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)" in line
               for line in lines[start:])
    assert any("--data-path: dataset '/nonexistent/corpus_text_document' not found" in line for line in lines[start:])
    code, lines = _run(LAUNCH, "tools/generate.py", "--load", "/nonexistent/ckpt", "--prompt", "x")
    assert code == 2, lines[-20:]
    assert lines[-1] == "error: tools/generate.py: --load /nonexistent/ckpt: no such directory"


def test_bare_torchrun_reports_our_line_as_the_root_cause():
    code, lines = _run([os.path.join(BIN, "torchrun")], "pretrain_gpt.py", "--tensor-model-paralel-size", "1")
    assert code == 1  # torchrun's own status for any failed worker (docs/cluster.md)
    text = "\n".join(lines)
    root = text[text.index("Root Cause (first observed failure):"):]
    assert "exitcode  : 2" in root
    assert f"traceback : {TYPO[len('error: '):]}" in root
    assert "To enable traceback" not in text
