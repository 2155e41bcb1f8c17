"""Thread pools that live as long as their owner, one per process and size."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_LOCK = threading.Lock()


def _new_lock() -> None:  # a fork while another thread held the lock must not leave it held in the child
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def kept_pool(pools: dict, threads: int, name: str) -> ThreadPoolExecutor:
    """The pool of ``threads`` threads kept in ``pools`` (its owner's dict) for this process:
    created on first use, then reused, so that its threads keep per-thread state (a tokenizer's
    per-thread objects) from one call to the next. A forked child makes its own (the parent's
    threads do not exist there). Idle threads end when the owner, and with it the pool, is freed."""
    key = (os.getpid(), threads)
    with _LOCK:
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = ThreadPoolExecutor(threads, thread_name_prefix=name)
    return pool
