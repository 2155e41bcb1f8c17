"""Sampling filters, seeded per-prompt generators, left padding and the decoding masks."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_ru.inference.batching import attention_mask, left_pad
from megatron_ru.inference.prompts import collect_prompts, read_prompt_file
from megatron_ru.inference.sampling import SamplingParams, filter_logits, sample_generators, sample_next


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = filter_logits(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(filter_logits(logits, top_p=p)).tolist()[0]  # noqa: E731
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.8) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    assert keep(1e-9) == [True, False, False, False]  # the most likely token always stays


def test_greedy_is_argmax_and_sampling_respects_filters() -> None:
    logits = torch.randn(4, 50)
    assert torch.equal(sample_next(logits, SamplingParams(greedy=True)), logits.argmax(-1))
    params = SamplingParams(temperature=0.7, top_k=3)
    top3 = logits.topk(3).indices
    for g in range(20):
        ids = sample_next(logits, params, sample_generators(g, range(4)))
        assert all(int(ids[i]) in top3[i].tolist() for i in range(4))


def test_seeded_sampling_is_reproducible_and_per_prompt() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    params = SamplingParams(temperature=1.5)
    a = sample_next(logits, params, sample_generators(7, [0, 1, 2]))
    b = sample_next(logits, params, sample_generators(7, [0, 1, 2]))
    assert torch.equal(a, b)
    # prompt 2's draw does not depend on which prompts share its batch
    alone = sample_next(logits[2:], params, sample_generators(7, [2]))
    assert int(alone[0]) == int(a[2])
    draws = {tuple(sample_next(logits, params, sample_generators(s, [0, 1, 2])).tolist()) for s in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("kwargs, flag", [({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
                                          ({"top_k": -1}, "--top-k"), ({"temperature": 0.0}, "--temperature")])
def test_bad_sampling_params_name_the_flag(kwargs: dict, flag: str) -> None:
    problems = SamplingParams(**kwargs).problems()
    assert len(problems) == 1 and problems[0].startswith(flag)


def test_left_pad_positions_and_masks() -> None:
    batch = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert batch.valid.tolist() == [[True, True, True], [False, False, True]]
    assert batch.positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    m = attention_mask(batch.valid, 3)
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # padding queries see only themselves (no empty softmax row); the real query skips padding keys
    assert m[1, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    step = attention_mask(torch.cat([batch.valid, torch.ones(2, 1, dtype=torch.bool)], 1), 1)
    assert step.shape == (2, 1, 1, 4)
    assert step[1, 0, 0].tolist() == [False, False, True, True]


def test_prompt_files(tmp_path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond {not json}\n", encoding="utf-8")
    assert read_prompt_file(str(text)) == ["first prompt", "second {not json}"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a\nb", "id": 1}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    assert collect_prompts(["x"], str(jl)) == ["x", "a\nb", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 1: expected an object with a \"prompt\" string"):
        read_prompt_file(str(bad))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        collect_prompts(["ok", "  "], None)
    with pytest.raises(ValueError, match="no prompts: give --prompt"):
        collect_prompts(None, None)
    with pytest.raises(FileNotFoundError, match="--prompt-file .*missing.txt: no such file"):
        read_prompt_file(str(tmp_path / "missing.txt"))


def test_tokenizer_from_the_checkpoint_or_the_flags(tmp_path) -> None:
    import types

    from megatron_ru.inference.cli import build_parser, tokenizer_config
    load = str(tmp_path)
    imported = types.SimpleNamespace(tokenizer={"tokenizer_type": "HuggingFaceTokenizer",
                                                "tokenizer_model": "tokenizer", "future_field": 1}, args={})
    argv = ["--load", load, "--prompt", "x"]
    cfg = tokenizer_config(build_parser().parse_args(argv), argv, imported, load)
    assert (cfg.tokenizer_type, cfg.tokenizer_model) == ("HuggingFaceTokenizer", str(tmp_path / "tokenizer"))
    trained = types.SimpleNamespace(tokenizer=None, args={"tokenizer": {"tokenizer_type": "NullTokenizer",
                                                                        "vocab_size": 95}})
    cfg = tokenizer_config(build_parser().parse_args(argv), argv, trained, load)
    assert (cfg.tokenizer_type, cfg.vocab_size) == ("NullTokenizer", 95)
    given = argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "7"]
    cfg = tokenizer_config(build_parser().parse_args(given), given, imported, load)
    assert (cfg.tokenizer_type, cfg.vocab_size, cfg.tokenizer_model) == ("NullTokenizer", 7, None)
    bare = types.SimpleNamespace(tokenizer=None, args={})
    with pytest.raises(ValueError, match="records no tokenizer: give the tokenizer flags"):
        tokenizer_config(build_parser().parse_args(argv), argv, bare, load)
