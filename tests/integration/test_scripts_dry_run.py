"""DRY_RUN=1 output of the job scripts in faked scheduler environments, checked line by line,
plus the shell helpers they share (time limits, exit duration) and the qsub -g wrapper."""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.schedulers.system import wait_for_exit, wait_while_running

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[2]
QSUB_WRAPPER = REPO / "tests/integration/schedulers/bin/qsub"


def run_script(script: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "DRY_RUN": "1"}
    proc = subprocess.run(["bash", script], cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                          timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def abci_env(tmp_path: Path, hosts: list[str], job_id: int = 4242, **extra: str) -> dict[str, str]:
    (tmp_path / "hostlist").write_text("".join(f"{h}\n" for h in hosts))
    return {"JOB_ID": str(job_id), "SGE_JOB_HOSTLIST": str(tmp_path / "hostlist"),
            "SGE_LOCALDIR": str(tmp_path), "SAVE_DIR": str(tmp_path / "ckpt"), **extra}


def flag(tokens: list[str], name: str) -> str:
    return tokens[tokens.index(name) + 1]


def test_abci_two_nodes_four_gpus(tmp_path):
    out = run_script("scripts/abci/submit_multinode.sh", abci_env(tmp_path, ["node1", "node2"])).stdout
    lines = out.splitlines()
    hostfile = tmp_path / "hostfile.4242"
    assert lines[:7] == ["MASTER_ADDR=node1", "MASTER_PORT=19242", f"# hostfile {hostfile}",
                         "node1 slots=4", "node2 slots=4", "# command", lines[6]]
    assert len(lines) == 7
    assert hostfile.read_text() == "node1 slots=4\nnode2 slots=4\n"
    cmd = shlex.split(lines[6])
    assert cmd[:15] == ["mpirun", "-np", "8", "-npernode", "4", "--hostfile", str(hostfile),
                        "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PATH", "-x", "LD_LIBRARY_PATH"]
    mpi_end = cmd.index("python")
    # a SIGTERM that reaches mpirun itself leaves the ranks 60 s to save (Open MPI's default: 1 s)
    assert cmd[mpi_end - 7:mpi_end] == ["--mca", "odls_base_sigkill_timeout", "60", "-bind-to", "none", "-map-by",
                                        "slot"]
    train = cmd[mpi_end + 2:]
    assert cmd[mpi_end + 1] == str(REPO / "pretrain_gpt.py")
    assert "--use-mpi" not in train
    # the 345M GPT block at the top of the script, fp16 on V100, resume-aware save
    assert [flag(train, f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")] \
        == ["24", "1024", "16", "1024"]
    assert "--fp16" in train and "--exit-signal-handler" in train
    assert flag(train, "--save") == str(tmp_path / "ckpt") and "--load" not in train
    # h_rt=24:00:00 from the #$ line, 900 s kept to save: 85500 s = 1425 minutes of training
    assert flag(train, "--exit-duration-in-mins") == "1425.00"


def test_abci_port_resource_types_and_overrides(tmp_path):
    env = abci_env(tmp_path, ["a1", "a2", "a3"], job_id=123456, RESOURCE_TYPE="rt_AF", H_RT="2:00:00",
                   EXIT_MARGIN_SECONDS="600", TP="4", PP="2", EXTRA_ARGS="--recompute-granularity full")
    lines = run_script("scripts/abci/submit_multinode.sh", env).stdout.splitlines()
    assert lines[:2] == ["MASTER_ADDR=a1", "MASTER_PORT=23768"]  # 15000 + 123456 % 16384
    assert lines[3:6] == ["a1 slots=8", "a2 slots=8", "a3 slots=8"]
    cmd = shlex.split(lines[-1])
    assert cmd[1:5] == ["-np", "24", "-npernode", "8"]
    assert flag(cmd, "--tensor-model-parallel-size") == "4" and flag(cmd, "--pipeline-model-parallel-size") == "2"
    assert flag(cmd, "--exit-duration-in-mins") == "110.00"
    assert cmd[-2:] == ["--recompute-granularity", "full"]
    env.update(GPUS_PER_NODE="2")
    cmd = shlex.split(run_script("scripts/abci/submit_single_node.sh", env).stdout.splitlines()[-1])
    assert cmd[1:5] == ["-np", "6", "-npernode", "2"]


def test_abci_resume_and_initial_checkpoint(tmp_path):
    init = tmp_path / "hf_converted"
    init.mkdir()
    env = abci_env(tmp_path, ["node1"], INIT_CHECKPOINT=str(init))
    proc = run_script("scripts/abci/submit_single_node.sh", env, check=False)
    assert proc.returncode == 2 and f"INIT_CHECKPOINT={init} has no latest_checkpointed_iteration.txt" in proc.stderr
    (init / "latest_checkpointed_iteration.txt").write_text("0\n")
    cmd = shlex.split(run_script("scripts/abci/submit_single_node.sh", env).stdout.splitlines()[-1])
    assert cmd[cmd.index("--load"):cmd.index("--load") + 3] == ["--load", str(init), "--finetune"]
    # the model's shape comes from the initial checkpoint (an imported HF model), not the settings' defaults
    assert "--use-checkpoint-args" in cmd and "--num-layers" not in cmd and "--hidden-size" not in cmd
    no_init = shlex.split(run_script("scripts/abci/submit_single_node.sh", abci_env(tmp_path, ["node1"]))
                          .stdout.splitlines()[-1])
    assert "--use-checkpoint-args" not in no_init and flag(no_init, "--num-layers") == "24"
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("1200\n")
    proc = run_script("scripts/abci/submit_single_node.sh", env)
    cmd = shlex.split(proc.stdout.splitlines()[-1])
    assert flag(cmd, "--load") == str(save) and "--finetune" not in cmd and "--use-checkpoint-args" in cmd
    assert f"resuming from {save} (iteration 1200)" in proc.stderr


def test_abci_loads_modules_only_where_module_exists(tmp_path):
    env = abci_env(tmp_path, ["node1"])
    proc = run_script("scripts/abci/submit_single_node.sh", env)
    assert "no environment modules here" in proc.stderr
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "module_calls"
    (bindir / "module").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bindir / "module").chmod(0o755)
    env.update(PATH=f"{bindir}:/usr/local/bin:/usr/bin:/bin", ABCI_MODULES="cuda/12.1/12.1.1 hpcx/2.12")
    run_script("scripts/abci/submit_single_node.sh", env)
    assert calls.read_text().splitlines() == ["load cuda/12.1/12.1.1", "load hpcx/2.12"]


def test_abci_bad_settings_name_the_variable(tmp_path):
    proc = run_script("scripts/abci/submit_single_node.sh", abci_env(tmp_path, ["n1"], PRECISION="fp8"), check=False)
    assert proc.returncode == 2 and "PRECISION must be bf16, fp16 or fp32 (got 'fp8')" in proc.stderr
    proc = run_script("scripts/abci/submit_single_node.sh", abci_env(tmp_path, ["n1"], RESOURCE_TYPE="rt_C.large"),
                      check=False)
    assert proc.returncode == 2 and "unknown ABCI resource type 'rt_C.large': set GPUS_PER_NODE" in proc.stderr
    proc = run_script("scripts/abci/submit_single_node.sh",
                      abci_env(tmp_path, [], SGE_JOB_HOSTLIST=str(tmp_path / "missing")), check=False)
    assert proc.returncode == 2 and f"SGE_JOB_HOSTLIST={tmp_path / 'missing'} is not readable" in proc.stderr
    proc = run_script("scripts/abci/submit_single_node.sh", abci_env(tmp_path, []), check=False)
    assert proc.returncode == 2 and f"no hosts in {tmp_path / 'hostlist'}" in proc.stderr


def fake_bin(tmp_path: Path, name: str, body: str) -> str:
    """A directory holding one fake command NAME (a shell script); returns a PATH with it first."""
    bindir = tmp_path / f"fake_{name}"
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bindir / name).chmod(0o755)
    return f"{bindir}:/usr/local/bin:/usr/bin:/bin"


# How `scontrol show hostnames` behaves where the dry run may be tried: a Slurm cluster (here a
# stand-in that answers like one), a machine with Slurm's client installed but no configuration
# (what Debian's slurm-client prints on a fresh machine), and one without scontrol at all.
SCONTROL_WORKS = ('case "$3" in "gpu-[001-002]") printf "gpu-001\\ngpu-002\\n" ;;\n'
                  '  "gpu-[001-002],cpu07") printf "gpu-001\\ngpu-002\\ncpu07\\n" ;;\n'
                  '  *) echo "scontrol: error: Invalid node list" >&2; exit 1 ;; esac')
SCONTROL_UNCONFIGURED = ('echo "scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2\n'
                         'echo "scontrol: fatal: Could not establish a configuration source" >&2\nexit 1')


def path_without(tmp_path: Path, command: str) -> str:
    """A PATH with every command of the usual one except COMMAND (links in one directory), so
    a machine that has it installed can play one that has not."""
    bindir = tmp_path / f"no_{command}"
    bindir.mkdir()
    for d in ("/bin", "/usr/bin", "/usr/local/bin"):  # later directories win, as earlier ones do in PATH
        for exe in Path(d).iterdir():
            if exe.name != command:
                (bindir / exe.name).unlink(missing_ok=True)
                (bindir / exe.name).symlink_to(exe)
    return str(bindir)


@pytest.fixture(params=["scontrol", "unconfigured", "real-unconfigured", "no-scontrol"])
def slurm_tools(request, tmp_path) -> tuple[str, dict[str, str]]:
    """(case, environment) for the cases above; real-unconfigured is Debian's real scontrol
    (installed here when absent, never configured by this test) given an empty slurm.conf, which
    it refuses at once."""
    case = request.param
    if case == "scontrol":
        return case, {"PATH": fake_bin(tmp_path, "scontrol", SCONTROL_WORKS)}
    if case == "unconfigured":
        return case, {"PATH": fake_bin(tmp_path, "scontrol", SCONTROL_UNCONFIGURED)}
    if case == "real-unconfigured":
        if shutil.which("scontrol", path="/usr/local/bin:/usr/bin:/bin") is None:
            # Debian's client alone: installed, not configured, as on a login node of another cluster
            from tests.integration.schedulers.system import apt_install
            apt_install(["slurm-client"])
        (tmp_path / "empty_slurm.conf").touch()
        return case, {"SLURM_CONF": str(tmp_path / "empty_slurm.conf")}
    return case, {"PATH": path_without(tmp_path, "scontrol")}


def test_dry_run_expands_the_node_list_without_slurm(tmp_path, slurm_tools):
    """Where scontrol is missing or has no configuration, megatron_ru's own expander names the
    same hosts, and the log says why; a bad node list is refused with its reason."""
    case, tools = slurm_tools
    nodes = "gpu-[001-002],cpu07"
    proc = run_script("scripts/slurm/submit_torchrun.sbatch",
                      slurm_env(tmp_path, SLURM_JOB_NODELIST=nodes, SLURM_JOB_NUM_NODES="3", **tools))
    assert "job 77: 3 node(s) x 8 GPU(s), head gpu-001, master gpu-001:15077" in proc.stderr
    fallback = f"scontrol cannot expand {nodes} ("
    assert (fallback in proc.stderr) == (case in ("unconfigured", "real-unconfigured")), proc.stderr
    if case == "unconfigured":
        assert f"{fallback}scontrol: fatal: Could not establish a configuration source); using megatron_ru's " \
               "expander" in proc.stderr
    proc = run_script("scripts/slurm/submit_pyxis.sbatch", slurm_env(tmp_path, SLURM_JOB_NODELIST="gpu-[002-001]",
                                                                     **tools), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "descending range '002-001' in node list 'gpu-[002-001]'" in proc.stderr
    assert "[launch] error: cannot expand SLURM_JOB_NODELIST=gpu-[002-001]" in proc.stderr


def test_hostlist_command_prints_one_host_per_line():
    """`python -m megatron_ru.parallel.hostlist` and the file run alone (standard library only,
    how the job scripts call it) print what `scontrol show hostnames` prints."""
    for cmd in ([sys.executable, "-m", "megatron_ru.parallel.hostlist"],
                ["python3", "-I", str(REPO / "megatron_ru/parallel/hostlist.py")]):
        proc = subprocess.run([*cmd, "rack[1-2]-n[08-09],login"], capture_output=True, text=True, timeout=30, cwd=REPO)
        assert (proc.returncode, proc.stdout) == (0, "rack1-n08\nrack1-n09\nrack2-n08\nrack2-n09\nlogin\n")
        proc = subprocess.run([*cmd, "n[1-"], capture_output=True, text=True, timeout=30, cwd=REPO)
        assert proc.returncode == 2 and "cannot expand the node list 'n[1-': unclosed '['" in proc.stderr
        assert subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).returncode == 2


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu-[001-002]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "64", "TIME_LIMIT": "4:00:00",
            "SAVE_DIR": str(tmp_path / "ckpt"), **extra}


