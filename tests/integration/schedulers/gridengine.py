"""A real one-node Grid Engine 8.1.9 cell on loopback, configured like an ABCI node.

ABCI specifics reproduced: the resource types ``rt_F`` (a whole 4-GPU node) and
``rt_G.small`` (one GPU) as job-consumable complexes with capacity on the queue, the
``$SGE_JOB_HOSTLIST``/``$SGE_LOCALDIR`` variables (a queue starter_method) and a ``qsub``
that accepts ``-g GROUP`` (the wrapper in ``bin/``).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .system import abort_for_stacks, apt_install, kill_job_processes, read_pid, run, stop_pids, unavailable, wait_for

SGE_ROOT = Path("/var/lib/gridengine")
SGE_CELL = "default"
HERE = Path(__file__).resolve().parent
QSUB_WRAPPER_DIR = HERE / "bin"
STARTER_METHOD = HERE / "starter_method.sh"
QUEUE = "abci.q"
# ABCI resource types: name -> capacity of the one node (rt_F: the whole node, rt_G.small: 1 of 4 GPUs)
RESOURCE_TYPES = {"rt_F": 1, "rt_G.small": 4}


def qstat_state(listing: str, job_id: int) -> str | None:
    """JOB_ID's state column in a ``qstat`` listing (qw, hqw, t, r, Rr, s, dr, Eqw, ...), or None
    once the listing no longer has the job."""
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0] == str(job_id):
            return fields[4]
    return None


def is_error_state(state: str) -> bool:
    """A job in Grid Engine's E state (Eqw: it could not be started) stays queued until someone
    clears or deletes it: no wait for it to end can succeed."""
    return "E" in state


def qacct_record(text: str) -> dict[str, str] | None:
    """``qacct -j``'s record (the last one when the job id has several) as a dict, or None while it
    has none with an exit_status."""
    record: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            record[parts[0]] = parts[1].strip()
    return record if "exit_status" in record else None


def sge_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, SGE_ROOT=str(SGE_ROOT), SGE_CELL=SGE_CELL)
    env.update(extra or {})
    return env


def _debconf(host: str) -> str:
    return "\n".join([
        "gridengine-common shared/gridengineconfig boolean true",
        "gridengine-common shared/gridenginecell string default",
        f"gridengine-common shared/gridenginemaster string {host}",
    ]) + "\n"


@dataclass
class GridEngine:
    host: str = field(default_factory=socket.gethostname)
    started: list[int] = field(default_factory=list)

    @property
    def common(self) -> Path:
        return SGE_ROOT / SGE_CELL / "common"

    @property
    def qmaster_pid_file(self) -> Path:
        return Path("/var/spool/gridengine/qmaster/qmaster.pid")

    @property
    def execd_pid_file(self) -> Path:
        # the execd names its spool directory after the name the qmaster resolved for it, which
        # is "localhost" on machines whose hostname maps to 127.0.0.1; take whichever exists
        spool = Path("/var/spool/gridengine/execd")
        found = sorted(spool.glob("*/execd.pid"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else spool / self.host / "execd.pid"

    def qconf(self, *args: str, check: bool = True) -> str:
        return run(["qconf", *args], env=sge_env(), check=check, timeout=30).stdout

    # ------------------------------------------------------------------ bring-up
    def ensure_installed(self) -> None:
        if all(shutil.which(b) for b in ("sge_qmaster", "sge_execd", "qconf")) and \
                (self.common / "act_qmaster").exists():
            return
        apt_install(["gridengine-master", "gridengine-exec", "gridengine-client", "msmtp-mta"],
                    debconf=_debconf(self.host))

    def write_host_aliases(self) -> None:
        # When the hostname resolves to 127.0.0.1 and that reverses to "localhost", the qmaster
        # refuses clients ("client IP resolved to host name localhost") unless they are aliased.
        try:
            addr = socket.gethostbyname(self.host)
            reverse = socket.gethostbyaddr(addr)[0]
        except OSError:
            return
        if reverse != self.host:
            (self.common / "host_aliases").write_text(f"{self.host} {reverse}\n")

    def start(self) -> None:
        self.write_host_aliases()
        self._start_daemon("sge_qmaster", lambda: self.qmaster_pid_file)
        wait_for(lambda: run(["qstat"], env=sge_env(), check=False).returncode == 0, 30,
                 "the qmaster to answer qstat", describe=lambda: run(["qstat"], env=sge_env(), check=False).stderr.strip())
        with tempfile.TemporaryDirectory() as tmp:
            # the execd reads the global configuration (min_uid for root jobs) when it starts
            self._configure_cluster(Path(tmp))
            self._start_daemon("sge_execd", lambda: self.execd_pid_file)
            self._queue(Path(tmp))
        run(["qmod", "-c", f"{QUEUE}@{self.host}"], env=sge_env(), check=False)  # clear a stale error state
        wait_for(self._queue_ready, 30, f"queue {QUEUE} on {self.host} to accept jobs",
                 describe=lambda: m.group(0) if (m := self._queue_instance()) else "no such queue instance")

    def _start_daemon(self, daemon: str, pid_file) -> None:
        if read_pid(pid_file()) is None:
            # a minimal environment (jobs inherit the execd's), detached from pytest's pipes
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root",
                   "SGE_ROOT": str(SGE_ROOT), "SGE_CELL": SGE_CELL}
            subprocess.run([daemon], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True, check=True, timeout=60)
            wait_for(lambda: read_pid(pid_file()) is not None, 30, f"{daemon} to write its pid file",
                     describe=lambda: f"no live PID in {pid_file()}")
            self.started.append(read_pid(pid_file()))  # type: ignore[arg-type]

    def _configure_cluster(self, d: Path) -> None:
        self.qconf("-as", self.host, check=False)  # already a submit host → harmless error
        glob = self.qconf("-sconf", "global")
        glob = re.sub(r"^min_uid\s+\S+", "min_uid 0", glob, flags=re.M)
        glob = re.sub(r"^min_gid\s+\S+", "min_gid 0", glob, flags=re.M)
        # qacct reads the accounting file, which the qmaster flushes every 15 s by default
        glob = re.sub(r"\bflush_time=\S+", "flush_time=00:00:01 accounting_flush_time=00:00:00", glob)
        (d / "global").write_text(glob)  # -Mconf takes the configuration name from the file name
        self.qconf("-Mconf", str(d / "global"))
        sched = re.sub(r"^schedule_interval\s+\S+", "schedule_interval 0:0:1",
                       self.qconf("-ssconf"), flags=re.M)
        (d / "sched").write_text(sched)
        self.qconf("-Msconf", str(d / "sched"))
        self._complexes(d)
        for pe, rule in (("smp", "$pe_slots"), ("mpi", "$fill_up")):
            (d / pe).write_text(f"pe_name {pe}\nslots 9999\nuser_lists NONE\nxuser_lists NONE\n"
                                "start_proc_args NONE\nstop_proc_args NONE\n"
                                f"allocation_rule {rule}\ncontrol_slaves TRUE\njob_is_first_task TRUE\n"
                                "urgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n")
            exists = pe in self.qconf("-spl", check=False).split()
            self.qconf("-Mp" if exists else "-Ap", str(d / pe))

    def _complexes(self, d: Path) -> None:
        lines = [ln for ln in self.qconf("-sc").splitlines()
                 if ln.split()[:1] not in (["rt_F"], ["rt_G.small"])]
        # consumable JOB: charged once per job, not per slot (per-slot would never fit)
        lines += [f"{rt:<20}{rt:<12}INT  <=  YES  JOB  0  0" for rt in RESOURCE_TYPES]
        (d / "complexes").write_text("\n".join(lines) + "\n")
        self.qconf("-Mc", str(d / "complexes"))

    def _queue(self, d: Path) -> None:
        slots = os.cpu_count() or 1
        capacity = ",".join(f"{rt}={n}" for rt, n in RESOURCE_TYPES.items())
        (d / QUEUE).write_text(
            f"qname {QUEUE}\nhostlist {self.host}\nseq_no 0\nload_thresholds NONE\nsuspend_thresholds NONE\n"
            f"nsuspend 1\nsuspend_interval 00:05:00\npriority 0\nmin_cpu_interval 00:05:00\n"
            f"processors UNDEFINED\nqtype BATCH INTERACTIVE\nckpt_list NONE\npe_list smp mpi\nrerun FALSE\n"
            f"slots {slots}\ntmpdir /tmp\nshell /bin/bash\nprolog NONE\nepilog NONE\n"
            f"shell_start_mode unix_behavior\nstarter_method {STARTER_METHOD}\nsuspend_method NONE\n"
            f"resume_method NONE\nterminate_method NONE\nnotify 00:00:60\nowner_list NONE\n"
            f"user_lists NONE\nxuser_lists NONE\nsubordinate_list NONE\ncomplex_values {capacity}\n"
            f"projects NONE\nxprojects NONE\ncalendar NONE\ninitial_state default\n"
            "s_rt INFINITY\nh_rt INFINITY\ns_cpu INFINITY\nh_cpu INFINITY\ns_fsize INFINITY\n"
            "h_fsize INFINITY\ns_data INFINITY\nh_data INFINITY\ns_stack INFINITY\nh_stack INFINITY\n"
            "s_core INFINITY\nh_core INFINITY\ns_rss INFINITY\nh_rss INFINITY\ns_vmem INFINITY\n"
            "h_vmem INFINITY\n")
        if QUEUE in self.qconf("-sql", check=False).split():
            self.qconf("-Mq", str(d / QUEUE))
        else:
            self.qconf("-Aq", str(d / QUEUE))

    def _queue_instance(self) -> re.Match | None:
        """The queue instance's line in ``qstat -f``; group 1 is its states column (a, u, E, d, ...)."""
        out = run(["qstat", "-f", "-q", QUEUE], env=sge_env(), check=False).stdout
        return re.search(rf"^{re.escape(QUEUE)}@\S+\s+\S+\s+\S+\s+\S+\s+\S+\s*(\S*)$", out, flags=re.M)

    def _queue_ready(self) -> bool:
        m = self._queue_instance()
        return bool(m) and not any(c in m.group(1) for c in "auEdDsS")

    def stop(self) -> None:
        # jobs first, while the qmaster can still end them; then the daemons; then whatever a job left behind
        if self.started:
            try:
                def jobs() -> list[str]:
                    listing = run(["qstat", "-u", "*"], env=sge_env(), check=False, timeout=10).stdout
                    return [line.split()[0] for line in listing.splitlines()[2:] if line.split()]
                left = jobs()
                if left:
                    run(["qdel", "-f", *left], env=sge_env(), check=False, timeout=10)
                    try:
                        wait_for(lambda: not jobs(), 30, f"Grid Engine jobs {' '.join(left)} to end", interval=0.5)
                    except TimeoutError:
                        pass
            except (subprocess.TimeoutExpired, OSError):  # a daemon not answering: the kill below
                pass
        stop_pids(self.started, timeout=20)  # the qmaster takes ~8 s to shut down
        self.started.clear()
        kill_job_processes(["sge_shepherd"])
        read_pid(self.qmaster_pid_file)
        read_pid(self.execd_pid_file)

    # ------------------------------------------------------------------ jobs
    def submit_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for running ``qsub``: the -g-dropping wrapper first on PATH."""
        env = sge_env(extra)
        env["PATH"] = f"{QSUB_WRAPPER_DIR}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def qsub(self, args: list[str], *, cwd: Path, env: dict[str, str]) -> int:
        out = run(["qsub", "-terse", *args], cwd=cwd, env=env).stdout.strip()
        return int(out.split(".")[0])

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until qstat no longer lists the job and qacct has its record; return the record.
        A job in an error state (Eqw) fails at once with Grid Engine's reason."""
        deadline = time.monotonic() + timeout
        while True:
            listing = run(["qstat", "-u", "*"], env=sge_env(), check=False)
            if listing.returncode != 0:
                seen = f"unknown (qstat failed: {listing.stderr.strip()})"
            elif (state := qstat_state(listing.stdout, job_id)) is None:
                record = self.accounting(job_id)
                if record is not None:
                    return record
                seen = "gone from qstat with no qacct record yet"
            elif is_error_state(state):
                why = [ln.strip() for ln in run(["qstat", "-j", str(job_id)], env=sge_env(), check=False).stdout.splitlines()
                       if ln.startswith("error reason")]
                run(["qdel", str(job_id)], env=sge_env(), check=False)
                raise RuntimeError(f"Grid Engine job {job_id} is in error state {state}: {'; '.join(why) or 'no reason given'}")
            else:
                seen = f"in state {state}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        stacks = self.dump_stacks(job_id)
        run(["qdel", str(job_id)], env=sge_env(), check=False)
        raise TimeoutError(f"Grid Engine job {job_id} still {seen} after {timeout:.0f} s{stacks}")

    def dump_stacks(self, job_id: int) -> str:
        """Before the job is deleted: its Python processes print their stacks into its log (the message says so)."""
        return abort_for_stacks("JOB_ID", str(job_id))

    def accounting(self, job_id: int) -> dict[str, str] | None:
        """The job's accounting record (qacct: written once it has ended), or None."""
        return qacct_record(run(["qacct", "-j", str(job_id)], env=sge_env(), check=False).stdout)


def bring_up() -> GridEngine:
    if os.geteuid() != 0:
        unavailable("a real Grid Engine needs root to start sge_qmaster and sge_execd")
    ge = GridEngine()
    ge.ensure_installed()
    try:
        ge.start()
    except BaseException:
        ge.stop()
        raise
    return ge
