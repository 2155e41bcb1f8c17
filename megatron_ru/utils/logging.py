"""One rank-aware logger for the whole package.

Every module does ``log = get_logger(__name__)``. Records carry the global rank in their
prefix; ``log_rank0`` / ``log.info(..., extra=RANK0)`` keeps a message to rank 0 only, which
is what most progress lines want. The rank is read lazily from the launcher's environment
(``RANK``, else OpenMPI's or Slurm's variable) so that importing the package never needs a
process group and a line logged before rank discovery still names the right rank.
"""
from __future__ import annotations

import logging
import os
import sys

_ROOT = "megatron_ru"
_configured = False

#: pass as ``extra=RANK0`` to log a record on global rank 0 only
RANK0 = {"rank0_only": True}


#: where a launcher puts this process's global rank, in rank discovery's order; ``RANK`` is also
#: written back by ``megatron_ru.parallel.env`` once discovery ran (under mpirun or srun only then)
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def current_rank() -> int:
    """This process's global rank as the launcher gave it (0 when none did), so that a line logged
    before rank discovery, e.g. a configuration error under mpirun, already names its rank."""
    for name in _RANK_VARS:
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                return 0
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