def test_slurm_srun_with_and_without_container(tmp_path, slurm_tools):
    proc = run_script("scripts/slurm/submit_pyxis.sbatch", slurm_env(tmp_path, **slurm_tools[1]))
    cmd = shlex.split(proc.stdout.strip())
    entry = cmd.index("python")
    assert cmd[:entry] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=8", "--ntasks=16",
                           "--cpus-per-task=8"]
    assert cmd[entry + 1] == str(REPO / "pretrain_gpt.py")
    assert flag(cmd, "--exit-duration-in-mins") == "225.00" and "--bf16" in cmd
    env = slurm_env(tmp_path, CONTAINER_IMAGE="/shared/megatron_ru.sqsh", **slurm_tools[1])
    cmd = shlex.split(run_script("scripts/slurm/submit_pyxis.sbatch", env).stdout.strip())
    entry = cmd.index("python")
    assert cmd[6:entry] == ["--container-image=/shared/megatron_ru.sqsh", f"--container-mounts={REPO}:{REPO}",
                            f"--container-workdir={REPO}"]
    assert cmd[entry + 1] == "/workspace/megatron_ru/pretrain_gpt.py"


def test_slurm_torchrun_rendezvous_on_head_node(tmp_path, slurm_tools):
    proc = run_script("scripts/slurm/submit_torchrun.sbatch", slurm_env(tmp_path, **slurm_tools[1]))
    cmd = shlex.split(proc.stdout.strip())
    t = cmd.index("torchrun")
    assert cmd[:6] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2",
                       "--cpus-per-task=64"]
    # torchrun handles SIGUSR1 only once it starts its workers (after the rendezvous): it starts with it ignored,
    # so that Slurm's warning before then does not kill it; the program it execs inherits that
    wrapper = cmd[6:t]
    assert wrapper[:2] == ["bash", "-c"] and len(wrapper) == 4, wrapper
    probe = ("import os, signal, time; assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN; "
             "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2); print('survived')")
    done = subprocess.run([*wrapper, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "survived", done.stdout + done.stderr
    # torchrun handles (passes on to its workers) only the signals named on its command line:
    # SIGUSR1/SIGUSR2 must be there or they kill torchrun and orphan the workers
    assert cmd[t:t + 8] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-id=77", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=gpu-001:15077", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,"
                            "SIGUSR1,SIGUSR2", str(REPO / "pretrain_gpt.py")]
    assert "head gpu-001, master gpu-001:15077" in proc.stderr


def test_squeue_that_does_not_answer_is_bounded(tmp_path):
    """Item 4 of issue 33: an unreachable Slurm controller costs SQUEUE_TIMEOUT_SECONDS, not the
    client's two minutes of retries; the job goes on without a time limit and says so."""
    env = slurm_env(tmp_path, PATH=fake_bin(tmp_path, "squeue", "sleep 120"), SQUEUE_TIMEOUT_SECONDS="1")
    del env["TIME_LIMIT"]
    started = time.monotonic()
    proc = run_script("scripts/slurm/submit_pyxis.sbatch", env)
    assert time.monotonic() - started < 30
    assert "squeue did not answer within 1 s: no time limit from Slurm (set TIME_LIMIT=H:M:S)" in proc.stderr
    assert "--exit-duration-in-mins" not in proc.stdout
    env["PATH"] = fake_bin(tmp_path, "squeue", "echo 1:02:03")
    cmd = shlex.split(run_script("scripts/slurm/submit_pyxis.sbatch", env).stdout.strip())
    assert flag(cmd, "--exit-duration-in-mins") == "47.05"


@pytest.mark.parametrize("job_id", [0, 77, 16383, 16384, 123456, 9876543])
def test_one_master_port_rule_for_scripts_and_package(tmp_path, job_id):
    """The Slurm and ABCI job scripts pick the port srun tasks would derive themselves
    (megatron_ru.parallel.env: 15000 + job id % 16384), always below the ephemeral range."""
    from megatron_ru.parallel.env import discover_environment

    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NODELIST": "gpu-[001-002]"}
    port = discover_environment(task).master_port
    assert port == 15000 + job_id % 16384 and 15000 <= port < 32768
    proc = run_script("scripts/slurm/submit_torchrun.sbatch",
                      slurm_env(tmp_path, SLURM_JOB_ID=str(job_id), PATH=path_without(tmp_path, "scontrol")))
    assert f"--rdzv-endpoint=gpu-001:{port}" in shlex.split(proc.stdout) and f"master gpu-001:{port}" in proc.stderr
    out = run_script("scripts/abci/submit_multinode.sh", abci_env(tmp_path, ["n1", "n2"], job_id=job_id)).stdout
    assert out.splitlines()[1] == f"MASTER_PORT={port}"


def shell(snippet: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source scripts/lib/launch.sh; {snippet}'],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("limit,seconds", [("90", 90), ("5:30", 330), ("1:00:00", 3600), ("24:00:00", 86400),
                                           ("1-02:03:04", 93784), ("2-12", 216000), ("08:09:07", 29347)])
