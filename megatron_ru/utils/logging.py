"""One rank-aware logger for the whole package.

Every module does ``log = get_logger(__name__)``. Records carry the global rank in their
prefix; ``log_rank0`` / ``log.info(..., extra=RANK0)`` keeps a message to rank 0 only, which
is what most progress lines want. The rank is read lazily from the launcher's environment
(``RANK``, else OpenMPI's or Slurm's variable) so that importing the package never needs a
process group and a line logged before rank discovery still names the right rank.

Other libraries' output is brought under the same logger, at the narrowest point:
:func:`stdout_to_log` (a ``with`` block whose ``print`` lines become log records, e.g. DeepSpeed's
``SEED_LAYERS=...``, topology and stage listing while the model and engine are built),
:func:`forward_logger` (a library logger, e.g. ``DeepSpeed``, handled by ours instead of its own stdout
handler) and :func:`route_warnings` (Python warnings become log records; deprecations at debug level).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from typing import Iterator, Optional

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
    from megatron_ru.utils.elastic import ERROR_FILE_VAR
    if os.environ.get(ERROR_FILE_VAR):  # under torchrun: its failure report shows our error line
        errors = _ElasticErrorFile(logging.ERROR)
        errors.addFilter(_RankFilter())
        root.addHandler(errors)
    root.propagate = False
    _configured = True


#: what DeepSpeed logs as a warning when it is imported that asks nothing of our users: a debug record
#: instead (on a machine without a GPU, CPU is the right choice, and the Makefile sets DS_ACCELERATOR)
DEEPSPEED_NOTICES = ("Setting accelerator to CPU",)


class _DeepSpeedNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(DEEPSPEED_NOTICES):
            logging.getLogger(f"{_ROOT}.deepspeed").debug(message)
            return False
        return True


# at import, before DeepSpeed's: its logger keeps this filter when DeepSpeed configures it
logging.getLogger("DeepSpeed").addFilter(_DeepSpeedNotices())


class _ElasticErrorFile(logging.Handler):
    """Each error record also becomes this worker's entry in torchrun's error file
    (:mod:`megatron_ru.utils.elastic`), so torchrun's report ends on our message, not on a hint."""

    def emit(self, record: logging.LogRecord) -> None:
        from megatron_ru.utils.elastic import record_error
        record_error(record.getMessage())


def get_logger(name: str) -> logging.Logger:
    """Logger under the package root; configures the handler on first use."""
    configure()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def log_rank0(logger: logging.Logger, msg: str, *args, level: int = logging.INFO) -> None:
    logger.log(level, msg, *args, extra=RANK0)


class LogStream(io.TextIOBase):
    """A text stream whose complete lines become records of ``logger`` at ``level`` (blank lines dropped)."""

    def __init__(self, logger: logging.Logger, level: int = logging.DEBUG) -> None:
        super().__init__()
        self.logger, self.level = logger, level
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                self.logger.log(self.level, line.rstrip())
        return len(text)

    def flush(self) -> None:
        if self._partial.strip():
            self.logger.log(self.level, self._partial.rstrip())
        self._partial = ""


@contextlib.contextmanager
def stdout_to_log(logger: logging.Logger, level: int = logging.DEBUG) -> Iterator[None]:
    """Inside the block, what Python code prints to stdout becomes records of ``logger`` at ``level``
    (our own handler writes to stderr and keeps working). For libraries that ``print`` their start-up
    chatter (DeepSpeed's PipelineModule); output from C code is not affected."""
    stream = LogStream(logger, level)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()


class _Forward(logging.Handler):
    """Re-emits another library's records through ``target`` (our handler, rank prefix). Records below
    WARNING become DEBUG; a WARNING is kept on global rank 0 and DEBUG elsewhere (every rank of an SPMD job
    warns the same thing); ERROR and above stay as they are on every rank."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        level = record.levelno
        if level < logging.WARNING or (level == logging.WARNING and current_rank() != 0):
            level = logging.DEBUG
        self.target.log(level, record.getMessage())


def forward_logger(name: str, target: Optional[logging.Logger] = None) -> logging.Logger:
    """Hand library logger ``name`` (e.g. ``"DeepSpeed"``, whose own handler prints to stdout) to ours
    (``megatron_ru.<name lowercased>`` by default); idempotent. Its level stays WARNING unless ours is
    DEBUG (MEGATRON_RU_LOG_LEVEL=DEBUG): then the library's info lines come too, as debug records (a
    library may do extra work, e.g. memory reports, when its info level is on)."""
    lib = logging.getLogger(name)
    target = target or get_logger(f"{_ROOT}.{name.lower()}")
    for h in list(lib.handlers):
        if not isinstance(h, _Forward):
            lib.removeHandler(h)
    if not any(isinstance(h, _Forward) for h in lib.handlers):
        lib.addHandler(_Forward(target))
    lib.setLevel(logging.DEBUG if target.getEffectiveLevel() <= logging.DEBUG else logging.WARNING)
    lib.propagate = False
    return lib


#: warning categories that address a library's developers, not our users: logged at debug level
QUIET_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def route_warnings(logger: Optional[logging.Logger] = None) -> None:
    """Python warnings become records of ``logger`` (``megatron_ru.warnings``): deprecations
    (:data:`QUIET_WARNINGS`, e.g. DeepSpeed calling a deprecated torch.distributed function) at debug
    level, others at WARNING on global rank 0 and debug on the other ranks; each distinct message once
    per process. Explicit warning options (``python -W``, PYTHONWARNINGS) are left in charge."""
    target = logger or get_logger(f"{_ROOT}.warnings")

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        level = logging.WARNING
        if issubclass(category, QUIET_WARNINGS) or current_rank() != 0:
            level = logging.DEBUG
        target.log(level, f"{category.__name__}: {message} ({filename}:{lineno})")

    warnings.showwarning = show
    if not sys.warnoptions:
        warnings.simplefilter("once")
