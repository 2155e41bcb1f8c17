"""The tools' JSONL inputs (prompt files, evaluation sets): every bad line is named with the flag,
the file and the line number; blank lines are skipped."""
import pytest

from megatron_ru.utils.jsonl import json_objects


def test_objects_and_errors(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b", "domain": "x"}\n', encoding="utf-8")
    assert list(json_objects(str(path), "--input")) == [(1, {"text": "a"}), (3, {"text": "b", "domain": "x"})]
    path.write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--input .*in.jsonl, line 2: not valid JSON .*such as \{\"text\": \"...\"\}"):
        list(json_objects(str(path), "--input"))
    path.write_text('["a", "b"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--prompt-file .*in.jsonl, line 1: expected an object such as"):
        list(json_objects(str(path), "--prompt-file", example='{"prompt": "..."}'))
    with pytest.raises(FileNotFoundError, match="--input .*nope.jsonl: no such file"):
        list(json_objects(str(tmp_path / "nope.jsonl"), "--input"))
