"""A real one-node Slurm 22.05 cluster on loopback (munged, slurmctld, slurmd as root).

The node advertises two fake GPUs as a count-only ``gpu`` GRES so job scripts written for GPU
nodes (``--gres=gpu:N``) are accepted unchanged; the tests then run on CPU with gloo.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .system import abort_for_stacks, apt_install, kill_job_processes, read_pid, run, spawn, stop_pids, unavailable, wait_for

CONF_DIR = Path("/etc/slurm")
MARKER = "# written by the megatron_ru scheduler test harness"
SPOOL = Path("/var/spool/megatron_ru_slurm")
FAKE_GPUS = 2
# one record per ended job (JobState, ExitCode): Slurm's own final word where there is no slurmdbd
JOBCOMP_LOG = SPOOL / "jobcomp.log"
# Slurm's terminal base states. scontrol's JobState shows a flag instead (COMPLETING, SIGNALING,
# STAGE_OUT, REQUEUED, STOPPED, ...: job_state_string in src/common/slurm_protocol_defs.c) while one
# is set, so a word from this set means the job ended and nothing of it is still going on; any other
# word, known or not, means it has not ended.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
FORGOTTEN = "UNKNOWN"  # what state() says of a job slurmctld no longer knows (purged MinJobAge after its end)


def is_final(state: str) -> bool:
    """Whether scontrol's (or a jobcomp record's) JobState word says the job has ended for good."""
    return state in FINAL_STATES


def jobcomp_record(text: str, job_id: int) -> dict[str, str] | None:
    """The last complete jobcomp/filetxt record of JOB_ID in TEXT (the JobCompLoc file), as its
    ``Key=Value`` fields, or None. A value may hold spaces (Name, WorkDir): it runs up to the next
    `` Key=``. A line still being written (no newline yet) is not a record."""
    found = None
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.startswith(f"JobId={job_id} "):
            found = dict(re.findall(r"(\w+)=(.*?)(?= \w+=|\s*$)", line))
    return found


#: the job scripts take MASTER_PORT from the job id (15000 + id % 16384), and Grid Engine's harness numbers its
#: jobs from 1 as Slurm does by default: two schedulers' first jobs on one machine would share port 15001 (a
#: Slurm job once failed with EADDRINUSE right after a Grid Engine job was killed at its h_rt); on a cluster only
#: one scheduler runs
FIRST_JOB_ID = 20000


def _slurm_conf(host: str, node_line: str) -> str:
    return f"""{MARKER}
