"""One rank-aware logger for the whole package.

Every module does ``log = get_logger(__name__)``. Records carry the global rank in their
prefix; ``log_rank0`` / ``log.info(..., extra=RANK0)`` keeps a message to rank 0 only, which
is what most progress lines want. The rank is read lazily from ``RANK`` (written back into
the environment by ``megatron_ru.parallel.env`` before training starts) so that importing
the package never needs a process group.
"""
from __future__ import annotations

import logging
import os
import sys

_ROOT = "megatron_ru"
_configured = False

#: pass as ``extra=RANK0`` to log a record on global rank 0 only
RANK0 = {"rank0_only": True}


def current_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        if getattr(record, "rank0_only", False) and record.rank != 0:
            return False
        return True


def configure(level: str | int | None = None, stream=None) -> None:
    """Install the handler once (idempotent). Level from ``MEGATRON_RU_LOG_LEVEL`` or INFO."""
    global _configured
    root = logging.getLogger(_ROOT)
    if level is None:
        level = os.environ.get("MEGATRON_RU_LOG_LEVEL", "INFO")
    root.setLevel(level)
    if _configured:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RankFilter())
    handler.setFormatter(
        logging.Formatter("[%(asctime)s rank %(rank)s] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root.addHandler(handler)
    root.propagate = False
    _configured = True


def get_logger(name: str) -> logging.Logger:
    """Logger under the package root; configures the handler on first use."""
    configure()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def log_rank0(logger: logging.Logger, msg: str, *args, level: int = logging.INFO) -> None:
    logger.log(level, msg, *args, extra=RANK0)
