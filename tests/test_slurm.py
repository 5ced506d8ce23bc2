"""The four sbatch files, unmodified, on a real two-node Slurm cluster on this machine (see
slurm_cluster.py). The jobs run in the background from the session's start (conftest.py). Slow
ones: jobs that a time limit or a preemption stops, and that requeue themselves."""

import functools
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import (
    EPOCH_LINE,
    EPOCHS,
    NODE_STAGES,
    STAGES,
    assert_bitwise_equal,
    assert_same_model,
    launch,
    load,
    single_gpu,
    slurm_futures,
)
from slurm_cluster import copy_repo, follow

GLOBAL_BATCH = {"single_gpu": 32, "multigpu": 64, "multigpu_torchrun": 64, "multinode": 128}
GLOBAL_BATCH["fsdp"] = 128  # as multinode.sh


@pytest.mark.parametrize("stage", STAGES)
def test_sbatch_file_runs(slurm_jobs, stage):
    """The four jobs at once in one folder, each with its own default snapshot; on CPUs, 2
    processes a node (multigpu.py's --world_size, the torchrun files' CPU_PROCS)."""
    cwd, result, log = slurm_jobs[stage]
    assert result.returncode == 0, result.stdout + result.stderr + log
    lines = [
        line.split(": ", 1)[-1] for line in log.splitlines()
    ]  # srun --label puts "TASK: " in front
    epochs = EPOCH_LINE.findall("\n".join(lines))
    assert [(int(e), int(batch)) for e, _, _, _, batch, _ in epochs] == [(1, GLOBAL_BATCH[stage])]
    assert load(cwd / f"{stage}.pt")["epoch"] == 1
    if stage in NODE_STAGES:  # one torchrun on each node
        assert {line for line in lines if line.startswith("node")} == {"node1", "node2"}, log


def epochs_of(log: str) -> list:
    """The epoch lines of a job log, without srun's "TASK: " labels: (epoch, loss, acc, lr)."""
    text = "\n".join(line.split(": ", 1)[-1] for line in log.splitlines())
    return [(int(e), loss, acc, lr) for e, loss, acc, lr, *_ in EPOCH_LINE.findall(text)]


UNINTERRUPTED = {  # multinode.py on two local "nodes", one process each, never stopped
    "time-limit": [30, 10, "--batch_size", 4],
    "preempted": [6, 3, "--batch_size", 8],
    "srun": [EPOCHS, 1, "--batch_size", 32],  # the global batch of 2 x 2 srun tasks x 16
}


def uninterrupted(args: list, cwd: Path) -> tuple:
    """(snapshot, epochs) of a run that nothing stops."""
    cwd.mkdir()
    run = launch("multinode", args, cwd, timeout=900)
    assert run.returncode == 0, run.output
    return load(cwd / "snapshot.pt"), epochs_of(run.output)


def queue_slow_runs(runs, root: Path) -> None:
    """The runs the Slurm jobs are compared with, while the first jobs run."""
    for name, args in UNINTERRUPTED.items():
        runs.submit(f"slurm-{name}", functools.partial(uninterrupted, args, root / name))


