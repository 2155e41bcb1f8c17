"""The ``--save`` directory of a job: one job at a time, no checkpoint overwritten by a run that does not
continue it, and nothing a killed save left behind.

* **The lock.** Rank 0 holds ``DIR/megatron_ru.lock`` for the whole run: an exclusive ``flock`` on the file
  (released by the kernel when the process ends, however it ends) and, in the file, who holds it (host,
  PID, the process's start time, the scheduler's job id, when it started, a heartbeat refreshed every
  ``HEARTBEAT_S``). A second job finds the ``flock`` taken and refuses in one line naming the holder. A
  lock file whose ``flock`` is free but whose holder is recorded was left by a job that died without
  releasing it (SIGKILL, a node failure): taken over with a warning when that is certain — the same host
  and the PID gone (or reused by another process), or the same scheduler job id (a requeued job) — and
  refused otherwise: on another host the PID cannot be checked, and a file system whose ``flock`` is local
  to each node (Lustre's ``localflock``) would let two nodes in. The refusal says how long ago the holder
  last refreshed the lock (over ``STALE_AFTER_S``: it is almost certainly gone) and to remove the file.
  On a file system without working locks (``flock`` unsupported) the file's contents alone decide,
  with a warning that two jobs started in the same second could both pass.
* **The pointer.** A ``--save`` that holds complete checkpoints (``iter_*/metadata.json``) is written only
  by a run that continues them: ``--load`` is the same directory and ``latest_checkpointed_iteration.txt``
  (or ``--ckpt-step N``) says from where. Without a pointer, or with ``--load`` elsewhere, the run would
  start over and replace them at its first saves: refused (exit 2), naming the iterations found and the
  ways on (``--ckpt-step N`` to resume iteration N, another ``--save``, or moving them away).
* **Leftovers.** Under the lock, rank 0 removes what killed saves left: ``iter_N`` directories without
  ``metadata.json`` newer than the pointer (all of them when no complete checkpoint exists) and the
  pointer's temporary files, in one log line. A complete iteration and the directory the pointer names are
  never touched.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_ru.checkpointing.files import CheckpointError
from megatron_ru.checkpointing.meta import (TRACKER_FILE, complete_iterations, iteration_dir_name,
                                            list_iterations, read_latest_iteration)
from megatron_ru.utils.logging import get_logger
from megatron_ru.utils.processes import running, start_time

log = get_logger(__name__)

LOCK_FILE = "megatron_ru.lock"
#: seconds between refreshes of the lock's heartbeat
HEARTBEAT_S = 60.0
#: a lock on another host not refreshed for this long is reported as left by a job that is gone
STALE_AFTER_S = 600.0
#: how long a lock whose holder died may stay held by processes it started (data-loader workers end within seconds)
ORPHAN_WAIT_S = 20.0
#: environment variables naming the scheduler's job (Slurm, Grid Engine, PBS, LSF)
JOB_ID_VARS = ("SLURM_JOB_ID", "JOB_ID", "PBS_JOBID", "LSB_JOBID")


class SaveDirBusy(CheckpointError):
    """Another job holds the --save directory."""


def job_id(env: Optional[dict[str, str]] = None) -> Optional[str]:
    env = os.environ if env is None else env
    for var in JOB_ID_VARS:
        if env.get(var):
            return f"{var}={env[var]}"
    return None


def _alive(holder: dict[str, Any]) -> bool:
    pid = holder.get("pid")
    return isinstance(pid, int) and pid > 0 and running(pid, holder.get("pid_start"))


def describe(holder: dict[str, Any], now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    job = f", job {holder['job']}" if holder.get("job") else ""
    started = holder.get("started")
    since = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f"PID {holder.get('pid')} on {holder.get('host')}{job}{since}"


@dataclass
class _Record:
    host: str
    pid: int
    pid_start: Optional[str]
    job: Optional[str]
    started: float
    heartbeat: float


class SaveDirLock:
    """``lock = SaveDirLock(save_dir).acquire()`` ... ``lock.release()``; raises :class:`SaveDirBusy`."""

    def __init__(self, save_dir: str) -> None:
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILE)
        self._fd: Optional[int] = None
        self._record: Optional[_Record] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: a warning said while taking the lock (taken over from a dead job, locks unsupported)
        self.note: Optional[str] = None

    # -- reading a holder ---------------------------------------------------------------------------
    def _read(self, fd: int) -> Optional[dict[str, Any]]:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            raw += chunk
        if not raw.strip():
            return None
        try:
            holder = json.loads(raw.decode("utf-8", errors="replace"))
        except ValueError:
            return {"pid": None, "host": "an unknown host (the lock file is not readable JSON)"}
        return holder if isinstance(holder, dict) else None

    def _busy(self, holder: Optional[dict[str, Any]], why: str) -> SaveDirBusy:
        who = describe(holder) if holder else "another process"
        return SaveDirBusy(f"--save {self.save_dir} is in use by another job ({who}; {why}): two jobs writing one "
                           f"--save directory overwrite each other's checkpoints. Wait for that job to end, or give "
                           f"this one another --save; if that job is no longer running, remove {self.path}")

    def _judge_recorded(self, holder: dict[str, Any], locks_work: bool) -> Optional[SaveDirBusy]:
        """A holder recorded in a file whose flock is free (or on a file system without flock): None when it
        is certainly gone (then self.note says so), else the refusal."""
        here = socket.gethostname()
        mine = job_id()
        if holder.get("pid") == os.getpid() and holder.get("host") == here:
            return None  # an earlier run in this process that did not release it
        if mine is not None and holder.get("job") == mine:
            self.note = (f"took over {self.path} from an earlier run of this job ({describe(holder)}), which is "
                         f"gone (a requeued or restarted job)")
            return None
        if holder.get("host") == here:
            if _alive(holder):
                if locks_work:  # alive but not holding the flock: it is not a training job any more
                    self.note = (f"took over {self.path}: its holder ({describe(holder)}) no longer holds the lock")
                    return None
                return self._busy(holder, "that process is running")
            self.note = f"took over {self.path} from a job that ended without releasing it ({describe(holder)})"
            return None
        beat = holder.get("heartbeat") or holder.get("started")
        age = time.time() - beat if isinstance(beat, (int, float)) else None
        if age is None:
            why = "its host is another machine, where this job cannot check the process"
        elif age > STALE_AFTER_S:
            why = (f"it was last refreshed {age / 60:.0f} min ago (a running job refreshes it every "
                   f"{HEARTBEAT_S:.0f} s), so that job is almost certainly gone")
        else:
            why = (f"it was refreshed {age:.0f} s ago; its host is another machine, where this job cannot check "
                   f"the process")
        return self._busy(holder, why)

    # -- taking and giving back ---------------------------------------------------------------------
    def acquire(self, orphan_wait_s: float = ORPHAN_WAIT_S) -> "SaveDirLock":
        os.makedirs(self.save_dir, exist_ok=True)
        deadline = time.monotonic() + orphan_wait_s
        attempts = 0
        while True:  # the file may be removed by its holder between our open and our flock
            attempts += 1
            if attempts > 5 and time.monotonic() > deadline:
                raise SaveDirBusy(f"could not take the lock {self.path}: it was removed and re-created while this "
                                  f"job tried; another job is starting on --save {self.save_dir}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            locks_work = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self._read(fd)
                    os.close(fd)
                    if holder and holder.get("host") == socket.gethostname() and not _alive(holder):
                        # the holder died; the processes it forked (data-loader workers) still hold the file
                        # open until they notice, within seconds
                        if time.monotonic() < deadline:
                            time.sleep(0.5)
                            continue
                        raise self._busy(holder, f"that process is gone, but processes it started still hold the "
                                                 f"lock after {orphan_wait_s:.0f} s") from None
                    raise self._busy(holder, "it holds the lock now") from None
                locks_work = False  # ENOLCK, EOPNOTSUPP, EINVAL: the file system has no working flock
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # we locked a file its holder has just removed: try the new one
                os.close(fd)
                continue
            holder = self._read(fd)
            if holder is not None:
                refusal = self._judge_recorded(holder, locks_work)
                if refusal is not None:
                    os.close(fd)
                    raise refusal
            if not locks_work:
                unsupported = (f"the file system of {self.save_dir} does not support flock: the lock is a file "
                               f"only, and two jobs started within the same second could both take it")
                self.note = f"{self.note}; {unsupported}" if self.note else unsupported
            self._fd = fd
            now = time.time()
            self._record = _Record(socket.gethostname(), os.getpid(), start_time(os.getpid()), job_id(), now, now)
            self._write()
            self._thread = threading.Thread(target=self._beat, name="save-dir-lock", daemon=True)
            self._thread.start()
            return self

    def _write(self) -> None:
        assert self._fd is not None and self._record is not None
        data = json.dumps(self._record.__dict__).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data + b"\n", 0)
        os.fsync(self._fd)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self._fd is None or self._record is None:
                return
            try:
                self._record.heartbeat = time.time()
                self._write()
            except OSError:
                pass  # a file system hiccup: the next beat tries again

    def release(self) -> None:
        """Remove the file, then drop the flock (a waiting job then finds the file gone and makes its own)."""
        self._stop.set()
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


# ---- the pointer and the leftovers -------------------------------------------------------------------

def overwrite_problem(save_dir: str, load_dir: Optional[str], ckpt_step: Optional[int],
                      read_pointer: Optional[Callable[[], Optional[int]]] = None) -> Optional[str]:
    """Why this run would replace complete checkpoints in ``save_dir`` that it does not continue (None: it
    does not). Raises :class:`CheckpointError` for a pointer that cannot be read. ``read_pointer``: how to
    learn ``save_dir``'s pointer (default: read the file)."""
    complete = complete_iterations(save_dir)
    if not complete:
        return None
    found = ", ".join(iteration_dir_name(i) for i in complete[-4:])
    if len(complete) > 4:
        found = f"{len(complete)} complete checkpoints, the newest {found}"
    continues = load_dir is not None and os.path.realpath(load_dir) == os.path.realpath(save_dir)
    pointer = (read_pointer or (lambda: read_latest_iteration(save_dir)))()
    newer = [i for i in complete if ckpt_step is not None and i > ckpt_step]
    if continues and newer:
        return (f"--ckpt-step {ckpt_step} resumes iteration {ckpt_step} of --load {load_dir}, which is also --save and "
                f"holds later checkpoints ({', '.join(iteration_dir_name(i) for i in newer[-4:])}): this run's saves "
                f"would replace them with another continuation. Give another --save for it (it still loads iteration "
                f"{ckpt_step} from --load), or move the later directories away")
    if continues and (pointer is not None or ckpt_step is not None):
        return None
    ways = (f"pass --ckpt-step N to resume iteration N ({complete[-1]} is the newest), give another --save, or "
            f"move those directories away to start over")
    if continues:
        return (f"--load {load_dir} is also --save and holds {found} but no {TRACKER_FILE} (it was deleted, or "
                f"copied without it): this run would start from scratch and overwrite them. To continue, {ways}")
    where = f"--load {load_dir}" if load_dir else "no --load"
    return (f"--save {save_dir} holds {found} (pointer: {pointer if pointer is not None else 'none'}) that this run, "
            f"starting from {where}, does not continue: its saves would replace them. To continue them, pass "
            f"--load {save_dir}; otherwise give another --save, or move those directories away to start over")


