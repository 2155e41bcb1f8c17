"""When the scheduler harness (tests/integration/schedulers) takes a job for ended: Slurm's final
states against its transient flags, the jobcomp/filetxt record, Grid Engine's state column and qacct
record, and the waits built on them, driven here by scripted answers instead of real daemons.

The fixture texts are real output of Slurm 22.05.8 and Grid Engine 8.1.9 on this kind of machine."""
from __future__ import annotations

import subprocess

import pytest

from tests.integration.schedulers import gridengine, slurm

# JobCompLoc of two jobs named "my job" (a name with a space), one exiting 3; they end in that order
JOBCOMP_LOG = (
    "JobId=2 UserId=root(0) GroupId=root(0) Name=my job JobState=FAILED Partition=ci TimeLimit=1 "
    "StartTime=2026-12-06T21:29:47 EndTime=2026-12-06T21:29:47 NodeList=vm NodeCnt=1 ProcCnt=1 WorkDir=/tmp/probe "
    "ReservationName= Tres=cpu=1,mem=24105M,node=1,billing=1 Account= QOS= WcKey= Cluster=unknown "
    "SubmitTime=2026-12-06T21:29:44 EligibleTime=2026-12-06T21:29:44 DerivedExitCode=0:0 ExitCode=3:0 \n"
    "JobId=1 UserId=root(0) GroupId=root(0) Name=my job JobState=COMPLETED Partition=ci TimeLimit=1 "
    "StartTime=2026-12-06T21:29:47 EndTime=2026-12-06T21:29:47 NodeList=vm NodeCnt=1 ProcCnt=1 WorkDir=/tmp/probe "
    "ReservationName= Tres=cpu=1,mem=24105M,node=1,billing=1 Account= QOS= WcKey= Cluster=unknown "
    "SubmitTime=2026-12-06T21:29:44 EligibleTime=2026-12-06T21:29:44 DerivedExitCode=0:0 ExitCode=0:0 \n"
)

# `qstat -u '*'` with job 1 running and job 2 in error (its -o path is in a missing directory)
QSTAT = """\
job-ID  prior   name       user         state submit/start at     queue                          slots ja-task-ID 
-----------------------------------------------------------------------------------------------------------------
      1 0.50000 sl.sh      root         r     12/06/2026 21:30:54 abci.q@vm                          1        
      2 0.50000 sl.sh      root         Eqw   12/06/2026 21:30:53                                    1        
"""  # noqa: W291 (qstat pads its columns)
QSTAT_ERROR_REASON = ('error reason          1:      12/06/2026 21:30:54 [0:8456]: error: can\'t open output file '
                      '"/nonexistent/dir/out.log": No such file or directory\n')

# the head and tail of `qacct -j 1` for a job that ran 4 s and exited 0
QACCT = """\
==============================================================
qname        abci.q              
hostname     vm                  
jobnumber    1                   
failed       0    
exit_status  0                   
ru_wallclock 4s
category     -l rt_F=1
"""  # noqa: W291


# ---------------------------------------------------------------------------------------------- Slurm

@pytest.mark.parametrize("state", sorted(slurm.FINAL_STATES))
def test_slurm_final_states(state):
    assert slurm.is_final(state)


@pytest.mark.parametrize("state", [
    # every flag scontrol shows in place of the base state while it is set (job_state_string, 22.05)
    "COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING",
    # base states of a job that has not ended, a word a later Slurm may add, no answer at all
    "PENDING", "RUNNING", "SUSPENDED", "POWER_UP_NODE", slurm.FORGOTTEN, "unknown (no answer)", "",
])
def test_slurm_transient_and_unknown_states_are_not_final(state):
    assert not slurm.is_final(state)


def test_jobcomp_record_fields():
    first = slurm.jobcomp_record(JOBCOMP_LOG, 1)
    assert (first["JobState"], first["ExitCode"], first["Name"], first["WorkDir"]) == \
        ("COMPLETED", "0:0", "my job", "/tmp/probe")
    assert first["ReservationName"] == "" and first["Tres"] == "cpu=1,mem=24105M,node=1,billing=1"
    second = slurm.jobcomp_record(JOBCOMP_LOG, 2)
    assert (second["JobId"], second["JobState"], second["ExitCode"]) == ("2", "FAILED", "3:0")


