"""``benchmarks/gpu_suite.py --cpu-smoke``: the GPU suite's code paths at tiny shapes on the CPU, so that the
suite runs whole on the next GPU machine (every part, every contender, the table and the files)."""
import json
import os
import sys

import pytest

from tests.progress_guard import run_guarded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_suite_cpu_smoke(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    # about 430 CPU-s; stopped by its progress guard (tests/progress_guard.py) when hung, never for being starved
    proc = run_guarded([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--cpu-smoke",
                        "--out", str(out)], cpu_budget_s=1200, stall_s=600, cwd=ROOT,
                       env=dict(os.environ, DS_ACCELERATOR="cpu", TMPDIR=str(scratch)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the parts' corpora, results and traces were temporary: nothing of the suite's is left behind
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("gpu_suite")], sorted(scratch.iterdir())
    results = json.loads((out / "suite.json").read_text())
    parts = results["parts"]
    assert set(parts) == {"matrix-1b-seq2048", "correctness", "generation", "fp16", "fp8", "matrix-1b-seq4096",
                          "matrix-8b-layer-seq4096", "matrix-1b-seq32768", "memory"}
    assert set(parts["matrix-1b-seq32768"]["contenders"]) == {"ours"}  # the long sample: ours alone
    assert not [p for p, r in parts.items() if "error" in r]
    # the peers users would pick (the plain loop and transformers under torch.compile) and FP8 (torchao's
    # emulation here) run their code paths; liger-kernel's Triton kernels need CUDA: a row that says so
    assert set(parts["matrix-1b-seq2048"]["contenders"]) == {"ours", "ours-eager", "ours-before", "ours-mb8-ga4",
                                                             "ours-ds-step", "plain", "transformers", "plain-compile",
                                                             "transformers-compile", "ours-fp8"}
    assert not parts["matrix-1b-seq2048"]["errors"]
    assert parts["matrix-1b-seq2048"]["skipped"] == {
        "transformers-liger": "skipped: needs CUDA (liger-kernel's kernels are Triton GPU kernels)"}
    fp8 = parts["fp8"]
    assert fp8["reference"] == "fp32" and len(fp8["curves"]["fp8"]) == fp8["iters"] == 4
    assert fp8["within"] and 0 < fp8["max_rel_diff"] <= fp8["tolerance"] == 2 * 2.0 ** -4, fp8
    # the idle-time attribution runs on the CPU's trace (on the CPU, CPU ops stand in for kernels)
    idle = parts["matrix-1b-seq2048"]["idle_causes_smoke"]
    assert idle["kernels"] > 0 and idle["gaps_by_python_frames_ms"] and idle["gaps_by_launching_op_ms"]
    for shape in ("1b-seq4096", "8b-layer-seq4096"):
        assert set(parts[f"matrix-{shape}"]["contenders"]) == {"ours", "plain", "transformers"}
    rows = parts["correctness"]["rows"]
    assert rows and all(r["pass"] for r in rows), rows
    # the compiled layers and loss agree with the eager reference on the CPU too
    assert any(r["check"].startswith("--torch-compile vs eager fp32: gradients") for r in rows)
    gen = parts["generation"]
    assert gen["fp32_same_tokens"] == gen["fp32_total_tokens"] > 0
    # the planner's prediction of ours against a real run of it (on a GPU: the allocator's peaks)
    mem = parts["memory"]
    assert mem["device"] == "cpu" and mem["predicted_bytes"] > mem["cpu_allowance_bytes"] and mem["measured_bytes"] > 0
    md = (out / "suite.md").read_text()
    assert "Planner's memory, ours alone at the smoke shape" in md
    assert "| 1b-seq2048 | ours-mb8-ga4 | 8 x 4 |" in md and "Recipes" in md
    assert "| 1b-seq2048 | transformers-liger | | skipped: needs CUDA" in md
    assert "FP8 (--fp8-format hybrid, tensorwise) vs fp32, 4 steps of the 1B preset" in md
    # ours against the fastest peer, in its own column
    ours_row = next(line for line in md.splitlines() if line.startswith("| 1b-seq2048 | ours |"))
    assert ours_row.rstrip(" |").split("|")[-1].strip() != "", ours_row
    assert md.strip() in proc.stdout  # the one table, printed
