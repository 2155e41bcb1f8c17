"""Ctrl-C (SIGINT) and SIGTERM (``kill``, ``timeout``, a scheduler's time limit) stop the tool the
same way: everything it was writing is removed, and it exits 128 + the signal's number.

A signal reaches either the main process alone (``kill PID``) or its whole process group (a
terminal's Ctrl-C, ``scancel``): the main process stops its workers and partitions itself, and
the forked workers ignore both signals.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised for SIGINT or SIGTERM; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def _handle_stop_signals(handler) -> dict:
    """``handler`` for every stop signal (main thread only: elsewhere nothing); the handlers it
    replaced, for :func:`_restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def _restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


@contextmanager
def stop_signals_raise():
    """For the whole run: SIGTERM raises :class:`Interrupted` as Ctrl-C does, so that the
    cleanup of an interrupted run (the ``except``/``finally`` blocks) runs for it too."""
    previous = _handle_stop_signals(_raise)
    try:
        yield
    finally:
        _restore(previous)


def ignore_stop_signals() -> None:
    """In a worker: its parent handles them and stops it."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class DeferredInterrupt:
    """While workers run, a stop signal only sets a flag; :meth:`check` raises :class:`Interrupted`
    between batches. Raised wherever the main thread happens to be, it could land inside a queue's
    code with its lock held, or between the halves of a message read from a worker, and stopping
    the workers would then wait for that lock forever. A wait for a batch looks at the flag every
    POLL_SECONDS, so a stop does not wait for a long batch to finish."""

    POLL_SECONDS = 0.2

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> "DeferredInterrupt":
        self._previous = _handle_stop_signals(self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def check(self) -> None:
        if self.signum:
            raise Interrupted(self.signum)

    def __exit__(self, exc_type: object, *_: object) -> None:
        _restore(self._previous)
        if exc_type is None:
            self.check()  # a signal after the last batch still stops the run before anything is renamed
