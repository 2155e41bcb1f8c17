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
    rendezvous store and prints; ranks failing later are usually failing *because* of it (a closed
    connection, a timed-out collective) and stay silent. Every failing rank then aborts its process
    groups, so that the peers waiting on it in a collective fail at once (and learn from the store
    that it was reported) instead of at --distributed-timeout-minutes. Rank 0, when it hosts the store
    and reports, keeps it up until every other rank has checked in (at most ``STORE_HOST_LINGER_S``):
    a rank busy elsewhere (reading its own files) fails only at its next collective and must still find
    the store, or it would report rank 0 as lost.
  - every store operation here has a deadline (:mod:`megatron_ru.utils.deadline`: a ``TCPStore.add``
    on a stopped host waits for ever, whatever ``set_timeout`` says). A rank that cannot reach the
    store prints one line naming the rank that hosts it (rank 0 under mpirun/srun) as lost: its port
    refuses connections (it exited or was killed) or it does not answer (stopped, hung, unreachable).
    No store means no election, so such survivors print one after another, rank 1 first among those
    that find the loss close together (each finds it when its own wait on that rank times out); under
    ``mpirun``, the first one's exit ends the job.

  - when the reporting rank failed because of a peer (a collective timed out, a connection closed),
    it names the peers that are missing: every failing rank checks in at the store, the reporter
    aborts its groups (so that the survivors waiting on it fail too) and waits up to
    ``CENSUS_WAIT_S`` for them; the ranks that never check in are the lost ones (stopped, hung,
    killed or unreachable).

  A silent rank waits a moment before it exits, so that under ``mpirun`` (which ends the whole job
  at the first non-zero exit) the rank that prints gets its line out first. Messages of C++ errors
  lose their C++ stack trace and source locations: one line each.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

from megatron_ru.utils.deadline import call_with_deadline
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

EXIT_FAILURE, EXIT_INPUT_ERROR = 1, 2
#: a user's configuration or input is wrong: exit 2
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)
DEBUG_VAR = "MEGATRON_RU_DEBUG"
T = TypeVar("T")
_CLAIM_KEY = "megatron_ru/error_reported"
_CHECK_IN_KEY = "megatron_ru/failing/{}"
#: how long the failure path waits for the rendezvous store: to connect, then for the claim's answer
STORE_DEADLINE_S = 5.0
#: how long aborting the process groups may take on the failure path
ABORT_DEADLINE_S = 5.0
#: survivors that cannot reach the store print this many seconds apart after each finds the loss, rank 1
#: first (at most 4 steps): ordered when they find it close together (their waits on the lost rank began
#: at different moments); under mpirun the first exit ends the job
LOST_STAGGER_S = 2.0
#: how long the reporter of a peer's failure waits for the other ranks to check in (see the docstring)
CENSUS_WAIT_S = 5.0
#: how long a silent rank waits before exiting (before / after the process group exists): after it,
#: longer than the census, so that under mpirun the reporter's line comes first
SILENT_GRACE_S = (10.0, CENSUS_WAIT_S + 3.0)
#: how long rank 0, when it hosts the rendezvous store, keeps it up after reporting, at most: until every
#: other rank has checked in (they learn from the store that the failure was reported, and stay silent)
STORE_HOST_LINGER_S = 5.0


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


@dataclass
class Verdict:
    """Whether this rank prints, and, when the store's host is lost, a phrase naming it."""
    report: bool
    lost: Optional[str] = None
    #: the store, kept referenced while this rank lingers (it may be the store's host)
    store: Any = None
    #: ``lost`` names peers that never checked in (the store is fine), not the store's host
    peers_lost: bool = False


def _tcp_address(store: Any) -> Optional[tuple[str, int]]:
    """(host, port) of the TCPStore under ``store`` (a PrefixStore wraps it); None for other stores."""
    for _ in range(4):
        if hasattr(store, "host") and hasattr(store, "port"):
            return str(store.host), int(store.port)
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return None


def _refuses(address: tuple[str, int]) -> bool:
    """True when nothing listens at ``address`` any more (a plain connect, so that torch's C++ client
    does not print its stack trace for a closed store). A stopped host still accepts: False."""
    try:
        with socket.create_connection(address, timeout=STORE_DEADLINE_S):
            return False
    except socket.timeout:
        return False  # no answer: the claim below finds out it is stuck
    except OSError:
        return True


@contextlib.contextmanager
def _cpp_warnings_muted() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the duration: torch's TCPStore client prints a C++ stack
    trace as a warning when the store closes under a call (a killed host can still accept the probe
    while it is being torn down). Only the claim runs meanwhile; our own line comes after."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the report
            pass
    try:
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _store_host(env: Mapping[str, str]) -> str:
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "the torchrun agent of the first node"
    return "rank 0"


