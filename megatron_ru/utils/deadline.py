"""Calls that must not block a failing process for ever.

A call into torch.distributed's C++ code (a ``TCPStore`` operation, aborting a process group) can
wait without a timeout of its own: ``TCPStore.add`` on a store whose host is stopped (SIGSTOP) waits
for an answer that never comes, whatever ``set_timeout`` says. On a failure path such a call runs in
a daemon thread that the caller stops waiting for at the deadline; the process then exits with
``os._exit``, and the thread with it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Outcome:
    """What a call with a deadline did: ``done`` False when it was still running at the deadline."""
    done: bool
    value: Any = None
    error: Optional[BaseException] = None


def call_with_deadline(fn: Callable[[], Any], seconds: float, name: str = "deadline-call") -> Outcome:
    """``fn()`` in a daemon thread, waited for at most ``seconds`` (the C++ call releases the GIL,
    so this thread keeps running meanwhile)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return Outcome(False)
    return Outcome(True, out.get("value"), out.get("error"))
