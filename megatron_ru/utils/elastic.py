"""torchrun's error-file protocol: how a worker's own message reaches torchrun's failure report.

torchrun (torch elastic) gives each worker a file to describe its failure in
(``TORCHELASTIC_ERROR_FILE``); when the worker fails, torchrun's summary shows that file's message
instead of "To enable traceback see: ...". ``torch.distributed.elastic.multiprocessing.errors.record``
writes it for an uncaught exception, with the traceback; our entry points end with an exit status
instead and a one-line message, so they write the file themselves, in the format torch's
``ErrorHandler.record_exception`` writes (``python -m megatron_ru.launch`` reads it back).
"""
from __future__ import annotations

import json
import os
import time
from typing import Mapping, Optional

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"


def record_error(message: str, env: Mapping[str, str] = os.environ) -> None:
    """Write ``message`` as this worker's error under torchrun; nothing under other launchers.
    A later message replaces an earlier one: the last error a worker reports is the one it ends on."""
    path = env.get(ERROR_FILE_VAR)
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:  # torchrun's log directory gone: its report falls back to its own line
        pass


def recorded_message(path: Optional[str]) -> Optional[str]:
    """The message of an error file written by :func:`record_error` or by torch's ``record``
    (for which the exception's last line, ``Type: message``, is taken); None when there is none."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) and message else None
