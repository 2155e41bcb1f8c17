"""Item 2 of issue 33: every tool answers a misspelt flag with one line and the closest flag."""
import os
import subprocess
import sys

import pytest

from tests.integration._train_helpers import REPO

pytestmark = pytest.mark.slow

#: command (relative to the repository) -> a misspelt flag and the flag it stands for
TOOLS = {
    "pretrain_gpt.py": ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    "tools/adapt_vocab.py": ("--new-tokeniser", "--new-tokenizer"),
    "tools/check_megatron_format.py": ("--megatron-pth", "--megatron-path"),
    "tools/convert_checkpoint.py import-hf": ("--target-tensor-paralel-size", "--target-tensor-parallel-size"),
    "tools/convert_checkpoint.py export-hf": ("--max-shard-sise", "--max-shard-size"),
    "tools/convert_checkpoint.py reshard": ("--target-pipline-parallel-size", "--target-pipeline-parallel-size"),
    "tools/dataset_info.py": ("--data-pth", "--data-path"),
    "tools/evaluate.py": ("--group-by-kye", "--group-by-key"),
    "tools/generate.py": ("--max-new-tokns", "--max-new-tokens"),
    "tools/plan_layout.py": ("--num-atention-heads", "--num-attention-heads"),
    "tools/plot_metrics.py": ("--metric-file", "--metrics-file"),
    "tools/preprocess_data.py": ("--tokenizer-modle", "--tokenizer-model"),
    "tools/propagate_embeddings.py": ("--instrcut", "--instruct"),
    "tools/train_tokenizer.py": ("--vocab-sise", "--vocab-size"),
    "-m megatron_ru.parallel.env": ("--pipeline-model-paralel-size", "--pipeline-model-parallel-size"),
    "-m megatron_ru.parallel.state": ("--wrld-size", "--world-size"),
    "-m megatron_ru.data.builder": ("--train-smaples", "--train-samples"),
    "examples/demo.py": ("--corpus-mbb", "--corpus-mb"),
    "examples/adapt_language.py": ("--scael", "--scale"),
    "examples/adapt_real.py": ("--twin-itres", "--twin-iters"),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_misspelt_flag_is_one_line_with_a_suggestion(tool):
    typo, meant = TOOLS[tool]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, *tool.split(), typo, "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"error: unknown flag {typo}; did you mean {meant}?\n"
    assert proc.stdout == ""