def _lost(env: Mapping[str, str], address: Optional[tuple[str, int]], how: str) -> str:
    where = f" at {address[0]}:{address[1]}" if address else ""
    host = _store_host(env)
    return f"lost {host}: the job's rendezvous store{where}, which {host} hosts, {how}"


class StopWatch:
    """Notices that this process was stopped (SIGSTOP, a suspended job) and continued: a daemon thread
    that wakes every second sees a gap in time. A rank continued after its peers gave up on it must
    not report them as lost (``mpirun`` sends SIGCONT before SIGTERM when it ends a job)."""

    TICK_S, GAP_S = 1.0, 5.0

    def __init__(self) -> None:
        self.last_gap_end: Optional[float] = None
        thread = threading.Thread(target=self._run, name="stop-watch", daemon=True)
        thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(self.TICK_S)
            now = time.monotonic()
            if now - last > self.GAP_S:
                self.last_gap_end = now
            last = now

    def stopped_recently(self, within_s: float = 120.0) -> bool:
        return self.last_gap_end is not None and time.monotonic() - self.last_gap_end < within_s


_STOP_WATCH: list[StopWatch] = []


def watch_for_stops() -> None:
    """Start the process's :class:`StopWatch` (once); ``pretrain_gpt.py`` and the distributed tools do."""
    if not _STOP_WATCH:
        _STOP_WATCH.append(StopWatch())


def _was_stopped() -> bool:
    return bool(_STOP_WATCH) and _STOP_WATCH[0].stopped_recently()


def _claim_in_store(env: Mapping[str, str]) -> Verdict:
    """The first rank of the job to call this reports (atomic counter in the rendezvous store); a rank
    that cannot reach the store reports too, naming the store's host as lost. Never blocks for longer
    than the deadlines."""
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return Verdict(True)
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to ask: report rather than not
        return Verdict(True)
    return claim_report(store, env)


def claim_report(store: Any, env: Mapping[str, str] = os.environ) -> Verdict:
    """:func:`_claim_in_store` on a given store (see there)."""
    import torch.distributed as dist
    address = _tcp_address(store)
    gone = "refuses connections (the process exited or was killed; its own log, or the launcher's, says why)"
    if address is not None and _refuses(address):
        return Verdict(True, _lost(env, address, gone))
    with _cpp_warnings_muted():
        outcome = call_with_deadline(lambda: store.add(_CLAIM_KEY, 1), STORE_DEADLINE_S, "failure-claim")
    if not outcome.done:
        return Verdict(True, _lost(env, address, f"does not answer within {STORE_DEADLINE_S:.0f} s (the process is "
                                                  f"stopped or hung, or its node is unreachable)"), store)
    if isinstance(outcome.error, dist.DistNetworkError):  # it closed while we asked
        return Verdict(True, _lost(env, address, gone))
    if outcome.error is not None:
        return Verdict(True, store=store)  # the store misbehaves: twice is better than never
    return Verdict(outcome.value == 1, store=store)


def _abort_groups(store: Any = None) -> None:
    """Abort every process group (deadline-bound) and shut down this rank's connections to its peers
    (all but the rendezvous store's, when ``store`` is given): peers waiting on this rank in a collective,
    in any group, fail now rather than at the timeout. The store stays up while it is referenced."""
    import torch.distributed as dist
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        call_with_deadline(abort, ABORT_DEADLINE_S, "failure-abort")
    address = _tcp_address(store) if store is not None else None
    if address is not None:
        _close_peer_connections(address[1])


#: errors that mean "a peer went away", not "this rank went wrong": torch's distributed errors and gloo's
_PEER_FAILURE = re.compile(r"timed out|timeout|connection closed|connection reset|broken pipe|peer", re.I)


def _caused_by_peer(error: BaseException) -> bool:
    import torch.distributed as dist
    if isinstance(error, INPUT_ERRORS):
        return False
    return isinstance(error, getattr(dist, "DistError", ())) or bool(_PEER_FAILURE.search(str(error)[:2000]))


def check_in(store: Any, rank: int) -> None:
    """Tell the reporter that this rank reached its failure handler (deadline-bound)."""
    with _cpp_warnings_muted():
        call_with_deadline(lambda: store.set(_CHECK_IN_KEY.format(rank), "1"), STORE_DEADLINE_S, "failure-check-in")


