"""The whole argument vocabulary of Megatron-LM and Megatron-DeepSpeed (tests/fixtures/megatron_vocabulary.tsv): every
flag that concerns a dense GPT/LLaMA model has exactly one class here, "same" (our parser's flag) or a row of the
Megatron flag table, and the table accepts it with the parents' number of values."""
from __future__ import annotations

import os

from megatron_ru.flags.megatron_flags import NO_EFFECT, REFUSED, SPELLING, TABLE, same_flags

VOCABULARY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron_vocabulary.tsv")


def _vocabulary() -> list[dict[str, str]]:
    with open(VOCABULARY, encoding="utf-8") as f:
        lines = [line.rstrip("\n").split("\t") for line in f if not line.startswith("#")]
    header, rows = lines[0], lines[1:]
    assert header == ["flag", "parents", "groups", "arity", "dense_gpt"]
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_the_vocabulary_file_is_well_formed():
    rows = _vocabulary()
    flags = [r["flag"] for r in rows]
    assert len(flags) == len(set(flags)) and len(rows) > 900  # both parents' parsers, HEAD of each
    for r in rows:
        assert r["flag"].startswith("--") and r["parents"] in ("LM", "DS", "LM, DS"), r
        assert r["arity"] in ("0", "1", "+", "*", "?") and r["dense_gpt"], r
    excluded = {r["dense_gpt"] for r in rows if r["dense_gpt"] != "yes"}
    assert {"vision", "biencoder/ICT", "retro", "RL", "inference server", "MoE (not dense)",
            "BERT/T5 (encoder or encoder-decoder)"} <= excluded
    # spot checks: Megatron-LM's generated flags (from its config dataclasses) are there, and so is MDS's vocabulary
    by_flag = {r["flag"]: r for r in rows}
    assert by_flag["--log-params-norm"]["parents"] == "LM, DS"
    assert by_flag["--use-distributed-optimizer"]["dense_gpt"] == "yes"
    assert by_flag["--num-key-value-heads"]["parents"] == "DS"
    assert by_flag["--vision-backbone-type"]["dense_gpt"] == "vision"


def test_every_dense_gpt_flag_has_exactly_one_class():
    same = set(same_flags())
    table = [f.flag for f in TABLE]
    assert len(table) == len(set(table)), "a flag twice in the table"
    assert not same & set(table), f"in the table and our parser: {sorted(same & set(table))}"
    relevant = [r["flag"] for r in _vocabulary() if r["dense_gpt"] == "yes"]
    missing = [f for f in relevant if f not in same and f not in set(table)]
    assert not missing, f"unclassified Megatron flags (add them to megatron_flags' table): {missing}"


def test_the_table_takes_as_many_values_as_the_parents():
    arity = {r["flag"]: r["arity"] for r in _vocabulary()}
    wrong = [(f.flag, f.arity, arity[f.flag]) for f in TABLE if f.flag in arity and str(f.arity) != arity[f.flag]]
    assert not wrong


def test_the_classes_add_up():
    kinds = {SPELLING: 0, NO_EFFECT: 0, REFUSED: 0}
    for f in TABLE:
        kinds[f.kind] += 1
    assert kinds[REFUSED] > 250 and kinds[NO_EFFECT] > 200 and kinds[SPELLING] > 20

