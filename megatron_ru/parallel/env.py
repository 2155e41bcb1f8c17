"""Rank discovery: turn the launcher's environment into one DistEnv, then init torch.distributed.

Order (first match wins):

1. torchrun / deepspeed launcher: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (+ ``LOCAL_WORLD_SIZE``)
2. OpenMPI ``mpirun``: ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
3. Slurm ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``
4. a single process

``MASTER_ADDR``/``MASTER_PORT`` are used when set. Otherwise: Slurm → first host of
``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST`` and a port derived from the job id; OpenMPI →
rank 0 shares its address and a free port over MPI (mpi4py) inside :func:`init_distributed`;
single process → no rendezvous needed at all (an in-memory store).

``python -m megatron_ru.parallel.env`` (under any launcher) prints one JSON line per rank.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from megatron_ru.parallel.hostlist import first_host
from megatron_ru.utils.logging import get_logger
from megatron_ru.utils import cli

log = get_logger("megatron_ru.parallel.env")  # also when run as __main__

SOURCES = ("torchrun", "openmpi", "slurm", "single")
#: Slurm ports: 15000 + job id % 16384 (15000-31383), below Linux's ephemeral range (32768+),
#: so concurrent jobs on shared nodes rarely collide and never race with outgoing connections.
#: The job scripts use the same rule (job_master_port in scripts/lib/launch.sh, Slurm and
#: ABCI alike; docs/cluster.md); tests/integration/test_scripts_dry_run.py checks they agree.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 16384

_VARS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


@dataclass(frozen=True)
class DistEnv:
    """What this process is in the job. ``master_addr``/``master_port`` are None when they still
    have to be shared over MPI (OpenMPI without MASTER_ADDR) or are not needed (single)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str
    #: where master_addr/port came from: "environment", "slurm", "mpi" (pending/broadcast), "none"
    master_from: str = "environment"


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; fix the launcher or "
                         f"job script that sets it") from None