def missing_ranks(store: Any, rank: int, world_size: int, wait_s: float = CENSUS_WAIT_S,
                  known: Sequence[int] = ()) -> list[int]:
    """The ranks other than ``rank`` (and ``known``, already found missing) that do not check in within
    ``wait_s``; returns as soon as all of them have."""
    def census() -> list[int]:
        seen, deadline = {rank, *known}, time.monotonic() + wait_s
        while True:
            for r in range(world_size):
                if r not in seen and store.check([_CHECK_IN_KEY.format(r)]):
                    seen.add(r)
            if len(seen) == world_size or time.monotonic() >= deadline:
                return sorted(set(range(world_size)) - seen - set(known))
            time.sleep(0.25)

    with _cpp_warnings_muted():
        outcome = call_with_deadline(census, wait_s + STORE_DEADLINE_S, "failure-census")
    return outcome.value if outcome.done and outcome.error is None else []


def _lost_peers(ranks: Sequence[int], wait_s: float) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return (f"lost rank{'s' if len(ranks) > 1 else ''} {shown}: no word from {'them' if len(ranks) > 1 else 'it'} "
            f"within {wait_s:.0f} s of this failure (stopped, hung, killed or unreachable; "
            f"{'their' if len(ranks) > 1 else 'its'} own log or the launcher's may say why)")


def _close_peer_connections(keep_port: int) -> int:
    """Shut down every TCP connection of this process except the rendezvous store's (``keep_port``, at
    either end): the peers blocked in a collective with this rank then fail at once ("Connection
    closed by peer"). Gloo's abort does that for the default group only; a peer waiting in another
    group (a pipeline or tensor-parallel one) would otherwise wait until this process exits, and then
    find the store gone with it. Linux only (/proc/self/fd); returns how many were shut down."""
    import stat
    count = 0
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            local, peer = sock.getsockname()[1], sock.getpeername()[1]  # a listening socket has no peer
            if keep_port not in (local, peer):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.close()
    return count


def _hosts_the_store(env: Mapping[str, str]) -> bool:
    """Rank 0 runs the rendezvous store, except under torchrun (whose agent keeps its own)."""
    import torch.distributed as dist
    return (dist.get_rank() == 0 and dist.get_world_size() > 1
            and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")


def verdict(env: Mapping[str, str] = os.environ, error: Optional[BaseException] = None) -> Verdict:
    """Whether this rank prints the error it caught (see the module docstring)."""
    import torch.distributed as dist
    if debug_requested(env):
        return Verdict(True)
    if dist.is_available() and dist.is_initialized():
        return _claim_in_store(env)
    if getattr(error, "every_rank_reports", False):  # rank 0 is the one missing: those that waited say so
        return Verdict(True, lost=str(error))
    return Verdict(launcher_rank(env) in (0, None))


def should_report(env: Mapping[str, str] = os.environ) -> bool:
    return verdict(env).report


_CPP_TRACE = re.compile(r"\s*(Exception raised from |frame #\d+:|<omitting python frames>).*", re.S)
_CPP_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|c|h|hpp):\d+\]\s*")


def plain_text(error: BaseException) -> str:
    """``str(error)`` on one line, without the C++ stack trace and source locations torch's errors carry."""
    text = _CPP_SOURCE.sub("", _CPP_TRACE.sub("", str(error)))
    return " ".join(text.split())


def message_of(error: BaseException, timeout_minutes: Optional[float], what: str = "training",
               lost: Optional[str] = None, peers_lost: bool = False) -> str:
    if isinstance(error, INPUT_ERRORS):
        return str(error) if str(error) else type(error).__name__
    text = plain_text(error).rstrip(".")
    if lost == str(error):  # the error is the news itself
        return f"{what} failed: {text}."
    if lost:
        timed_out = re.search(r"timed out|timeout", text, re.I) is not None
        after = (f" after --distributed-timeout-minutes ({timeout_minutes})" if peers_lost and timeout_minutes
                 and timed_out else "")
        return f"{what} failed: {lost}; this rank gave up{after} at {type(error).__name__}: {text}."
    hint = (f" If another rank died or hung, its own log (or the launcher's) says why; collectives "
            f"give up after --distributed-timeout-minutes ({timeout_minutes}).") if timeout_minutes else ""
    return f"{what} failed: {type(error).__name__}: {text}.{hint}"


