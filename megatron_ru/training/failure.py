"""How ``pretrain_gpt.py`` ends when something goes wrong: one message, the right exit status.

* Exit status: 2 for a configuration or input error (``ValueError``, ``FileNotFoundError`` and
  their subclasses: bad flags, a corrupt ``.idx``, a missing or damaged checkpoint file), 1 for a
  failure during training (a peer that died, a collective that timed out, a non-finite loss).
* One message per fault, from the rank that found it, without a traceback. Set
  ``MEGATRON_RU_DEBUG=1`` to get the traceback, from every rank that failed.
* Who prints, without a collective that could hang on a stopped or dead peer:

  - before the process group exists, the error comes from the flags or the launcher's
    environment, which every rank reads alike: rank 0 (as the launcher numbered it) prints it;
    a rank that cannot tell its own rank prints too;
  - afterwards, the first rank to fail claims the report with one atomic ``add`` on the job's
    rendezvous store (a few seconds' deadline) and prints; ranks failing later are usually
    failing *because* of it (a closed connection, a timed-out collective) and stay silent. If the
    store's host has exited (rank 0 under mpirun/srun, after reporting its own error or killed,
    which the launcher reports), the rank stays silent; if the store is stuck, the rank prints:
    twice is better than never. Rank 0 keeps the store up a few seconds after reporting, so that
    ranks failing at about the same time learn it was reported.

  A silent rank waits a moment before it exits, so that under ``mpirun`` (which ends the whole job
  at the first non-zero exit) the rank that prints gets its line out first.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

EXIT_FAILURE, EXIT_INPUT_ERROR = 1, 2
#: a user's configuration or input is wrong: exit 2
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)
DEBUG_VAR = "MEGATRON_RU_DEBUG"
T = TypeVar("T")
_CLAIM_KEY = "megatron_ru/error_reported"
_CLAIM_TIMEOUT = timedelta(seconds=5)
#: how long a silent rank waits before exiting (before / after the process group exists)
SILENT_GRACE_S = (10.0, 3.0)
#: how long rank 0, when it hosts the rendezvous store, keeps it up after reporting
STORE_HOST_LINGER_S = 3.0


def exit_code_of(error: BaseException) -> int:
    return EXIT_INPUT_ERROR if isinstance(error, INPUT_ERRORS) else EXIT_FAILURE


def debug_requested(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(DEBUG_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def launcher_rank(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """The global rank the launcher gave this process; None when its environment is unreadable."""
    from megatron_ru.parallel.env import discover_environment
    try:
        return discover_environment(env).rank
    except ValueError:
        return None


def _claim_in_store() -> bool:
    """True for the first rank of the job to call this (atomic counter in the rendezvous store)."""
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_CLAIM_TIMEOUT)  # a stopped store host must not hold the exit up
        return store.add(_CLAIM_KEY, 1) == 1
    except dist.DistNetworkError:
        # the store's host (rank 0 under mpirun/srun) has exited: it reported its own error, or
        # it was killed and the launcher reports that; a line from here would be a second one
        return False
    except Exception:  # noqa: BLE001 - the store's host is stuck: report rather than not
        return True


def _hosts_the_store(env: Mapping[str, str]) -> bool:
    """Rank 0 runs the rendezvous store, except under torchrun (whose agent keeps its own)."""
    import torch.distributed as dist
    return (dist.get_rank() == 0 and dist.get_world_size() > 1
            and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")


def should_report(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this rank prints the error it caught (see the module docstring)."""
    import torch.distributed as dist
    if debug_requested(env):
        return True
    if dist.is_available() and dist.is_initialized():
        return _claim_in_store()
    return launcher_rank(env) in (0, None)


def message_of(error: BaseException, timeout_minutes: Optional[float], what: str = "training") -> str:
    if isinstance(error, INPUT_ERRORS):
        return str(error) if str(error) else type(error).__name__
    hint = (f" If another rank died or hung, its own log (or the launcher's) says why; collectives "
            f"give up after --distributed-timeout-minutes ({timeout_minutes}).") if timeout_minutes else ""
    return f"{what} failed: {type(error).__name__}: {error}.{hint}"


def report_failure(error: BaseException, timeout_minutes: Optional[float] = None,
                   env: Mapping[str, str] = os.environ, what: str = "training") -> int:
    """Print ``error`` once per job (see the module docstring) and return the exit status; ``what``
    names the program's work in the message ("training", "generation")."""
    code = exit_code_of(error)
    initialized = _process_group_exists()
    if should_report(env):
        if debug_requested(env):
            log.error("".join(traceback.format_exception(error)).rstrip())
        hint = "" if debug_requested(env) or code == EXIT_INPUT_ERROR else f" (set {DEBUG_VAR}=1 for the traceback)"
        log.error(message_of(error, timeout_minutes, what) + hint)
        if initialized and _hosts_the_store(env):
            time.sleep(STORE_HOST_LINGER_S)  # the others learn from the store that this was reported
    else:
        time.sleep(SILENT_GRACE_S[1 if initialized else 0])
    return code


def _process_group_exists() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def flush_and_exit(code: int) -> None:
    """End the process now with ``code``: no interpreter shutdown, whose atexit hooks and
    process-group destructors could wait on a peer that is stopped or stuck in a collective."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not change the exit status
            pass
    from megatron_ru.parallel.env import abort_mpi_if_active
    abort_mpi_if_active(code)
    os._exit(code)


def exit_with(code: int) -> None:
    """A tool's last line: exit with ``code``, at once when it is a failure (see :func:`flush_and_exit`)."""
    if code != 0:
        flush_and_exit(code)  # a failed job must not wait on its peers while shutting down
    sys.exit(code)


def parse_on_rank0(parse: Callable[[Sequence[str]], T], argv: Sequence[str]) -> T:
    """``parse(argv)`` with argparse's own output (a usage error, --help) from rank 0 only: every
    rank parses the same command line, and four copies of one error help nobody."""
    import contextlib
    import io
    if launcher_rank() in (0, None):
        return parse(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return parse(argv)
        except SystemExit as e:
            if e.code:
                time.sleep(SILENT_GRACE_S[0])  # rank 0 prints it and ends the job meanwhile
            raise


def distributed_tool_main(argv: Optional[Sequence[str]], parser: Callable[[], Any],
                          run: Callable[[Any, Sequence[str]], Any], what: str) -> int:
    """``main`` of a tool that every rank of a job runs (generation, evaluation): parse (output from
    rank 0), ``run(ns, argv)``, one message and exit status 2/1 on failure, 0 after a clean shutdown."""
    import torch.distributed as dist
    argv = sys.argv[1:] if argv is None else list(argv)
    timeout: Optional[float] = None
    try:
        ns = parse_on_rank0(lambda a: parser().parse_args(a), argv)
        timeout = ns.distributed_timeout_minutes
        run(ns, argv)
    except Exception as e:  # noqa: BLE001 - one message, one exit status
        return report_failure(e, timeout, what=what)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