def _check_complete(env: Mapping[str, str], source: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = ", ".join(f"{n}={env[n]!r}" for n in names if n in env)
        raise ValueError(f"incomplete {source} environment: {present} set but {', '.join(missing)} "
                         f"missing; a {source} launch sets all of {', '.join(names)} (set the missing "
                         "ones, or unset the others to run a single process)")


def _check_ranks(names: dict[str, str], rank: int, world: int, local: int, local_world: int) -> None:
    """``names`` maps rank/world/local/local_world to the variable each value came from."""
    def show(key: str, value: int) -> str:
        return f"{names[key]}={value}"
    problems = []
    if world < 1:
        problems.append(f"{show('world', world)} must be >= 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"{show('rank', rank)} must be in [0, {show('world', world)})")
    if local_world < 1:
        problems.append(f"{show('local_world', local_world)} must be >= 1")
    elif not 0 <= local < local_world:
        problems.append(f"{show('local', local)} must be in [0, {show('local_world', local_world)})")
    elif local_world > world >= 1:
        problems.append(f"{show('local_world', local_world)} exceeds {show('world', world)}")
    if problems:
        raise ValueError("inconsistent launcher environment: " + "; ".join(problems))


def _pick_source(env: Mapping[str, str]) -> str:
    for source, names in _VARS.items():
        if any(n in env for n in names[:2]):
            return source
    return "single"


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE/SLURM_TASKS_PER_NODE ('2(x3),1')."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts: list[int] = []
    try:
        for item in spec.split(","):
            num, _, rep = item.partition("(x")
            counts.extend([int(num)] * (int(rep.rstrip(")")) if rep else 1))
        node = int(env.get("SLURM_NODEID", "0"))
    except ValueError:
        raise ValueError(f"cannot parse the Slurm tasks-per-node {spec!r} / SLURM_NODEID="
                         f"{env.get('SLURM_NODEID')!r}") from None
    return counts[node] if node < len(counts) else None


def _master_from_env(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR") or None
    port = None
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return addr, port


def discover_environment(env: Mapping[str, str] = os.environ) -> DistEnv:
    """Pure: read ``env`` and return this process's DistEnv (no side effects)."""
    source = _pick_source(env)
    addr, port = _master_from_env(env)
    if source == "single":
        return DistEnv(0, 1, 0, 1, addr, port, "single", "environment" if addr else "none")
    names = _VARS[source]
    _check_complete(env, source, names)
    rank, world, local = (_int(env, n) for n in names)
    if source == "torchrun":
        lws_var = next((v for v in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if v in env), None)
        local_world = _int(env, lws_var) if lws_var else world
        lws_name = lws_var or "WORLD_SIZE"
    elif source == "openmpi":
        lws_name = "OMPI_COMM_WORLD_LOCAL_SIZE"
        local_world = _int(env, lws_name) if lws_name in env else world
    else:
        lws_name = "SLURM_STEP_TASKS_PER_NODE"
        local_world = _slurm_tasks_on_node(env) or world
    _check_ranks({"rank": names[0], "world": names[1], "local": names[2], "local_world": lws_name},
                 rank, world, local, local_world)
    master_from = "environment"
    if source == "slurm":
        if addr is None:
            nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                                 if env.get(v)), None)
            if nodelist_var is None:
                raise ValueError("Slurm launch without MASTER_ADDR and without SLURM_STEP_NODELIST/"
                                 "SLURM_JOB_NODELIST: set MASTER_ADDR to the first node's host name")
            try:
                addr = first_host(env[nodelist_var])
            except ValueError as e:
                raise ValueError(f"{nodelist_var}={env[nodelist_var]!r}: {e}") from None
            master_from = "slurm"
        if port is None:
            job_var = next((v for v in ("SLURM_JOB_ID", "SLURM_JOBID") if env.get(v)), None)
            if job_var is None:
                raise ValueError("Slurm launch without MASTER_PORT and without SLURM_JOB_ID: set "
                                 "MASTER_PORT to a free port shared by all tasks")
            port = SLURM_PORT_BASE + _int(env, job_var) % SLURM_PORT_SPAN
            master_from = "slurm"
    elif source == "openmpi" and (addr is None or port is None):
        master_from = "mpi"  # filled in by init_distributed from rank 0 over MPI
    elif source == "torchrun" and world > 1 and (addr is None or port is None):
        raise ValueError(f"RANK/WORLD_SIZE are set (WORLD_SIZE={world}) but MASTER_ADDR="
                         f"{env.get('MASTER_ADDR')!r}, MASTER_PORT={env.get('MASTER_PORT')!r}: set both "
                         "(torchrun and the deepspeed launcher do) to rank 0's host and a free port")
    return DistEnv(rank, world, local, local_world, addr, port, source, master_from)


def apply_environment(denv: DistEnv) -> None:
    """Write the discovered numbers into os.environ so torch and DeepSpeed see the same ones."""
    os.environ.update({"RANK": str(denv.rank), "WORLD_SIZE": str(denv.world_size),
                       "LOCAL_RANK": str(denv.local_rank),
                       "LOCAL_WORLD_SIZE": str(denv.local_world_size)})
    if denv.master_addr is not None and denv.master_port is not None and denv.master_from != "environment":
        os.environ["MASTER_ADDR"] = denv.master_addr
        os.environ["MASTER_PORT"] = str(denv.master_port)


def _own_address() -> str:
    """This host's address as other nodes should dial it: the first non-loopback IPv4 address
    the host name resolves to, else the host name itself."""
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except OSError:
        return host
    for *_, sockaddr in infos:
        if not sockaddr[0].startswith("127."):
            return sockaddr[0]
    return host


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def share_master_over_mpi(denv: DistEnv, timeout_minutes: float = 10) -> DistEnv:
    """Under mpirun without MASTER_ADDR/PORT: rank 0 broadcasts its address and a free port. MPI
    waits for every rank without a timeout: a watchdog ends this rank, with one line, when the
    exchange outlives ``timeout_minutes`` (--distributed-timeout-minutes)."""
    from megatron_ru.parallel.watchdog import StartupWatchdog
    what = (f"rank {denv.rank} waited --distributed-timeout-minutes ({timeout_minutes}) in MPI's exchange of rank 0's "
            f"address (mpi4py), which has no timeout of its own: another rank is stopped, hung or did not start "
            f"(mpirun names the ranks it ended); exporting MASTER_ADDR and MASTER_PORT to every rank (mpirun -x "
            f"MASTER_ADDR -x MASTER_PORT) skips this exchange")
    with StartupWatchdog(timeout_minutes * 60, what):
        return _exchange_over_mpi(denv)


def _exchange_over_mpi(denv: DistEnv) -> DistEnv:
    try:
        from mpi4py import MPI  # lazy: only MPI launches need it, and importing it starts MPI
    except ImportError:
        raise RuntimeError("launched by mpirun without MASTER_ADDR/MASTER_PORT, and mpi4py is not "
                           "installed to share rank 0's address: `pip install mpi4py`, or export "
                           "MASTER_ADDR=<rank 0 host> MASTER_PORT=<free port> to every rank "
                           "(mpirun -x MASTER_ADDR -x MASTER_PORT)") from None
    comm = MPI.COMM_WORLD
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    mine = (denv.master_addr or _own_address(), denv.master_port or _free_port()) if mpi_rank == 0 else None
    addr, port = comm.bcast(mine, root=0)
    # MPI's only job here is this broadcast: finalise it now, on every rank together. A process
    # that imported mpi4py otherwise runs MPI_Finalize at interpreter exit, which waits for every
    # other rank; a rank failing with an exception then never exits while the others sit in a
    # collective, and the job hangs until the scheduler kills it. Finalised, a failing rank simply
    # exits non-zero, and mpirun ends the whole job at once.
    MPI.Finalize()
    if (mpi_rank, mpi_size) != (denv.rank, denv.world_size):
        raise RuntimeError(f"MPI reports rank {mpi_rank} of {mpi_size} but the environment says rank "
                           f"{denv.rank} of {denv.world_size}")
    return dataclasses.replace(denv, master_addr=addr, master_port=port, master_from="mpi")


def abort_mpi_if_active(code: int) -> None:
    """``MPI_Abort`` the job when this process still has MPI initialised (it failed between
    mpi4py's import and :func:`share_master_over_mpi`'s finalise); otherwise do nothing."""
    if "mpi4py.MPI" not in sys.modules:
        return
    MPI = sys.modules["mpi4py.MPI"]
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)