def test_jobcomp_record_is_the_jobs_last_complete_line():
    assert slurm.jobcomp_record(JOBCOMP_LOG, 12) is None  # JobId=1's line is not job 12's
    assert slurm.jobcomp_record(JOBCOMP_LOG.replace("JobId=1 ", "JobId=12 "), 1) is None
    # a requeued job has a record per run: the last one counts
    requeued = JOBCOMP_LOG.replace("JobId=2 ", "JobId=1 ").replace("JobState=FAILED", "JobState=NODE_FAIL")
    assert slurm.jobcomp_record(requeued, 1)["JobState"] == "COMPLETED"
    # job 2's line still being written after job 1's
    half_written = JOBCOMP_LOG.split("\n")[1] + "\n" + JOBCOMP_LOG.split("\n")[0]
    assert slurm.jobcomp_record(half_written, 2) is None
    assert slurm.jobcomp_record(half_written, 1)["JobState"] == "COMPLETED"


class ScriptedSlurm(slurm.SlurmCluster):
    """scontrol answers from a script, one per poll; the jobcomp log is a file the script appends to."""

    def __init__(self, states: list[str], record_from: int):
        super().__init__(host="vm")
        self.states, self.record_from, self.polls = states, record_from, 0

    def dump_stacks(self, job_id: int) -> str:
        return ""  # no job runs: a real job 1 of another test's cluster must not be sent SIGABRT

    def state(self, job_id: int) -> str:
        state = self.states[min(self.polls, len(self.states) - 1)]
        if self.polls == self.record_from:
            with open(slurm.JOBCOMP_LOG, "a") as f:
                f.write(JOBCOMP_LOG.split("\n")[1] + "\n")
        self.polls += 1
        return state


@pytest.fixture
def jobcomp_log(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "JOBCOMP_LOG", tmp_path / "jobcomp.log")
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    return tmp_path / "jobcomp.log"


def test_slurm_wait_ends_on_a_final_state_with_its_record(jobcomp_log):
    # the record is written as the job ends (still COMPLETING); a signal shows as SIGNALING before that
    cluster = ScriptedSlurm(["RUNNING", "SIGNALING", "RUNNING", "COMPLETING", "COMPLETING", "COMPLETED"], record_from=3)
    assert cluster.wait(1, timeout=60) == "COMPLETED"
    assert cluster.polls == 6
    assert cluster.exit_code(1) == "0:0"


def test_slurm_wait_takes_the_record_of_a_job_slurmctld_forgot(jobcomp_log, monkeypatch):
    monkeypatch.setattr(slurm, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))  # scancel
    assert ScriptedSlurm([slurm.FORGOTTEN], record_from=0).wait(1, timeout=5) == "COMPLETED"


def test_slurm_wait_needs_the_record(jobcomp_log, monkeypatch):
    monkeypatch.setattr(slurm, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))  # scancel
    cluster = ScriptedSlurm(["COMPLETED"], record_from=-1)
    with pytest.raises(TimeoutError, match=r"job 1 still COMPLETED \(scontrol\) after 0 s; its jobcomp record: none"):
        cluster.wait(1, timeout=0)


def test_slurm_wait_ignores_records_from_before_the_submission(jobcomp_log, monkeypatch):
    """A slurmctld whose saved state is gone numbers jobs from 1 again; the log still holds the old job 1's."""
    jobcomp_log.write_text(JOBCOMP_LOG)
    monkeypatch.setattr(slurm, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "1\n", ""))  # sbatch
    cluster = ScriptedSlurm(["COMPLETED"], record_from=-1)
    assert cluster.sbatch([], cwd=jobcomp_log.parent, env={}) == 1
    assert cluster.record(1) is None
    with pytest.raises(TimeoutError, match=r"still COMPLETED .* record: none"):
        cluster.wait(1, timeout=0)


# ---------------------------------------------------------------------------------------- Grid Engine

def test_qstat_state_column():
    assert gridengine.qstat_state(QSTAT, 1) == "r"
    assert gridengine.qstat_state(QSTAT, 2) == "Eqw"
    assert gridengine.qstat_state(QSTAT, 3) is None
    assert gridengine.qstat_state("", 1) is None  # qstat prints nothing once no job is left


