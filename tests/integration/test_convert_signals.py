"""``convert_checkpoint.py`` ended by a signal leaves nothing behind (issue 31, item 9): SIGTERM used to
leave ``<save>.tmp-PID`` (85 MB for one import) that no later run removed."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron_ru.utils.staging import remove_stale_temporaries
from tests.integration._train_helpers import REPO
from tests.integration.schedulers.system import wait_for_exit, wait_while_running

pytestmark = pytest.mark.slow


def _big_llama(path: str) -> None:
    """A randomly initialised Llama of ~25M parameters (100 MB in fp32): its import takes a while."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


@pytest.mark.timeout(300)
def test_sigterm_mid_import_removes_the_temporary_output(tmp_path):
    hf, outputs, log = str(tmp_path / "hf"), tmp_path / "outputs", tmp_path / "convert.txt"
    _big_llama(hf)
    outputs.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "tools/convert_checkpoint.py", "import-hf", "--load", hf, "--save",
                                 str(outputs / "out"), "--target-tensor-parallel-size", "2"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_while_running(proc, lambda: any(".tmp-" in n for n in os.listdir(outputs)), 120,
                           "the writer's temporary output", log.read_text, interval=0.01)
        proc.send_signal(signal.SIGTERM)
        code = wait_for_exit(proc, 120, "exit after SIGTERM", log.read_text)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, log.read_text()
    assert "terminated (SIGTERM); nothing was written under the output name" in log.read_text()
    assert os.listdir(outputs) == [], os.listdir(outputs)


def test_a_later_run_removes_temporaries_whose_writer_is_gone(tmp_path):
    save = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = [tmp_path / f"out.tmp-{host}-{dead.pid}", tmp_path / f"out.tmp-{dead.pid}"]  # this format, the older one
    kept = [tmp_path / f"out.tmp-{host}-{os.getpid()}",           # a writer that still runs
            tmp_path / f"out.tmp-other-node-{dead.pid}",          # another host's: its pids mean nothing here
            tmp_path / "outer.tmp-1", tmp_path / f"out.old-{dead.pid}"]
    for d in stale + kept:
        d.mkdir()
        (d / "layer_00-model_00-model_states.pt").write_bytes(b"x" * 100)
    assert sorted(remove_stale_temporaries(str(save))) == sorted(str(p) for p in stale)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in kept)