def use_timeout_for_new_groups(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group created from now on.

    ``torch.distributed.new_group(ranks)`` without ``timeout=`` does not inherit the default group's
    timeout: it takes torch's built-in 30 minutes (gloo) or 10 (NCCL). DeepSpeed creates its own
    groups that way (pipeline grid, p2p and tied-weight groups, ``deepspeed.comm.new_group``), so a
    stopped or failed peer would keep a pipeline all_gather waiting for half an hour whatever
    --distributed-timeout-minutes says. torch reads these module globals each time it creates a group.
    """
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = timeout
    if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), timedelta):
        distributed_c10d.default_pg_nccl_timeout = timeout


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def choose_backend(backend: str | None = None) -> str:
    if backend in (None, "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--distributed-backend nccl needs CUDA, which is not available here; "
                         "use --distributed-backend gloo (or auto)")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"--distributed-backend {backend!r}: choose nccl, gloo or auto")
    return backend


def init_distributed(backend: str | None = None, timeout_minutes: float = 10) -> DistEnv:
    """Discover, apply, share the MPI address if needed, pick backend/device, init the group.

    Every process group created afterwards, by us or by DeepSpeed, gets the same timeout
    (:func:`use_timeout_for_new_groups`). Idempotent: when torch.distributed is already
    initialised, returns the discovered env (after checking rank and world size agree) without
    re-initialising."""
    denv = discover_environment(os.environ)
    timeout = timedelta(minutes=timeout_minutes)
    use_timeout_for_new_groups(timeout)
    if denv.master_from == "mpi" and not dist.is_initialized():
        denv = share_master_over_mpi(denv, timeout_minutes)
    apply_environment(denv)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (denv.rank, denv.world_size):
            raise RuntimeError(f"torch.distributed already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but the environment says rank {denv.rank} of "
                               f"{denv.world_size}")
        return denv
    backend = choose_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(default_device())
    log.info(f"rank discovery: source={denv.source} rank={denv.rank}/{denv.world_size} local_rank="
             f"{denv.local_rank}/{denv.local_world_size} master={denv.master_addr}:{denv.master_port} "
             f"(from {denv.master_from}) backend={backend}", extra={"rank0_only": True})
    if denv.world_size == 1:
        # nothing to rendezvous with: an in-memory store avoids picking a port at all
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if denv.rank != 0:  # torch's own wait for it prints a C++ stack trace per retry
            wait_for_store(str(denv.master_addr), int(denv.master_port), timeout_minutes, denv.rank)
        url = f"tcp://{_url_host(denv.master_addr)}:{denv.master_port}"
        try:
            dist.init_process_group(backend, init_method=url,
                                    rank=denv.rank, world_size=denv.world_size, timeout=timeout)
        except RuntimeError as e:  # DistStoreError, DistNetworkError, gloo's own
            first = " ".join(str(e).split("Exception raised from")[0].split())[:200]
            if not any(w in first.lower() for w in ("timed out", "timeout")):  # e.g. rank 0 cannot listen on
                raise                                                         # MASTER_PORT: its own error
            raise RendezvousTimeout(  # the others did not all join in time: rank 0 may be the one missing
                f"rank {denv.rank}: the process group did not form within --distributed-timeout-minutes "
                f"({timeout_minutes}) at {denv.master_addr}:{denv.master_port} ({first}): another rank is "
                f"stopped, hung, failed or did not start") from None
    return denv


class RendezvousTimeout(RuntimeError):
    """Rank 0's rendezvous store did not come up in time. Rank 0 cannot say so (it is the one
    missing), so every rank that waited reports it (megatron_ru.parallel.failure)."""
    every_rank_reports = True


#: torch's TCPStore protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a client's first message is
#: VALIDATE (query 0) with this number; PING (query 13) with a nonce is answered with the nonce
_STORE_VALIDATE, _STORE_MAGIC, _STORE_PING = 0, 0x3C85F7CE, 13


def _store_answers(sock: socket.socket, timeout: float) -> bool:
    """Whether the server on ``sock`` reads and answers: validated, then pinged, it sends the nonce back (or, a
    torch whose protocol differs, closes the connection: it read and answered all the same). A listening socket
    whose process is stopped or hung (the kernel completes the connection for it) answers nothing."""
    import struct
    sock.settimeout(timeout)
    sock.sendall(struct.pack("=BI", _STORE_VALIDATE, _STORE_MAGIC) + struct.pack("=BI", _STORE_PING, os.getpid()))
    try:
        sock.recv(4)
    except socket.timeout:
        return False
    except OSError:  # reset by the server: it read, and refused
        return True
    return True


#: a wait for rank 0's store that fails ends on this grid of the hosts' clocks (seconds): the ranks waiting for a
#: rank 0 that never comes give up in the same instant, and the failure report's stagger (rank 1 first) then
#: orders their lines. Ended by their own start-ups, seconds apart on a loaded node, two printed at once.
DEADLINE_GRID_S = 10.0


def common_deadline(timeout_s: float, grid_s: float = DEADLINE_GRID_S) -> float:
    """The ``time.monotonic()`` value at which a wait of at least ``timeout_s`` ends: the first multiple of
    ``grid_s`` of the wall clock (``time.time()``, the same on every host of a cluster) after it."""
    import math
    now_wall, now = time.time(), time.monotonic()
    return now + math.ceil((now_wall + timeout_s) / grid_s) * grid_s - now_wall


def wait_for_store(addr: str, port: int, timeout_minutes: float, rank: int) -> None:
    """Wait until rank 0's rendezvous store at ``addr:port`` answers, at least ``timeout_minutes`` (ending on
    the clocks' 10 s grid: :func:`common_deadline`); :class:`RendezvousTimeout` when it does not by then. Plain
    connects and one ping per try (nothing is printed per try): a connection alone is not enough, the kernel
    completes it for a rank 0 stopped right after it began to listen, and torch's own client then printed a C++
    stack trace per retry."""
    deadline = common_deadline(timeout_minutes * 60)
    while True:
        why = "no answer"
        try:
            wait = max(1.0, min(5.0, deadline - time.monotonic()))
            with socket.create_connection((addr, port), timeout=wait) as sock:
                if _store_answers(sock, wait):
                    return
                why = "it accepted the connection and did not answer"
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise RendezvousTimeout(
                f"rank {rank} waited --distributed-timeout-minutes ({timeout_minutes}) for rank 0's rendezvous "
                f"store at {addr}:{port} ({why}): rank 0 is stopped, hung, failed before it got there or did not "
                f"start, or MASTER_ADDR/MASTER_PORT do not name its host and a free port") from None
        time.sleep(0.5)


def _url_host(addr: str | None) -> str:
    return f"[{addr}]" if addr and ":" in addr else str(addr)


def _group_check(state, kind: str, members: list[int], group) -> bool:
    """All-reduce the global rank over ``group``: proves the group really holds ``members``."""
    t = torch.tensor([float(state.rank)], device=state.device)
    dist.all_reduce(t, group=group)
    return int(t.item()) == sum(members)


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per rank: what it discovered, its backend, device and groups."""
    import json

    from megatron_ru.config.base import parse_configs, validate_all
    from megatron_ru.config.parallel import ParallelConfig
    from megatron_ru.parallel.state import ParallelState

    description = ("Report rank discovery and process groups, one JSON line per rank (run under "
                   "torchrun, mpirun or srun).")
    cfg = parse_configs([ParallelConfig], argv, description=description)[ParallelConfig]
    try:
        validate_all([cfg])
        denv = init_distributed(cfg.backend, cfg.distributed_timeout_minutes)
    except (ValueError, RuntimeError) as e:  # a user mistake: say it plainly, no traceback
        cli.error(str(e))
        return 2
    try:
        state = ParallelState.build(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                    sequence_parallel=cfg.sequence_parallel,
                                    timeout_minutes=cfg.distributed_timeout_minutes)
        report = dataclasses.asdict(denv)
        report.update(hostname=socket.gethostname(), backend=dist.get_backend(), device=str(state.device))
        report.update(state.describe())
        checks = {"tp": (state.tp_ranks, state.tp_group), "dp": (state.dp_ranks, state.dp_group),
                  "pp": (state.pp_ranks, state.pp_group), "mp": (state.mp_ranks, state.mp_group)}
        report["allreduce_ok"] = {k: _group_check(state, k, m, g) for k, (m, g) in checks.items()}
        cli.emit(json.dumps(report, sort_keys=True))
    except ValueError as e:  # e.g. WORLD_SIZE not divisible by TP x PP
        cli.error(f"rank {denv.rank}: {e}")
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
