"""A compiled transformer layer (``--torch-compile``) with the RoPE cos/sin tables computed inside the graph
(before: inductor fuses the powers, sines and cosines into the per-element RoPE kernel of q and k) against
the tables passed in as inputs (now: computed once per length, outside the graph). Same layer, same batch,
forward + backward, interleaved, medians; the ratio is in-graph / inputs (> 1: passing them in is faster).

    .venv/bin/python benchmarks/rope_tables.py                    # CPU, fp32
    python3 benchmarks/rope_tables.py --seq 2048 --batch 4 --hidden 2048 --heads 16 --groups 8 --ffn 5504 --bf16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_step import timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("seq", 512), ("batch", 4), ("hidden", 512), ("heads", 8), ("groups", 4), ("ffn", 1408),
                          ("steps", 10)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--bf16", action="store_true")
    opts = ap.parse_args()
    from megatron_ru.config.model import ModelConfig
    from megatron_ru.model.transformer import TransformerLayer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    cfg = ModelConfig(num_layers=1, hidden_size=opts.hidden, num_attention_heads=opts.heads,
                      group_query_attention=True, num_query_groups=opts.groups, ffn_hidden_size=opts.ffn,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=opts.seq)
    layer = TransformerLayer(cfg, 0, device=device, dtype=dtype)
    layer.compile_forward()
    x = torch.randn(opts.seq, opts.batch, opts.hidden, device=device, dtype=dtype, requires_grad=True)
    tables = layer.self_attention.rope_tables(opts.seq, device, dtype)
    runs = {"in_graph": lambda: layer._compiled(x, None, None, None, None).sum().backward(),
            "inputs": lambda: layer._compiled(x, None, None, None, tables).sum().backward()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(opts.steps + 2):
        for name, fn in runs.items():
            wall, _ = timed(fn, device)
            if i >= 2:
                times[name].append(wall)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "dtype": str(dtype), "shape": vars(opts), "median_s": med,
                      "ratio_in_graph_over_inputs": med["in_graph"] / med["inputs"]}))


if __name__ == "__main__":
    main()