def report_failure(error: BaseException, timeout_minutes: Optional[float] = None,
                   env: Mapping[str, str] = os.environ, what: str = "training") -> int:
    """Print ``error`` once per job (see the module docstring) and return the exit status; ``what``
    names the program's work in the message ("training", "generation")."""
    import torch.distributed as dist
    code = exit_code_of(error)
    initialized = _process_group_exists()
    rank, hosts_store = (dist.get_rank(), _hosts_the_store(env)) if initialized else (launcher_rank(env), False)
    world_size = dist.get_world_size() if initialized else None
    decided = verdict(env, error)
    if decided.lost and initialized and _was_stopped():
        # this rank was stopped and continued (mpirun continues a stopped rank to end it): the peers gave
        # up on *it*, and one of them reported that; "lost rank 0" from here would be wrong
        decided = Verdict(False)
    aborted, missing = False, []
    if initialized and decided.store is not None and not decided.lost and rank is not None:
        if not decided.report:
            check_in(decided.store, rank)
        elif _caused_by_peer(error) and world_size and world_size > 1:
            _abort_groups(decided.store)  # the survivors waiting on this rank fail now, and check in
            aborted = True
            missing = missing_ranks(decided.store, rank, world_size)
            if missing:
                decided.lost = _lost_peers(missing, CENSUS_WAIT_S)
                decided.peers_lost = True
    if decided.report:
        if decided.lost and rank is not None and not decided.peers_lost:  # no election without the store
            time.sleep(LOST_STAGGER_S * min(max(rank - 1, 0), 4))
        if debug_requested(env):
            log.error("".join(traceback.format_exception(error)).rstrip())
        hint = "" if debug_requested(env) or code == EXIT_INPUT_ERROR else f" (set {DEBUG_VAR}=1 for the traceback)"
        log.error(message_of(error, timeout_minutes, what, decided.lost, decided.peers_lost) + hint)
    if decided.lost and not decided.peers_lost:
        return code  # the store's host is gone or stuck: nothing to wait for, nobody to tell
    if initialized and not aborted:
        _abort_groups(decided.store)
    if not decided.report:
        time.sleep(SILENT_GRACE_S[1 if initialized else 0])
    elif hosts_store and decided.store is not None and rank is not None and world_size:
        # the others learn from the store that this was reported: they fail now (their connections to
        # this rank closed), check in, and stay silent; this rank leaves when all have, or at the bound
        missing_ranks(decided.store, rank, world_size, STORE_HOST_LINGER_S, known=missing)
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


def finish_and_exit(code: int = 0) -> None:
    """End a process whose work is done: run the ``atexit`` handlers while the interpreter is whole
    (DataLoader workers ended, log handlers flushed), then ``os._exit``, skipping the interpreter's
    finalisation. There, a daemon thread that returns from a torch call (which released the GIL)
    is unwound by ``pthread_exit`` through pybind11's noexcept ``gil_scoped_release`` destructor,
    and the process aborts: "terminate called without an active exception", SIGABRT, a finished job
    reported as failed by its launcher (tests/unit/test_clean_exit.py shows it)."""
    import atexit
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001 - a failing exit hook must not change a finished job's status
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not change the exit status
            pass
    os._exit(code)


def exit_with(code: int) -> None:
    """A tool's last line: exit with ``code``, at once when it is a failure (see :func:`flush_and_exit`),
    without the interpreter's finalisation when it is not (see :func:`finish_and_exit`)."""
    if code != 0:
        flush_and_exit(code)  # a failed job must not wait on its peers while shutting down
    finish_and_exit(code)


def silent_parse_grace() -> float:
    """How long a silent rank whose command line failed waits for rank 0 to print the same error and end the job:
    ``SILENT_GRACE_S[0]`` plus this rank's own age. Rank 0 started with it and does the same work, but on a loaded
    machine may be much slower to get there (beside a test suite and a CPU hog, a rank's imports took over 30 s);
    with a fixed 10 s this rank ended first, its launcher ended the job, and the error was never printed."""
    from megatron_ru.utils.processes import age_seconds
    return SILENT_GRACE_S[0] + (age_seconds(os.getpid()) or 0.0)


def parse_on_rank0(parse: Callable[[Sequence[str]], T], argv: Sequence[str]) -> T:
    """``parse(argv)`` with argparse's own output (a usage error, --help) from rank 0 only: every
    rank parses the same command line, and four copies of one error help nobody."""
    import io
    if launcher_rank() in (0, None):
        return parse(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return parse(argv)
        except SystemExit as e:
            if e.code:
                time.sleep(silent_parse_grace())  # rank 0 prints it and ends the job meanwhile
            raise


def distributed_tool_main(argv: Optional[Sequence[str]], parser: Callable[[], Any],
                          run: Callable[[Any, Sequence[str]], Any], what: str) -> int:
    """``main`` of a tool that every rank of a job runs (generation, evaluation): parse (output from
    rank 0), ``run(ns, argv)``, one message and exit status 2/1 on failure, 0 after a clean shutdown."""
    import torch.distributed as dist
    argv = sys.argv[1:] if argv is None else list(argv)
    watch_for_stops()
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
