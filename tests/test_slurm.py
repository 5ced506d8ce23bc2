"""The four sbatch files, unmodified, on a real two-node Slurm cluster brought up on this machine (loopback only).

Node K listens on 127.0.1.K and has its own hostname (a UTS + mount namespace with a private /etc/hosts). Every file
the cluster writes lives under the test's temporary folder; the daemons are stopped by PID at the end.
Needs root and Debian's packages: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import EPOCH_LINE, REPO, free_port, load, stage_env

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "unshare")
NODES = 2


def missing_requirement() -> str:
    if os.geteuid() != 0:
        return "the Slurm tests need root (they start munged, slurmctld and two slurmd)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
    return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(pid_file: Path) -> None:
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
    hosts = Path("/etc/hosts").read_text() + "".join(f"127.0.1.{k} node{k}\n" for k in range(1, NODES + 1))
    (root / "etc" / "hosts").write_text(hosts)
    (root / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    nodes = "".join(f"NodeName=node{k} NodeHostname=node{k} NodeAddr=127.0.1.{k} Port={ports[k]} CPUs=16 "
                    f"RealMemory=1000 State=UNKNOWN\n" for k in range(1, NODES + 1))
    (root / "etc" / "slurm.conf").write_text(f"""ClusterName=test
SlurmctldHost={os.uname().nodename.split('.')[0]}(127.0.0.1)
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
KillWait=2
MinJobAge=4
Waittime=0
MailProg=/bin/true
{nodes}PartitionName=debug Nodes=node[1-{NODES}] Default=YES MaxTime=INFINITE State=UP
""")
    return dict(os.environ, SLURM_CONF=str(root / "etc" / "slurm.conf"))


@pytest.fixture(scope="module")
def cluster():
    reason = missing_requirement()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {reason}")
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))  # not under pytest's 0700 folder: munged wants o+x on the path
    env = write_config(root)
    pid_files = [root / "munge" / "munged.pid", root / "run" / "slurmctld.pid"]
    pid_files += [root / "run" / f"slurmd-node{k}.pid" for k in range(1, NODES + 1)]
    try:
        subprocess.run(["munged", f"--key-file={root}/munge/munge.key", f"--socket={root}/munge/munge.socket.2",
                        f"--pid-file={pid_files[0]}", f"--log-file={root}/munge/munged.log",
                        f"--seed-file={root}/munge/munged.seed"], check=True, env=env, timeout=30)
        subprocess.run(["slurmctld", "-i"], check=True, env=env, timeout=30)
        for k in range(1, NODES + 1):
            subprocess.run(["unshare", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c",
                            f"hostname node{k} && mount --bind {root}/etc/hosts /etc/hosts && exec slurmd -N node{k}"],
                           check=True, env=env, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if states.split() == ["idle"] * NODES:
                break
            time.sleep(0.1)
        else:
            logs = "\n".join(p.read_text()[-2000:] for p in (root / "log").glob("*.log"))
            pytest.fail(f"the Slurm nodes did not come up:\n{logs}")
        yield root, env
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if jobs:  # slurmstepd outlives slurmd: cancel the jobs first
            subprocess.run(["scancel", *jobs], env=env, timeout=10)
            time.sleep(1)
        for pid_file in reversed(pid_files):
            stop(pid_file)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the repository to submit from, as a user would, without the virtual environment."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in ("single_gpu.py", "multigpu.py", "multigpu_torchrun.py", "multinode.py", "slurm"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, copy / name)
    return copy


@pytest.mark.parametrize("stage", ["single_gpu", "multigpu", "multigpu_torchrun", "multinode"])
def test_sbatch_file_runs(cluster, checkout, stage):
    root, env = cluster
    env = dict(stage_env(**{k: v for k, v in env.items() if k == "SLURM_CONF"}),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # the user's activated environment
    env.pop("PYTHONPATH")
    result = subprocess.run(["sbatch", "--wait", "--gpus-per-node=0", f"slurm/{stage}.sh", "2", "1"], cwd=checkout,
                            env=env, capture_output=True, text=True, timeout=120)
    job = result.stdout.split()[-1] if result.stdout.split() else "?"
    out = checkout / f"{stage}-{job}.out"
    log = out.read_text() if out.exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + log
    epochs = [int(e) for e, *_ in EPOCH_LINE.findall("\n".join(line.split(": ", 1)[-1] for line in log.splitlines()))]
    assert epochs == [1, 2], log
    assert load(checkout / "snapshot.pt")["epoch"] == 2
    (checkout / "snapshot.pt").unlink()
    if stage == "multinode":
        hosts = {line.split(": ", 1)[1] for line in log.splitlines() if line.split(": ", 1)[-1].startswith("node")}
        assert hosts == {"node1", "node2"}, log
