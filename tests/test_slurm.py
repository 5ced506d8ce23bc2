"""The four sbatch files, unmodified, on a real two-node Slurm cluster on this machine (see
slurm_cluster.py). The jobs run in the background from the session's start (conftest.py). Slow
ones: jobs that a time limit or a preemption stops, and that requeue themselves."""

import functools
import subprocess
from pathlib import Path

import pytest

from conftest import EPOCH_LINE, STAGES, assert_bitwise_equal, launch, load
from slurm_cluster import copy_repo, follow


@pytest.mark.parametrize("stage", STAGES)
def test_sbatch_file_runs(slurm_jobs, stage):
    cwd, result, log = slurm_jobs[stage]
    assert result.returncode == 0, result.stdout + result.stderr + log
    lines = [
        line.split(": ", 1)[-1] for line in log.splitlines()
    ]  # srun --label puts "TASK: " in front
    assert [int(e) for e, *_ in EPOCH_LINE.findall("\n".join(lines))] == [1], log
    assert load(cwd / "snapshot.pt")["epoch"] == 1
    if stage == "multinode":  # one torchrun on each node
        assert {line for line in lines if line.startswith("node")} == {"node1", "node2"}, log


def epochs_of(log: str) -> list:
    """The epoch lines of a job log, without srun's "TASK: " labels: (epoch, loss, acc, lr)."""
    text = "\n".join(line.split(": ", 1)[-1] for line in log.splitlines())
    return [(int(e), loss, acc, lr) for e, loss, acc, lr, *_ in EPOCH_LINE.findall(text)]


@functools.cache
def uninterrupted(root: Path, *args) -> tuple:
    """multinode.py on two local "nodes", one process each, never stopped: (snapshot, epochs)."""
    cwd = root / f"uninterrupted-{abs(hash(args))}"
    cwd.mkdir()
    run = launch("multinode", list(args), cwd, timeout=900)
    assert run.returncode == 0, run.output
    return load(cwd / "snapshot.pt"), epochs_of(run.output)


def assert_requeued_and_finished(finished: dict, cwd: Path, args: list) -> None:
    log = finished["log"]
    assert finished["ended"] == "COMPLETED", finished["state"] + log  # the batch file exited 0
    assert "start 2 (requeued 1 times)" in log and "requeued to go on" in log, log
    assert log.count("stopped in epoch") == log.count("requeued to go on"), log
    reference, epochs = uninterrupted(cwd.parent, *args)
    assert epochs_of(log) == epochs, log  # every epoch once, the stopped ones included
    assert_bitwise_equal(load(cwd / "snapshot.pt"), reference)


@pytest.mark.slow
def test_time_limit_warns_saves_and_requeues(slurm_env, tmp_path):
    """A time limit (1 minute) shorter than the run: warned 45 s before it (the file asks for 120
    s), the run stops after a step, the job requeues itself, and so on until the run ends."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    args = [30, 10, "--batch_size", 4]
    sbatch = ["--time=1", "--signal=B:USR1@45", "slurm/multinode.sh", *args]
    finished = follow(slurm_env, cwd, sbatch)
    assert_requeued_and_finished(finished, cwd, args)


@pytest.mark.slow
def test_preempted_job_requeues_itself(slurm_env, tmp_path):
    """SIGTERM to every process of the job's steps, as a preemption with a grace time sends it
    (scancel --signal=TERM), once epoch 2 is logged; no time limit in the way."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    args = [6, 3, "--batch_size", 8]
    sent = []

    def preempt(job: str, log: str) -> None:
        if not sent and "Epoch 2 " in log:
            sent.append(subprocess.run(["scancel", "--signal=TERM", job], env=slurm_env))

    finished = follow(slurm_env, cwd, ["slurm/multinode.sh", *args], during=preempt)
    assert sent, finished["log"]
    assert_requeued_and_finished(finished, cwd, args)
