"""The planner on a cluster's login node (no GPU, DS_ACCELERATOR unset), where people plan: under ``--json -``
its stdout is the JSON and nothing else, whichever way the model is given (flags, a Hugging Face config.json,
a checkpoint's recorded arguments), and it imports neither DeepSpeed (whose import prints its accelerator
choice on stdout) nor torch's compiler (seconds of start-up for nothing)."""
import json
import os
import subprocess
import sys

import pytest

from megatron_ru.config.model import ModelConfig
from tests.integration._train_helpers import REPO

pytestmark = pytest.mark.slow

# run the planner as `python -m megatron_ru.plan` does, then say which heavy modules it imported
WRAPPER = """
import runpy, sys
sys.argv = ["megatron_ru.plan", *sys.argv[1:]]
try:
    runpy.run_module("megatron_ru.plan", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("deepspeed", "torch._dynamo", "torch._inductor") if m in sys.modules)
print("IMPORTED " + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _login_node_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    return env


def _plan(argv: list) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *argv, "--json", "-"], cwd=REPO, env=_login_node_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = [ln for ln in proc.stderr.splitlines() if ln.startswith("IMPORTED ")]
    return json.loads(proc.stdout), imported[-1][len("IMPORTED "):]


def test_flags(tmp_path):
    # the flags of the report: a SwiGLU/RMSNorm model in fp32, pipeline layouts among the candidates
    plan, imported = _plan(["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
                            "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "32000",
                            "--swiglu", "--normalization", "RMSNorm", "--fp32", "--num-gpus", "8",
                            "--global-batch-size", "16", "--gpu-memory-gib", "16", "--peak-tflops", "100",
                            "--top", "1000"])
    assert plan["model"]["source"] == "flags" and plan["best"]["flags"]
    assert any(row["layout"]["pp"] > 1 for row in plan["fitting"]), [r["layout"] for r in plan["fitting"]]
    assert imported == ""


def test_hf_config_and_checkpoint(tmp_path):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
          "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    plan, imported = _plan(["--hf-config", str(tmp_path / "config.json"), "--num-gpus", "8", "--gpu", "v100-16gb",
                            "--global-batch-size", "64", "--seq-length", "256"])
    assert plan["model"]["vocab_size"] == 1000 and imported == ""

    from megatron_ru.model.spec import model_args_dict
    it = tmp_path / "ckpt" / "iter_0000000"
    it.mkdir(parents=True)
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                      max_position_embeddings=32, swiglu=True, normalization="RMSNorm")
    meta = dict(iteration=0, consumed_train_samples=0, consumed_valid_samples=0, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=0, args={}, files={},
                model_args=model_args_dict(cfg), vocab_size=777)
    (it / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("0\n")
    plan, imported = _plan(["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--num-gpus", "4",
                            "--gpu", "a100-40gb", "--global-batch-size", "16", "--seq-length", "32"])
    assert plan["model"]["vocab_size"] == 777 and imported == ""
