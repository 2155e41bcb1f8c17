"""Generation past --max-position-embeddings with RoPE is no longer silent (issue 31, item 11): one
warning per process and length, naming the numbers and the flags; learned positions stay refused."""
import dataclasses
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_inference_runner import V, _cfg, canonical_tensors, single_rank_state  # noqa: E402

from megatron_ru.inference import generate as gen  # noqa: E402
from megatron_ru.inference.runner import StageRunner  # noqa: E402
from megatron_ru.inference.sampling import SamplingParams  # noqa: E402
from megatron_ru.model import GPTModel  # noqa: E402


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_rope_generation_past_the_trained_context_warns_once(records, monkeypatch):
    monkeypatch.setattr(gen, "_warned_rope", set())
    cfg = dataclasses.replace(_cfg(False), max_position_embeddings=12)
    runner = StageRunner(cfg, V, single_rank_state())
    runner.load(canonical_tensors(GPTModel(cfg, V, seed=3), cfg).__getitem__)
    greedy = SamplingParams(greedy=True)
    gen.generate(runner, [[1, 2, 3]], max_new_tokens=8, params=greedy)  # 11 positions: within
    assert _warnings(records) == []
    for _ in range(2):
        out = gen.generate(runner, [[1, 2, 3, 4, 5, 6]], max_new_tokens=8, params=greedy)
        assert len(out[0].token_ids) == 8
    (warning,) = _warnings(records)
    assert ("the longest prompt (6 tokens) plus --max-new-tokens (8) exceeds the model's --max-position-embeddings "
            "(12), the context it was trained for: RoPE positions past it were never trained") in warning


def test_learned_positions_past_the_table_are_refused():
    cfg = dataclasses.replace(_cfg(False), position_embedding_type="learned_absolute", max_position_embeddings=12)
    with pytest.raises(ValueError, match=r"exceeds the model's --max-position-embeddings \(12\); shorten"):
        gen.check_positions(cfg, 6, 8)