@pytest.mark.parametrize("state, error", [
    ("qw", False), ("hqw", False), ("t", False), ("r", False), ("Rr", False), ("Rt", False), ("dr", False),
    ("dt", False), ("s", False), ("S", False), ("T", False), ("hRwq", False),
    ("Eqw", True), ("Ehqw", True), ("Ehrqw", True),
])
def test_qstat_error_states(state, error):
    assert gridengine.is_error_state(state) == error


def test_qacct_record():
    record = gridengine.qacct_record(QACCT)
    assert (record["exit_status"], record["failed"], record["ru_wallclock"]) == ("0", "0", "4s")
    assert gridengine.qacct_record("") is None  # stdout of `qacct -j N` before the record is written
    # a job id with two records (a rerun): the last one counts
    assert gridengine.qacct_record(QACCT.replace("exit_status  0", "exit_status  137") + QACCT)["exit_status"] == "0"


def scripted_ge(monkeypatch, answers: list[tuple[str, str]]) -> list[list[str]]:
    """gridengine.run answers `qstat -u *` and `qacct -j` from ANSWERS (qstat listing, qacct text), one
    pair per poll, and `qstat -j` with the error reason; returns the commands it was given."""
    commands: list[list[str]] = []
    polls = iter(answers)
    current = ["", ""]

    def run(cmd, **kwargs):
        commands.append(list(cmd))
        if cmd[:2] == ["qstat", "-u"]:
            current[:] = next(polls, answers[-1])
            out = current[0]
        elif cmd[0] == "qacct":
            out = current[1]
        elif cmd[:2] == ["qstat", "-j"]:
            out = QSTAT_ERROR_REASON
        else:
            out = ""
        return subprocess.CompletedProcess(cmd, 0, out, "")
    monkeypatch.setattr(gridengine, "run", run)
    monkeypatch.setattr(gridengine.time, "sleep", lambda s: None)
    return commands


def test_ge_wait_ends_when_qstat_forgot_the_job_and_qacct_has_it(monkeypatch):
    running = QSTAT.replace("Eqw", "qw ").replace(" r   ", " dr  ")
    commands = scripted_ge(monkeypatch, [(QSTAT, ""), (running, ""), ("", ""), ("", QACCT)])
    assert gridengine.GridEngine(host="vm").wait(1, timeout=60)["exit_status"] == "0"
    assert sum(c[:2] == ["qstat", "-u"] for c in commands) == 4


def test_ge_wait_fails_at_once_on_an_error_state(monkeypatch):
    commands = scripted_ge(monkeypatch, [(QSTAT, "")])
    with pytest.raises(RuntimeError, match=r"job 2 is in error state Eqw: .*can't open output file"):
        gridengine.GridEngine(host="vm").wait(2, timeout=5)
    assert ["qdel", "2"] in commands


@pytest.mark.parametrize("answer, seen", [
    ((QSTAT, ""), "still in state r after 0 s"),
    (("", ""), "still gone from qstat with no qacct record yet after 0 s"),
])
def test_ge_wait_timeout_names_what_it_saw(monkeypatch, answer, seen):
    scripted_ge(monkeypatch, [answer])
    with pytest.raises(TimeoutError, match=f"Grid Engine job 1 {seen}"):
        gridengine.GridEngine(host="vm").wait(1, timeout=0)


def test_a_job_that_outlives_its_wait_prints_its_python_stacks(tmp_path):
    """A timed-out wait sends SIGABRT to the job's Python processes (found by the job id in their
    environment) before the job is deleted: the log shows where each one stood."""
    import os
    import sys
    import time

    from tests.integration.schedulers.system import FAULTHANDLER_ENV, abort_for_stacks
    code = "import time\ndef waiting_for_the_peer():\n    time.sleep(120)\nprint('up', flush=True)\nwaiting_for_the_peer()\n"
    procs, logs = [], []
    for job in ("4242", "4243"):
        logs.append(tmp_path / f"{job}.log")
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **FAULTHANDLER_ENV, "TEST_JOB_ID": job}))
    try:
        deadline = time.monotonic() + 60
        while not all("up" in log.read_text() for log in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert abort_for_stacks("TEST_JOB_ID", "4242", settle_s=0) == \
            "; 1 Python processes of the job were sent SIGABRT: their stacks end its log"
        assert procs[0].wait(30) == -6  # SIGABRT
        assert "in waiting_for_the_peer" in logs[0].read_text(), logs[0].read_text()
        assert procs[1].poll() is None  # another job's process is left alone
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
