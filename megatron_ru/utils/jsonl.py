"""Reading small JSONL inputs of the tools (prompt files, evaluation sets) with errors that name the
flag, the file and the line."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator


def json_objects(path: str, flag: str, example: str = '{"text": "..."}') -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of ``path``; a missing file, a line that is not
    JSON or not an object raise an error naming ``flag``, the file and the line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {path}, line {n}: not valid JSON ({e.msg}); the file holds one object per "
                                 f"line such as {example}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{flag} {path}, line {n}: expected an object such as {example}, got "
                                 f"{line.strip()[:80]!r}")
            yield n, obj
