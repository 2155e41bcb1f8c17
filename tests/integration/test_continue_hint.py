"""Item 9 of issue 33: the command that ``convert_checkpoint.py import-hf`` prints runs as printed
(the dataset prefix filled in) at the checkpoint's layout, with the tokenizer from the checkpoint;
after ``reshard`` the printed command resumes at the checkpoint's iteration (no --finetune)."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.dist_utils import free_port
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import make_hf_tokenizer_dir, sample_texts
from tests.integration._train_helpers import REPO

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
#: a short run instead of the printed 1,000 iterations (later flags win in argparse)
SHORT = ["--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2", "--eval-iters", "1",
         "--save-interval", "2", "--log-interval", "1"]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PATH": f"{BIN}:{env.get('PATH', '')}", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    return env


def _run(argv, timeout=300):
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}\n{proc.stderr[-4000:]}"
    return proc


def _printed_command(proc):
    *_, note, command = proc.stderr.rstrip().splitlines()
    assert note.startswith("continue with (")
    return note, shlex.split(command)


def test_the_printed_commands_run(tmp_path):
    tok = make_hf_tokenizer_dir(str(tmp_path), vocab=500)
    hf = tiny_llama(str(tmp_path / "hf"), 500, tokenizer_dir=tok)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in sample_texts(150, seed=1)),
                      encoding="utf-8")
    ckpt = str(tmp_path / "ckpt")
    note, argv = _printed_command(_run([sys.executable, "tools/convert_checkpoint.py", "import-hf", "--load", hf,
                                        "--save", ckpt, "--target-pipeline-parallel-size", "2", "--dtype", "fp32"]))
    assert argv[:4] == ["torchrun", "--nproc-per-node", "2", "pretrain_gpt.py"]
    assert "--tokenizer-model" not in argv and "--finetune" in argv
    assert "2 ranks hold one copy of the model" in note
    # the README's step 2: tokenize with the checkpoint's own tokenizer
    prefix = str(tmp_path / "ru")
    _run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", prefix,
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.join(ckpt, "tokenizer"),
          "--append-eod", "--workers", "1"])
    argv[argv.index("DATA_PREFIX")] = prefix + "_text_document"
    argv[1:1] = ["--master-port", str(free_port())]
    out = _run(argv + SHORT).stderr
    assert "TP 1 x PP 2 x DP 1 = 2 ranks" in out and "finished at iteration 2 (done)" in out, out[-3000:]

    # reshard the trained checkpoint to one rank; the printed command (without --finetune) resumes it
    saved, one = ckpt + "-cpt", str(tmp_path / "one")
    note, argv = _printed_command(_run([sys.executable, "tools/convert_checkpoint.py", "reshard", "--load", saved,
                                        "--save", one, "--target-tensor-parallel-size", "1",
                                        "--target-pipeline-parallel-size", "1"]))
    assert argv[:2] == ["python", "pretrain_gpt.py"] and argv[-1] == "..." and "--finetune" not in argv
    assert "without --finetune" in note
    argv[:1] = [sys.executable]
    out = _run(argv[:-1] + ["--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
                            "--lr", "3e-5", "--data-path", prefix + "_text_document", "--split", "990,10,0",
                            *SHORT, "--train-iters", "3", "--save", one]).stderr
    assert "training from iteration 2 to 3" in out and "finished at iteration 3 (done)" in out, out[-3000:]
