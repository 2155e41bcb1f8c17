"""Forked worker processes that tokenize batches (``--worker-type process``).

Not ``multiprocessing.Pool``, for two faults of it that users hit as a tool that never ends:

- ``Pool.terminate()`` can wait forever (CPython gh-96995, gh-73945). Its task-handler thread may
  be blocked writing a batch into the task pipe when the workers are killed; the parent holds that
  pipe's read end itself, so the write never fails, and ``terminate()`` joins the thread forever.
  Seen here: Ctrl-C hung the tool in CI, and in 5 of 40 tries with three busy loops beside it.
- A worker killed from outside (out of memory) loses its batch; the Pool starts a new worker and
  the parent waits for the lost result forever.

Here every pipe end lives only in the processes that use it: once the workers are gone a write
fails (EPIPE) instead of blocking, and a read ends (EOF). The parent waits on the workers' results
and on their exits together, so a dead worker is an error that names it, not a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Callable, Optional

from megatron_ru.data.preprocess.interrupts import STOP_SIGNALS, ignore_stop_signals

_STOP = object()


def _worker_main(index: int, encode: Callable, task_r: Connection, read_lock, result_ws: list[Connection],
                 others: list[Connection]) -> None:
    for c in others:  # the parent's ends and the other workers' result pipes: not this process's
        c.close()
    ignore_stop_signals()  # the parent handles Ctrl-C and SIGTERM, and stops this process
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    out = result_ws[index]
    while True:
        with read_lock:
            try:
                task = task_r.recv()
            except EOFError:  # the parent is gone
                return
        if task is None:
            return
        seq, batch = task
        try:
            reply = (seq, encode(batch), None)
        except BaseException:
            reply = (seq, None, traceback.format_exc())
        out.send(reply)


def _death(pid: int, exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        how = f"was killed by {signal.Signals(-exitcode).name} while tokenizing"
        if -exitcode == signal.SIGKILL:
            how += " (out of memory? see `dmesg`; lower --workers or --batch-bytes)"
    else:
        how = f"exited with code {exitcode} while tokenizing"
    return f"worker process {pid} {how}; nothing was written"


class ProcessWorkers:
    """``count`` forked processes running ``encode(batch)``; results are fetched by the sequence
    number :meth:`submit` returns. The workers inherit everything loaded before (the tokenizer).
    End with :meth:`close` after the last result, or :meth:`kill` (any error, Ctrl-C)."""

    def __init__(self, encode: Callable, count: int) -> None:
        ctx = mp.get_context("fork")
        self._task_r, self._task_w = ctx.Pipe(duplex=False)
        pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
        self._result_rs = [r for r, _ in pipes]
        result_ws = [w for _, w in pipes]
        read_lock = ctx.Lock()
        self._procs: list = []
        self._seq = 0
        self._done: dict = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: Optional[threading.Thread] = None
        # a stop signal between a fork and the worker's SIG_IGN would kill that worker: held until all run
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for i in range(count):
                others = [self._task_w, *self._result_rs, *(w for j, w in enumerate(result_ws) if j != i)]
                p = ctx.Process(target=_worker_main, args=(i, encode, self._task_r, read_lock, result_ws, others),
                                daemon=True, name=f"preprocess-worker-{i}")
                p.start()
                self._procs.append(p)
        except BaseException:
            self.kill()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            self._task_r.close()
            for w in result_ws:
                w.close()
        # a thread writes the batches: the main thread must stay free to read results, or a worker
        # blocked writing its result and the main thread blocked writing a batch would wait on each other
        self._sender = threading.Thread(target=self._send_all, name="preprocess-sender", daemon=True)
        self._sender.start()

    def _send_all(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _STOP:
                return
            try:
                self._task_w.send(item)
            except OSError:  # every worker is gone: the main thread reports why
                return

    def submit(self, batch) -> int:
        seq = self._seq
        self._seq += 1
        self._outbox.put((seq, batch))
        return seq

    def result(self, seq: int, interrupt):
        """The result of batch ``seq``; ``interrupt.check()`` (a :class:`DeferredInterrupt`'s) runs at
        least every ``interrupt.POLL_SECONDS`` while it waits, and may raise."""
        sentinels = {p.sentinel: p for p in self._procs}
        while seq not in self._done:
            interrupt.check()
            ready = wait([*self._result_rs, *sentinels], timeout=interrupt.POLL_SECONDS)
            for conn in ready:
                if conn in sentinels:
                    continue
                try:
                    s, value, error = conn.recv()
                except (EOFError, OSError):  # its worker died before the message or mid-message ("got end of
                    continue                     # file during message"); the sentinel says how
                if error is not None:
                    raise RuntimeError(f"a worker process failed while tokenizing:\n{error}")
                self._done[s] = value
            if seq not in self._done and any(c in sentinels for c in ready):
                p = next(sentinels[c] for c in ready if c in sentinels)
                p.join()
                raise ChildProcessError(_death(p.pid, p.exitcode))
        return self._done.pop(seq)

    def close(self) -> None:
        """After the last result: the workers end on a stop message each."""
        for _ in self._procs:
            self._outbox.put(None)
        self._shutdown()

    def kill(self) -> None:
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        self._shutdown()

    def _shutdown(self) -> None:
        self._outbox.put(_STOP)
        for p in self._procs:
            p.join()
        # with the workers gone, a blocked write fails and the sender ends
        if self._sender is not None:
            self._sender.join()
        for c in (self._task_w, *self._result_rs):
            c.close()