def remove_leftovers(save_dir: str, read_pointer: Optional[Callable[[], Optional[int]]] = None) -> list[str]:
    """Remove what killed saves left in ``save_dir`` (see the module's docstring); the removed paths.
    ``read_pointer``: as in :func:`overwrite_problem`."""
    if not os.path.isdir(save_dir):
        return []
    pointer = (read_pointer or (lambda: read_latest_iteration(save_dir)))()
    complete = complete_iterations(save_dir)
    removed = []
    for it in list_iterations(save_dir):
        if it in complete or it == pointer:
            continue
        if pointer is not None and it < pointer:
            continue
        if pointer is None and complete:
            continue  # without a pointer only the overwrite check decides what belongs to the run
        path = os.path.join(save_dir, iteration_dir_name(it))
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for name in sorted(os.listdir(save_dir)):
        if name.startswith(f"{TRACKER_FILE}.tmp"):
            path = os.path.join(save_dir, name)
            try:
                os.remove(path)
                removed.append(path)
            except OSError:
                pass
    return removed


#: locks this process holds, by real path: a second run in one process (tests, notebooks) replaces its own
_HELD: dict[str, SaveDirLock] = {}


def release_all() -> None:
    for lock in list(_HELD.values()):
        lock.release()
    _HELD.clear()


