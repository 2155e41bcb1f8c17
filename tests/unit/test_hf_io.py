"""The safetensors shards export writes are byte for byte what ``safetensors.torch.save_file`` writes
for the same tensors (header, order, alignment), whatever order the tensors arrive in."""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from megatron_ru.convert.hf_io import ShardedSafetensorsWriter


def test_shards_equal_safetensors_own_files(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {  # model order, not name order; several dtypes (safetensors puts wider dtypes first)
        "model.embed_tokens.weight": torch.randn(11, 8, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 5, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.counter": torch.arange(3, dtype=torch.int64),
        "model.norm.weight": torch.randn(8, generator=gen).to(torch.float16),
    }
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = ShardedSafetensorsWriter(str(tmp_path / "ours"), plan, max_shard_size=10**9)
    os.makedirs(tmp_path / "ours")
    for name, t in tensors.items():
        writer.write(name, t)
    (single,) = writer.close()
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / single).read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