def assert_requeued_and_finished(
    finished: dict, cwd: Path, reference: tuple, snapshot: str = "multinode.pt"
) -> None:
    log = finished["log"]
    assert finished["ended"] == "COMPLETED", finished["state"] + log  # the batch file exited 0
    assert "start 2 (requeued 1 times)" in log and "requeued to go on" in log, log
    last = f"Epoch {reference[1][-1][0]} |"
    for start in log.split(", start ")[1:]:  # a requeue follows a stop line, or a signal that
        if "requeued to go on" in start:  # came as the run ended (the next start trains nothing)
            assert "stopped in epoch" in start or last in start, log
    assert epochs_of(log) == reference[1], log  # every epoch once, the stopped ones included
    assert_bitwise_equal(load(cwd / snapshot), reference[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TERM", "USR1"])
def test_preempted_job_requeues_itself(slurm_env, slow_runs, tmp_path, name):
    """SIGTERM to every process of the job's steps, as a preemption with a grace time sends it
    (scancel --signal=TERM), once epoch 2 is logged; no time limit in the way. SIGUSR1 likewise,
    as Slurm's time-limit warning without `B:` sends it: torchrun passes it on (the batch file
    gives it --signals-to-handle). --snapshot_path among the job's arguments: the batch file
    watches that file (the time-limit jobs: the default one)."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    snapshot = "experiment.pt"
    args = [*UNINTERRUPTED["preempted"], f"--snapshot_path={snapshot}"]
    sent = []

    def preempt(job: str, log: str) -> None:
        if not sent and "Epoch 2 " in log:
            sent.append(subprocess.run(["scancel", f"--signal={name}", job], env=slurm_env))

    finished = follow(slurm_env, cwd, ["slurm/multinode.sh", *args], during=preempt)
    assert sent, finished["log"]
    assert_requeued_and_finished(finished, cwd, slow_runs["slurm-preempted"], snapshot)


@pytest.mark.slow
def test_a_lost_rank_is_requeued_and_an_error_that_recurs_costs_one_more_start(slurm_env, tmp_path):
    """slurm/multinode.sh, one process a node, 5 steps an epoch: rank 1 SIGKILLed as epoch 2
    starts, once; every weight NaN after the first step of epoch 3, at every start. The first
    start saved epoch 1, so the job is requeued and resumes from it; in epoch 3 the loss turns NaN,
    after epoch 2 was saved: requeued once more, the third start resumes from epoch 2 and meets
    the same NaN with nothing saved, and the job ends for good: no fourth start, epoch 2's
    snapshot kept."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    hooks = {"FAULT_AT": "kill:1:1", "FAULT_ONCE": str(cwd / "killed"), "FAULT_STEP_NAN": "epoch:2"}
    command = ["slurm/multinode.sh", 4, 1, "--batch_size", 64]
    finished = follow(slurm_env, cwd, command, hooks=hooks)
    log = finished["log"]
    assert finished["ended"] == "FAILED", finished["state"] + log
    assert (cwd / "killed").exists() and log.count("resumed after epoch 1, 3 to go") == 1, log
    assert log.count("resumed after epoch 2, 2 to go") == 1, log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]  # not srun's
    assert len(errors) == 2, log
    assert all("NaN or infinite values in epoch 3, " in error for error in errors), log
    assert "start 3 " in log and "start 4 " not in log and "not requeued" in log, log
    assert load(cwd / "multinode.pt")["epoch"] == 2


@pytest.mark.slow
def test_a_job_stopped_at_every_start_ends_after_its_requeues(slurm_env, tmp_path):
    """Preempted at every start (MAX_REQUEUES=1): requeued once, then the job ends as failed
    rather than loop; its log says why."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    sent = []

    def preempt(job: str, log: str) -> None:
        latest = log.rsplit(f"Job {job}, start", 1)[-1]
        if log.count(f"Job {job}, start") > len(sent) and "Epoch " in latest:
            sent.append(subprocess.run(["scancel", "--signal=TERM", job], env=slurm_env))

    command = ["--export=ALL,MAX_REQUEUES=1", "slurm/multinode.sh", 6, 1, "--batch_size", 8]
    finished = follow(slurm_env, cwd, command, during=preempt)
    log = finished["log"]
    assert finished["ended"] == "FAILED" and len(sent) == 2, finished["state"] + log
    assert log.count("requeued to go on") == 1 and "not requeued after 1 requeues" in log, log


@pytest.mark.slow
def test_srun_tasks_train_as_torchrun_does(slurm_env, slow_runs, tmp_path):
    """Four srun tasks (2 nodes x 2) x 16 train the model that two torchrun nodes x 32 train:
    global batch 64 either way; one log, every epoch once. Each task takes its share of the
    step's cores on its node (8: 2 tasks x 4 --cpus-per-task), within its CPU set (this machine's
    2 cores here): 2 threads, where dividing its CPU set by the node's tasks gave 1."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    (cwd / "threads").mkdir()
    command = ["--ntasks-per-node=2", "slurm/multinode_srun.sh", EPOCHS, 1, "--batch_size", 16]
    finished = follow(slurm_env, cwd, command, hooks={"RECORD_THREADS": str(cwd / "threads")})
    log = finished["log"]
    assert finished["ended"] == "COMPLETED", finished["state"] + log
    assert "start 1 (requeued 0 times)" in log and "Traceback" not in log, log
    assert [e[0] for e in epochs_of(log)] == list(range(1, EPOCHS + 1)), log
    reference, _ = slow_runs["slurm-srun"]
    assert_same_model(load(cwd / "multinode.pt"), reference)
    threads = [int(path.read_text()) for path in (cwd / "threads").glob("threads-*")]
    assert threads == [min(len(os.sched_getaffinity(0)), 8 // 2)] * 4, threads


@pytest.fixture(scope="module")
def time_limit_jobs(_slurm_in_background, slow_runs, tmp_path_factory):
    """slurm/multinode.sh and slurm/multinode_srun.sh under a 1-minute limit, side by side once
    every other launch has ended: {name: (folder, follow's result)}. slurmctld looks at time
    limits every 30 s and warns at the first look that finds the limit at most `--signal`'s time
    + 30 s away (sbatch's manual: up to 60 s early); it ends a job at a look too. So @10 warns 20
    to 50 s into each start (the workers train by then) and ends it 30 s later at the soonest.
    @30 would warn 0 to 30 s in, maybe before a worker has a handler: no save, no requeue."""
    slurm_env = slurm_futures(_slurm_in_background)[0].result()
    slow_runs.wait_all()
    batch_files = {"torchrun": "slurm/multinode.sh", "srun": "slurm/multinode_srun.sh"}
    folders = {name: tmp_path_factory.mktemp(f"time-limit-{name}") / "repo" for name in batch_files}
    with ThreadPoolExecutor(max_workers=len(batch_files)) as pool:
        jobs = {}
        for name, batch_file in batch_files.items():
            copy_repo(folders[name])
            tasks = ["--ntasks-per-node=1"] if name == "srun" else []  # exact resumes: README
            sbatch = ["--time=1", "--signal=B:USR1@10", *tasks, batch_file]
            args = [*sbatch, *UNINTERRUPTED["time-limit"]]
            jobs[name] = pool.submit(follow, slurm_env, folders[name], args)
        yield {name: (folders[name], job.result()) for name, job in jobs.items()}


@pytest.mark.slow
@pytest.mark.quiet
def test_time_limit_warns_saves_and_requeues(time_limit_jobs, slow_runs):
    """A time limit (1 minute) shorter than the run: warned before it (the file asks for 120 s;
    here 10, see time_limit_jobs), the run stops after a step, the job requeues itself, and so
    on until the run ends."""
    cwd, finished = time_limit_jobs["torchrun"]
    assert_requeued_and_finished(finished, cwd, slow_runs["slurm-time-limit"])


@pytest.mark.slow
@pytest.mark.quiet
def test_srun_job_warned_before_its_time_limit_requeues_itself(time_limit_jobs, slow_runs):
    """multinode_srun.sh, one task per node, likewise: every task stops after a step, rank 0
    saves, the job requeues itself until the run ends, bit for bit where two torchrun nodes end
    without a time limit (the same two ranks, one a node; with more than two processes a resume
    is exact to rounding only: README, Snapshots)."""
    cwd, finished = time_limit_jobs["srun"]
    assert_requeued_and_finished(finished, cwd, slow_runs["slurm-time-limit"])


@pytest.mark.slow
def test_a_job_that_slurm_ends_saves_and_says_so(slurm_env, tmp_path):
    """sbatch slurm/single_gpu.sh with flags only: the run is the README's 50 10 (epoch 1's
    learning rate is still warming up, as in 50 epochs). Then `scancel JOB`, which sends SIGTERM
    to every process of the job, the batch shell's too (a preemption at many sites): the run
    stops after a step and saves, and the log says that Slurm ended the job."""
    cwd = tmp_path / "repo"
    copy_repo(cwd)
    sent = []

    def cancel(job: str, log: str) -> None:
        if not sent and "Epoch 1 " in log:
            sent.append(subprocess.run(["scancel", job], env=slurm_env))

    finished = follow(slurm_env, cwd, ["slurm/single_gpu.sh", "--batch_size", 64], during=cancel)
    log = finished["log"]
    assert sent and finished["ended"] == "CANCELLED", finished["state"] + log
    lr = float(EPOCH_LINE.search(log)[4])
    steps = 640 // 64
    assert lr == float(f"{single_gpu().get_lr(steps - 1, 50 * steps, 3e-3):.2e}"), log
    assert "SIGTERM: stopped in epoch " in log, log
    assert "Ended by Slurm (SIGTERM to the job), its progress saved in single_gpu.pt" in log, log
    snapshot = load(cwd / "single_gpu.pt")
    assert snapshot["samples"] > 0 or snapshot["epoch"] > 1, log