atexit.register(release_all)


def claim_save_dir(save_dir: str, load_dir: Optional[str], ckpt_step: Optional[int],
                   read_pointer: Optional[Callable[[], Optional[int]]] = None) -> SaveDirLock:
    """Rank 0 at start-up: take the lock, refuse a run that would overwrite checkpoints it does not continue,
    remove leftovers of killed saves. Raises :class:`CheckpointError` (the lock is released first).
    ``read_pointer``: how to learn ``save_dir``'s pointer, called once, under the lock (default: read the
    file; training passes what ``--load`` read when it is the same directory, so that the pointer the checks
    see is the one the run loads)."""
    key = os.path.realpath(save_dir)
    if key in _HELD:
        _HELD.pop(key).release()
    lock = SaveDirLock(save_dir).acquire()
    _HELD[key] = lock
    try:
        if lock.note:
            log.warning(lock.note)
        pointer = (read_pointer or (lambda: read_latest_iteration(save_dir)))()
        problem = overwrite_problem(save_dir, load_dir, ckpt_step, lambda: pointer)
        if problem:
            raise CheckpointError(problem)
        removed = remove_leftovers(save_dir, lambda: pointer)
        if removed:
            log.info(f"removed what interrupted saves left in {save_dir}: "
                     f"{', '.join(os.path.relpath(p, save_dir) for p in removed)}")
    except BaseException:
        lock.release()
        _HELD.pop(key, None)
        raise
    return lock
