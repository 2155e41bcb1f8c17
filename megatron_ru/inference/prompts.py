"""Prompts in, completions out: reading ``--prompt``/``--prompt-file`` and writing the JSONL and
text results of ``tools/generate.py``."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence

from megatron_ru.utils.jsonl import json_objects

JSONL_SUFFIXES = (".jsonl", ".json")


def read_prompt_file(path: str) -> list[str]:
    """Prompts from ``path``: a ``.jsonl``/``.json`` file holds one JSON object per line with a
    ``"prompt"`` string; any other file holds one prompt per line (blank lines are skipped)."""
    if path.lower().endswith(JSONL_SUFFIXES):
        prompts: list[str] = []
        for n, obj in json_objects(path, "--prompt-file", example='{"prompt": "..."}'):
            if not isinstance(obj.get("prompt"), str):
                raise ValueError(f"--prompt-file {path}, line {n}: expected an object with a \"prompt\" string, got "
                                 f"{json.dumps(obj)[:80]!r}")
            prompts.append(obj["prompt"])
        return prompts
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def collect_prompts(prompts: Optional[Sequence[str]], prompt_file: Optional[str]) -> list[str]:
    """``--prompt`` values then ``--prompt-file``'s prompts; none at all, or an empty one, is an error."""
    found = list(prompts or [])
    if prompt_file:
        found += read_prompt_file(prompt_file)
    if not found:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE")
    for i, p in enumerate(found):
        if not p.strip():
            raise ValueError(f"prompt {i} is empty; every prompt needs text to continue from")
    return found


def result_record(prompt: str, completion: str, prompt_ids: Sequence[int], token_ids: Sequence[int],
                  finish_reason: str) -> dict[str, Any]:
    """One line of ``--output-file``."""
    return {"prompt": prompt, "completion": completion, "prompt_token_ids": list(prompt_ids),
            "token_ids": list(token_ids), "finish_reason": finish_reason}


def write_jsonl(path: str, records: Iterable[dict[str, Any]]) -> None:
    """Write ``records`` to ``path`` under a temporary name, renamed when complete."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--output-file {path}: directory {directory} does not exist")
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
