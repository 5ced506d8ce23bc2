"""A real two-node Slurm cluster on this machine (loopback only), and the four batch files
submitted to it.

Node K listens on 127.0.1.K and has its own hostname (a UTS + mount namespace with a private
/etc/hosts). Every file the cluster writes lives in one temporary folder; the daemons are stopped
by PID at the end. Needs root and Debian's packages:
apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
"""

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import REPO, STAGES, free_port, stage_env

COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "unshare",
)
NODES = 2


def missing_requirement() -> str:
    if os.geteuid() != 0:
        return "the Slurm tests need root (they start munged, slurmctld and two slurmd)"
    missing = [d for d in COMMANDS if shutil.which(d) is None]
    if missing:
        packages = "slurmctld slurmd slurm-client munge"
        return (
            f"missing {', '.join(missing)}: apt-get install -y --no-install-recommends {packages}"
        )
    return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_daemon(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    if alive(pid):
        os.kill(pid, 15)
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, 9)


def write_config(root: Path) -> dict:
    for sub in ("etc", "state", "log", "run", "spool", "munge", "jobs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for sub in (root, root / "munge"):
        sub.chmod(0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ports = [free_port() for _ in range(NODES + 1)]
    hosts = Path("/etc/hosts").read_text() + "".join(
        f"127.0.1.{k} node{k}\n" for k in range(1, NODES + 1)
    )
    (root / "etc" / "hosts").write_text(hosts)
    (root / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    nodes = "".join(
        f"NodeName=node{k} NodeHostname=node{k} NodeAddr=127.0.1.{k} Port={ports[k]} CPUs=64 "
        f"RealMemory=1000 State=UNKNOWN\n"
        for k in range(1, NODES + 1)
    )
    (root / "etc" / "slurm.conf").write_text(f"""ClusterName=test
SlurmctldHost={os.uname().nodename.split(".")[0]}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket.2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/slurmd-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=10
MinJobAge=4
Waittime=0
MailProg=/bin/true
{nodes}PartitionName=debug Nodes=node[1-{NODES}] Default=YES MaxTime=INFINITE State=UP
""")
    return dict(os.environ, SLURM_CONF=str(root / "etc" / "slurm.conf"))


class ClusterError(Exception):
    pass


def start(root: Path) -> dict:
    """munged, slurmctld and one slurmd per node, all idle: the environment for Slurm's commands."""
    env = write_config(root)
    subprocess.run(
        [
            "munged",
            f"--key-file={root}/munge/munge.key",
            f"--socket={root}/munge/munge.socket.2",
            f"--pid-file={root}/munge/munged.pid",
            f"--log-file={root}/munge/munged.log",
            f"--seed-file={root}/munge/munged.seed",
        ],
        check=True,
        env=env,
        timeout=30,
    )
    subprocess.run(["slurmctld", "-i"], check=True, env=env, timeout=30)
    for k in range(1, NODES + 1):
        subprocess.run(
            [
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                f"hostname node{k} && mount --bind {root}/etc/hosts /etc/hosts "
                f"&& exec slurmd -N node{k}",
            ],
            check=True,
            env=env,
            timeout=30,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True
        ).stdout
        if states.split() == ["idle"] * NODES:
            return env
        time.sleep(0.1)
    raise ClusterError(
        "the Slurm nodes did not come up:\n"
        + "\n".join(p.read_text()[-2000:] for p in (root / "log").glob("*.log"))
    )


def stop(root: Path) -> None:
    """Cancel the jobs (slurmstepd outlives slurmd), then stop every daemon by the PID it wrote."""
    env = dict(os.environ, SLURM_CONF=str(root / "etc" / "slurm.conf"))
    if (root / "run" / "slurmctld.pid").exists():
        jobs = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True
        ).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=env, timeout=10)
            time.sleep(1)
    pid_files = [root / "run" / f"slurmd-node{k}.pid" for k in range(1, NODES + 1)]
    for pid_file in pid_files + [root / "run" / "slurmctld.pid", root / "munge" / "munged.pid"]:
        stop_daemon(pid_file)


def user_env(env: dict, **extra: str) -> dict:
    """A user's environment with the project's Python first on PATH, no test hooks."""
    env = dict(
        stage_env(SLURM_CONF=env["SLURM_CONF"], **extra),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("PYTHONPATH")
    return env


def copy_repo(cwd: Path) -> None:
    """The stages and the batch files, as a user's checkout has them."""
    cwd.mkdir(parents=True)
    for name in [f"{s}.py" for s in STAGES] + ["slurm"]:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, cwd / name)


def submit_all(env: dict, root: Path) -> dict:
    """Each batch file, unmodified, all at once from one copy of the repository, as a user with
    the project's environment active: sbatch --wait --gpus-per-node=0 slurm/STAGE.sh 1 1, with
    the files' defaults (2 processes a node). {stage: (folder, result, job log)}."""
    cwd = root / "jobs" / "repo"
    copy_repo(cwd)

    def submit(stage: str) -> tuple:
        result = subprocess.run(
            ["sbatch", "--wait", "--gpus-per-node=0", f"slurm/{stage}.sh", "1", "1"],
            cwd=cwd,
            env=user_env(env),
            capture_output=True,
            text=True,
            timeout=300,
        )
        job = result.stdout.split()[-1] if result.stdout.split() else "?"
        out = cwd / f"{stage}-{job}.out"
        return cwd, result, out.read_text() if out.exists() else ""

    with ThreadPoolExecutor(max_workers=len(STAGES)) as pool:
        return dict(zip(STAGES, pool.map(submit, STAGES), strict=True))


ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE")


def follow(
    env: dict, cwd: Path, sbatch_args: list, during=None, timeout: float = 900, hooks=None
) -> dict:
    """sbatch, from cwd, as a user; then the job is followed until it ends for good (not with
    `sbatch --wait`: it once returned as the job was requeued). A requeued job waits 2 minutes
    before it may start again: this starts it 3 s after it was requeued. during(job, log text)
    runs twice a second; hooks: tests/faults' variables for the job's processes. {"ended" (its
    last state), "job", "log", "state" (scontrol show job)}."""
    env = user_env(env, CPU_PROCS="1")
    if hooks:
        env.update(hooks, PYTHONPATH=str(REPO / "tests" / "faults"))
    command = ["sbatch", "--parsable", "--gpus-per-node=0", *map(str, sbatch_args)]
    submitted = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    job = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job, submitted.stderr
    deadline = time.monotonic() + timeout
    show = ["scontrol", "-o", "show", "job", job]
    state, status, ended, waiting = "", "", 0, 0
    while time.monotonic() < deadline:
        shown = subprocess.run(show, env=env, capture_output=True, text=True).stdout
        if "JobState=" not in shown and state:
            break  # gone from the controller (MinJobAge) since the last look: it ended
        state = shown or state
        status = state.split("JobState=")[-1].split()[0] if "JobState=" in state else ""
        ended = ended + 1 if status in ENDED else 0  # twice in a row: not a requeue passing
        if ended == 2:
            break
        requeued = status == "PENDING" and "Reason=BeginTime" in state
        waiting = waiting + 1 if requeued else 0  # half-seconds: let the last start's steps end
        if waiting == 6:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
        if during is not None:
            logs = list(cwd.glob(f"*-{job}.out"))
            during(job, logs[0].read_text() if logs else "")
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job], env=env)
    time.sleep(0.5)  # the log's last lines
    logs = list(cwd.glob(f"*-{job}.out"))
    log = logs[0].read_text() if logs else ""
    return {"ended": status, "job": job, "log": log, "state": state}