def test_time_limits(limit, seconds):
    assert shell(f"to_seconds {limit}").stdout.strip() == str(seconds)


def test_bad_time_limit_and_exit_duration():
    proc = shell("to_seconds 1:xx:00")
    assert proc.returncode == 2 and "cannot read the time limit '1:xx:00' (expected H:M:S)" in proc.stderr
    # margin kept for the save; a job shorter than the margin still trains a tenth of its time
    assert shell("exit_duration_mins 86400 900").stdout.strip() == "1425.00"
    assert shell("exit_duration_mins 600 900").stdout.strip() == "1.00"


def test_qsub_wrapper_drops_only_the_group_option(tmp_path):
    fake = tmp_path / "qsub"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    proc = subprocess.run([str(QSUB_WRAPPER), "-g", "gcb50000", "-cwd", "-l", "rt_F=2", "-V", "job.sh", "-g", "x"],
                          env={**os.environ, "REAL_QSUB": str(fake)}, capture_output=True, text=True, timeout=30)
    assert proc.stdout.splitlines() == ["-cwd", "-l", "rt_F=2", "-V", "job.sh", "-g", "x"]


RANK_PROGRAM = """
import os, signal, sys, time
rank = os.environ["OMPI_COMM_WORLD_RANK"]
def handler(signum, frame):
    open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGUSR1, handler)
open(os.path.join(sys.argv[1], f"ready{rank}"), "w").close()
time.sleep(60)
sys.exit(3)
"""


@pytest.mark.parametrize("sig", ["TERM", "USR1", "USR2"])
def test_scheduler_signal_reaches_every_mpi_rank_as_usr1(tmp_path, sig):
    """The job shell turns the scheduler's SIGTERM/SIGUSR1/SIGUSR2 into SIGUSR1 for mpirun, which
    passes it to every rank (where --exit-signal-handler saves); the job's status is the ranks'."""
    prog = tmp_path / "rank.py"
    prog.write_text(RANK_PROGRAM)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    log = tmp_path / "job.txt"
    with open(log, "w") as out:
        shell_proc = subprocess.Popen(
            ["bash", "-c", f"set -euo pipefail; source scripts/lib/launch.sh; "
                           f"run_or_print mpirun -np 2 --oversubscribe python3 {prog} {tmp_path}"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_while_running(shell_proc, lambda: all((tmp_path / f"ready{r}").exists() for r in range(2)), 60,
                           "both ranks' ready files", log.read_text)
        shell_proc.send_signal(getattr(signal, f"SIG{sig}"))
        code = wait_for_exit(shell_proc, 30, f"the job shell after SIG{sig}", log.read_text)
    finally:
        if shell_proc.poll() is None:
            os.killpg(shell_proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["SIGUSR1", "SIGUSR1"], text
    assert "signal received: asking every rank to save and exit" in text


def test_abci_master_addr_is_the_first_hosts_bond0_address(tmp_path):
    """On the first host, MASTER_ADDR is its InfiniBand bond address (what ABCI's other nodes
    reach); without bond0 it falls back to the host name."""
    me = socket.gethostname().split(".")[0]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_ip = bindir / "ip"
    fake_ip.write_text('#!/bin/sh\n[ "$*" = "-4 -o addr show dev bond0" ] || exit 1\n'
                       'echo "5: bond0    inet 10.1.2.3/16 brd 10.1.255.255 scope global bond0"\n')
    fake_ip.chmod(0o755)
    env = abci_env(tmp_path, [me, "other"], PATH=f"{bindir}:/usr/local/bin:/usr/bin:/bin")
    assert run_script("scripts/abci/submit_multinode.sh", env).stdout.splitlines()[0] == "MASTER_ADDR=10.1.2.3"
    env.update(MASTER_IFACE="ib0")  # no such interface: the first host's name
    assert run_script("scripts/abci/submit_multinode.sh", env).stdout.splitlines()[0] == f"MASTER_ADDR={me}"


def test_no_layout_given_runs_auto_layout_and_a_given_one_is_kept(tmp_path, slurm_tools):
    """Without TP and PP the scripts ask pretrain_gpt.py to choose the layout for the job's GPUs (--auto-layout),
    keeping a micro batch or ZeRO stage that is set; with TP or PP set, the user's layout runs as given."""
    runs = {"abci": lambda **e: run_script("scripts/abci/submit_multinode.sh", abci_env(tmp_path, ["n1", "n2"], **e)),
            "slurm": lambda **e: run_script("scripts/slurm/submit_pyxis.sbatch", slurm_env(tmp_path, **slurm_tools[1], **e)),
            "torchrun": lambda **e: run_script("scripts/slurm/submit_torchrun.sbatch",
                                               slurm_env(tmp_path, **slurm_tools[1], **e))}
    for name, run in runs.items():
        cmd = shlex.split(run().stdout.strip().splitlines()[-1])
        assert "--auto-layout" in cmd, (name, cmd)
        assert not {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                    "--zero-stage"} & set(cmd), (name, cmd)
        cmd = shlex.split(run(ZERO_STAGE="2").stdout.strip().splitlines()[-1])
        assert "--auto-layout" in cmd and flag(cmd, "--zero-stage") == "2" and "--micro-batch-size" not in cmd, name
        cmd = shlex.split(run(TP="2").stdout.strip().splitlines()[-1])
        assert "--auto-layout" not in cmd, (name, cmd)
        assert [flag(cmd, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                       "--micro-batch-size", "--zero-stage")] \
            == ["2", "1", "4" if name == "abci" else "2", "1"], name