ClusterName=megatron-ru-ci
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={JOBCOMP_LOG}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
FirstJobId={FIRST_JOB_ID}
GresTypes=gpu
KillWait=10
StateSaveLocation={SPOOL}/ctld
SlurmdSpoolDir={SPOOL}/d
SlurmctldPidFile={SPOOL}/slurmctld.pid
SlurmdPidFile={SPOOL}/slurmd.pid
SlurmctldLogFile={SPOOL}/slurmctld.log
SlurmdLogFile={SPOOL}/slurmd.log
{node_line} Gres=gpu:{FAKE_GPUS} State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    host: str = field(default_factory=socket.gethostname)
    started: list[int] = field(default_factory=list)
    #: job id -> size of the jobcomp log when it was submitted (its record comes after)
    jobcomp_offsets: dict[int, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ bring-up
    def ensure_installed(self) -> None:
        if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
            return
        apt_install(["slurm-wlm", "munge"])

    def configure(self) -> None:
        conf = CONF_DIR / "slurm.conf"
        if conf.exists() and MARKER not in conf.read_text():
            unavailable(f"{conf} exists and was not written by this harness; not touching a real cluster")
        # the node line must match the hardware, or slurmd registers a smaller node and is drained
        node_line = run(["slurmd", "-C"]).stdout.splitlines()[0]
        node_line = re.sub(r"\s*UpTime=\S+", "", node_line)
        for sub in ("ctld", "d"):
            (SPOOL / sub).mkdir(parents=True, exist_ok=True)
        conf.write_text(_slurm_conf(self.host, node_line))
        # the gpu plugin counts character devices; copies of /dev/null stand in for /dev/nvidiaN
        for i in range(FAKE_GPUS):
            dev = SPOOL / f"fake_gpu{i}"
            if not dev.is_char_device():
                dev.unlink(missing_ok=True)
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (CONF_DIR / "gres.conf").write_text(
            f"{MARKER}\nAutoDetect=off\nNodeName={self.host} Name=gpu File={SPOOL}/fake_gpu[0-{FAKE_GPUS - 1}]\n")

    def start(self) -> None:
        munge = pwd.getpwnam("munge")
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(run_dir, munge.pw_uid, munge.pw_gid)
        # every daemon runs in the foreground as our child, so its PID is known from the start
        if read_pid(run_dir / "munged.pid") is None:
            self.started.append(spawn(["munged", "--foreground"], SPOOL / "munged.out", user="munge"))
            self._wait(lambda: (run_dir / "munge.socket.2").exists(), "munged", "munged.out",
                       lambda: f"no {run_dir / 'munge.socket.2'}")
        for daemon, extra in (("slurmctld", ["-c"]), ("slurmd", [])):
            if read_pid(SPOOL / f"{daemon}.pid") is None:
                self.started.append(spawn([daemon, "-D", *extra], SPOOL / f"{daemon}.out"))

        def ping() -> str:
            proc = run(["scontrol", "ping"], check=False, timeout=10)
            return f"scontrol ping: {(proc.stdout + proc.stderr).strip()}"
        self._wait(lambda: "UP" in ping(), "slurmctld", "slurmctld.log", ping)
        self._wait(self._node_idle, "the Slurm node to become idle", "slurmd.log",
                   lambda: "sinfo: " + run(["sinfo", "-h", "-N", "-o", "%T %E"], check=False, timeout=10).stdout.strip())

    def _wait(self, predicate, what: str, log_name: str, describe) -> None:
        try:
            wait_for(predicate, 60, what, interval=0.3, describe=describe)
        except TimeoutError as e:
            log = SPOOL / log_name
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
            raise TimeoutError(f"{e}; last lines of {log}:\n{tail}") from None

    def _node_idle(self) -> bool:
        out = run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10).stdout.strip()
        if out in ("down", "drained", "down*", "drained*"):
            run(["scontrol", "update", f"NodeName={self.host}", "State=RESUME"], check=False, timeout=10)
        return out == "idle"

    def stop(self) -> None:
        # jobs first, while slurmctld can still end them; then slurmd and slurmctld (they still talk to munged while
        # shutting down); then whatever a job left behind
        if self.started:
            try:
                jobs = run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.split()
                if jobs:
                    run(["scancel", *jobs], check=False, timeout=10)
                    try:
                        wait_for(lambda: not run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.strip(),
                                 30, f"Slurm jobs {' '.join(jobs)} to end", interval=0.5)
                    except TimeoutError:
                        pass
            except (subprocess.TimeoutExpired, OSError):  # a daemon not answering: the kill below
                pass
        stop_pids(self.started[1:])
        stop_pids(self.started[:1])
        self.started.clear()
        kill_job_processes(["slurmstepd"])
        for pid_file in (SPOOL / "slurmctld.pid", SPOOL / "slurmd.pid", Path("/run/munge/munged.pid")):
            read_pid(pid_file)  # removes the file when its daemon is gone

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: list[str], *, cwd: Path, env: dict[str, str]) -> int:
        # the jobcomp log outlives clusters, and job ids start at 1 again when slurmctld's saved
        # state is gone: only a record written after the submission can be this job's
        offset = JOBCOMP_LOG.stat().st_size if JOBCOMP_LOG.exists() else 0
        out = run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        job_id = int(out.split(";")[0])
        self.jobcomp_offsets[job_id] = offset
        return job_id

    def wait(self, job_id: int, timeout: float) -> str:
        """Wait until the job has ended for good: scontrol shows a final state with no flag left
        (or has forgotten the job) and its jobcomp record is written; return the record's JobState."""
        deadline = time.monotonic() + timeout
        while True:
            state, record = self.state(job_id), self.record(job_id)
            if record is not None and (is_final(state) or state == FORGOTTEN):
                return record.get("JobState", "?")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        stacks = self.dump_stacks(job_id)
        run(["scancel", str(job_id)], check=False)
        raise TimeoutError(f"Slurm job {job_id} still {state} (scontrol) after {timeout:.0f} s; its jobcomp "
                           f"record: {' '.join(f'{k}={v}' for k, v in record.items()) if record else 'none'}{stacks}")

    def dump_stacks(self, job_id: int) -> str:
        """Before the job is cancelled: its Python processes print their stacks into its log (the message says so)."""
        return abort_for_stacks("SLURM_JOB_ID", str(job_id))

    def record(self, job_id: int) -> dict[str, str] | None:
        """The job's jobcomp record (written as it ends, with its final JobState and ExitCode), or None."""
        try:
            with open(JOBCOMP_LOG, encoding="utf-8", errors="replace") as f:
                f.seek(self.jobcomp_offsets.get(job_id, 0))
                return jobcomp_record(f.read(), job_id)
        except FileNotFoundError:
            return None

    def state(self, job_id: int) -> str:
        """scontrol's JobState now (a flag such as COMPLETING while one is set), FORGOTTEN once
        slurmctld no longer knows the job."""
        proc = run(["scontrol", "show", "job", str(job_id)], check=False, timeout=10)
        m = re.search(r"JobState=(\S+)", proc.stdout)
        if m:
            return m.group(1)
        return FORGOTTEN if "Invalid job id" in proc.stderr else f"unknown ({proc.stderr.strip() or 'no answer'})"

    def exit_code(self, job_id: int) -> str:
        """The job's ExitCode (``code:signal``): from its jobcomp record once written, else scontrol's."""
        record = self.record(job_id)
        if record is not None:
            return record.get("ExitCode", "?")
        out = run(["scontrol", "show", "job", str(job_id)], check=False, timeout=10).stdout
        m = re.search(r"\bExitCode=(\S+)", out)
        return m.group(1) if m else "?"


def bring_up() -> SlurmCluster:
    if os.geteuid() != 0:
        unavailable("a real Slurm needs root to start munged, slurmctld and slurmd")
    cluster = SlurmCluster()
    cluster.ensure_installed()
    cluster.configure()
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster
