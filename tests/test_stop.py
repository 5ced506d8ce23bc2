"""Stop signals (python -m pytest -m slow): a run stopped in the middle of an epoch saves where it
stands, says so in one line, and, started again, ends bit for bit where an uninterrupted run ends,
with the same lines per epoch. Every run of this file is queued as the session starts
(queue_slow_runs); the tests read what the runs left."""

import contextlib
import functools
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    EPOCHS,
    STAGES,
    TORCHRUN_STAGES,
    Run,
    Runs,
    assert_bitwise_equal,
    end_processes_in,
    global_batch_args,
    launch,
    load,
    own_output,
    processes_in,
    processes_left,
    stage_env,
    start,
)

STOP_LINE = "stopped in epoch"
CASES = [(stage, "SIGTERM") for stage in STAGES]  # a launcher each: python, spawn, torchrun x 1, 2
CASES += [(stage, "SIGINT") for stage in ("single_gpu", "multigpu", "multinode")]  # Ctrl-C
CASES += [(stage, "SIGUSR1") for stage in ("single_gpu", "multigpu")]  # torchrun: README
EPOCH_END = {"single_gpu": 48, "multigpu": 24}  # 640 = 13 x 48 + 16: the last step is short
DROPOUT = ["--arch", "squeezenet1_1"]  # a torchvision model with dropout
SECOND_CTRL_C = [(stage, "workers") for stage in STAGES]
SECOND_CTRL_C += [(stage, "save") for stage in ("single_gpu", "multigpu")]


def stop_after(
    stage: str, args: list, cwd: Path, signum: int, line: str = "Epoch 1 ", every: bool = False
) -> dict:
    """Start a run, send `signum` to its launchers (both "nodes" of multinode; SIGINT to their
    process groups, as a terminal sends Ctrl-C; every: to each of its processes, loader workers
    included, as Slurm does) once a logged line starts with `line`, and wait for the exit:
    {"codes", "seconds" (signal to exit), "output"}. Each step takes 0.2 s longer, so that the
    signal cannot come after the run's last step."""
    procs = start(stage, args, cwd, env=stage_env(FAULT_STEP_SLEEP="0.2"))
    lines, seen = queue.Queue(), threading.Event()

    def read(proc) -> None:
        for text in proc.stdout:
            lines.put(text)
            if text.startswith(line):
                seen.set()

    readers = [threading.Thread(target=read, args=(proc,), daemon=True) for proc in procs]
    for reader in readers:
        reader.start()
    try:
        assert seen.wait(240), f"no {line!r} line: {list(lines.queue)}"
        signalled = time.monotonic()
        for pid in processes_in(cwd) if every else [proc.pid for proc in procs]:
            with contextlib.suppress(ProcessLookupError):
                if signum == signal.SIGINT and not every:
                    os.killpg(pid, signum)
                else:
                    os.kill(pid, signum)
        codes = [proc.wait(timeout=60) for proc in procs]
        seconds = time.monotonic() - signalled
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        end_processes_in(cwd)
    for reader in readers:
        reader.join(10)
    return {"codes": codes, "seconds": seconds, "output": "".join(lines.queue)}


def uninterrupted(stage: str, args: list, cwd: Path) -> tuple:
    """The same run, never stopped: (snapshot, its per-epoch lines)."""
    cwd.mkdir()
    run = launch(stage, args, cwd, timeout=600)
    assert run.returncode == 0, run.output
    return load(cwd / "snapshot.pt"), [epoch[:5] for epoch in run.epochs()]


def stopped_then_resumed(
    stage: str, args: list, cwd: Path, name: str = "", every: bool = False, **faults: str
) -> tuple:
    """Stopped by signal `name` in epoch 2 (see stop_after), or by what `faults` do (tests/faults),
    then started again to its end: ({"output", "codes", "cwd", "snapshot" and "left" (temporary
    files) as the stop left them, "seconds" from a signal to the exit}, the resumed Run)."""
    cwd.mkdir()
    if name:
        stopped = stop_after(stage, args, cwd, signal.Signals[name], every=every)
    else:
        run = launch(stage, args, cwd, env=stage_env(**faults), timeout=600)
        stopped = {"codes": [run.returncode], "output": run.output}
    stopped.update(cwd=cwd, snapshot=load(cwd / "snapshot.pt"), left=list(cwd.glob("*.tmp")))
    return stopped, launch(stage, args, cwd, timeout=600)


def catches_sigint(pid: int) -> bool:
    """Whether the process has a SIGINT handler of its own (a trainer's before its first Ctrl-C)
    or has ended."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


def loader_workers(cwd: Path) -> list[int]:
    """The loader workers of a run: forked by a training process, so with its command line."""

    def parent_and_command(pid: int) -> tuple:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return parent, f.read()

    found = {}
    for pid in processes_in(cwd):
        with contextlib.suppress(OSError):
            found[pid] = parent_and_command(pid)
    return [
        pid for pid, (parent, command) in found.items() if found.get(parent, (0, b""))[1] == command
    ]


def second_ctrl_c(stage: str, cwd: Path, hang: str) -> dict:
    """A hang, then Ctrl-C (to each launcher's process group, as a terminal sends it), and 2 s
    after a trainer has taken it, another. hang="save": the second save hangs
    (FAULT_SAVE=slow:600); the Ctrl-Cs come once epoch 2 is logged. hang="workers": once epoch 1
    is logged, every loader worker (--workers 1) is stopped, as on a hung file system, and the
    ranks wait for batches. {"alive" after the first, "codes" within 10 s of the second (None:
    still running), "stopped" (loader workers), "left" (processes still there 5 s after),
    "epoch" of the snapshot, "output"}."""
    cwd.mkdir()
    if hang == "save":
        env = stage_env(FAULT_SAVE="slow:600", FAULT_SAVE_FROM="2")
        procs = start(stage, [EPOCHS, 1], cwd, env=env)
        line = "Epoch 2 "
    else:
        procs = start(stage, [EPOCHS, 1, "--workers", 1], cwd)
        line = "Epoch 1 "
    deadline = threading.Timer(300, end_processes_in, [cwd])  # a hang ends too, orphans included
    deadline.start()
    lines = []
    for text in procs[0].stdout:
        lines.append(text)
        if text.startswith(line):
            break
    deadline.cancel()
    stopped = loader_workers(cwd) if hang == "workers" else []
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(2 if stopped else 0)  # the batches loaded before run out
        catching = [pid for pid in processes_in(cwd) if catches_sigint(pid)]
        for proc in procs:
            os.killpg(proc.pid, signal.SIGINT)
        # The second Ctrl-C comes once a trainer has taken the first: on a loaded machine, two
        # signals that arrive before a process runs again count as one.
        taken = time.monotonic() + 30
        while all(catches_sigint(pid) for pid in catching) and time.monotonic() < taken:
            time.sleep(0.1)
        time.sleep(2)
        alive = all(proc.poll() is None for proc in procs)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        ended = time.monotonic() + 10
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, ended - time.monotonic()))
        codes = [proc.returncode for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        left = processes_left(cwd)
        end_processes_in(cwd)  # before reading to the end: a survivor holds the output open
        lines.extend(proc.communicate()[0] for proc in procs)
    epoch = load(cwd / "snapshot.pt")["epoch"]
    output = "".join(lines)
    return {"alive": alive, "codes": codes, "stopped": stopped, "left": left, "epoch": epoch,
            "output": output}  # fmt: skip


def full_at_stop(cwd: Path) -> tuple:
    """multigpu.py stopped in epoch 1 on a full disk: (Run, the files it left)."""
    cwd.mkdir()
    env = stage_env(FAULT_SAVE="full", FAULT_SIGNAL="SIGTERM:step:3")
    run = launch("multigpu", [EPOCHS, 10], cwd, env=env, timeout=600)
    return run, list(cwd.iterdir())


HANDLE_USR1 = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # as the batch files


def usr1_to_torchrun(cwd: Path, handled: bool) -> tuple:
    """multigpu_torchrun.py stopped by SIGUSR1 to torchrun itself once epoch 1 is logged; handled:
    torchrun was given HANDLE_USR1 and passes it on, else it dies of it and its workers get
    their parent-death signal (SIGTERM). Then started again: as stopped_then_resumed."""
    cwd.mkdir()
    args = stop_args("multigpu_torchrun")
    (proc,) = start("multigpu_torchrun", args, cwd, env=stage_env(FAULT_STEP_SLEEP="0.2"),
                    torchrun_args=(HANDLE_USR1,) if handled else ())  # fmt: skip
    deadline = threading.Timer(300, end_processes_in, [cwd])  # a hang ends the output too
    deadline.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Epoch 1 "):
            proc.send_signal(signal.SIGUSR1)
            break
    lines.extend(proc.stdout)  # to its end: every process that writes to it has ended
    deadline.cancel()
    stopped = {"codes": [proc.wait()], "output": "".join(lines), "cwd": cwd}
    stopped.update(snapshot=load(cwd / "snapshot.pt"), left=list(cwd.glob("*.tmp")))
    return stopped, launch("multigpu_torchrun", args, cwd, timeout=600)


def stop_args(stage: str, save_every: int = 1) -> list:
    """Stopped in epoch 2, the last: the stops at an epoch's end go on to a next epoch."""
    return [2, save_every, *global_batch_args(stage)]


def epoch_end_args(stage: str) -> list:
    return [2, 1, "--batch_size", EPOCH_END[stage]]


def reference_name(stage: str, args: list) -> str:
    return "-".join(["uninterrupted", stage, *map(str, args)])


def queue_slow_runs(runs: Runs, root: Path) -> None:
    """Every run of this file, the uninterrupted ones first, each in a folder of its own."""

    def queue(name: str, job, *args, **kwargs) -> None:
        runs.submit(name, functools.partial(job, *args, **kwargs))

    references = [(stage, stop_args(stage)) for stage in STAGES]
    references += [(stage, epoch_end_args(stage)) for stage in EPOCH_END]
    for stage, args in references:
        name = reference_name(stage, args)
        queue(name, uninterrupted, stage, args, root / name)
    faults = {"FAULT_SAVE": "slow:15", "FAULT_SIGNAL": "SIGTERM:step:15"}  # no save before it
    queue("slow-write", stopped_then_resumed, "multigpu", stop_args("multigpu", 10),
          root / "slow-write", **faults)  # fmt: skip
    for stage, name in CASES:
        cwd = root / f"{stage}-{name}"
        queue(f"{stage}-{name}", stopped_then_resumed, stage, stop_args(stage), cwd, name)
    for stage in ("single_gpu", "multigpu_torchrun"):
        faults = {"FAULT_SAVE": "slow:5", "FAULT_SIGNAL": "SIGTERM:save"}
        cwd = root / f"signal-in-write-{stage}"
        queue(cwd.name, stopped_then_resumed, stage, stop_args(stage), cwd, **faults)
    for stage in ("single_gpu", "multigpu"):
        args = [*stop_args(stage), "--workers", "2"]
        cwd = root / f"{stage}-every-process"
        queue(cwd.name, stopped_then_resumed, stage, args, cwd, "SIGTERM", every=True)
        for step in (13, 14):  # multigpu.py: rank 1 alone is signalled, and both stop
            cwd = root / f"epoch-end-{stage}-{step}"
            faults = {"FAULT_SIGNAL": f"SIGTERM:step:{step}"}
            if stage == "multigpu":
                faults["FAULT_SIGNAL_RANK"] = "1"
            queue(cwd.name, stopped_then_resumed, stage, epoch_end_args(stage), cwd, **faults)
    for stage, hang in SECOND_CTRL_C:
        cwd = root / f"second-ctrl-c-{hang}-{stage}"
        queue(cwd.name, second_ctrl_c, stage, cwd, hang)
    queue("full-at-stop", full_at_stop, root / "full-at-stop")
    for handled in (False, True):
        queue(f"usr1-to-torchrun-{handled}", usr1_to_torchrun, root / f"usr1-{handled}", handled)
    for stage in ("multinode", "fsdp"):  # one node's process alone signalled (an eviction)
        faults = {"FAULT_SIGNAL": "SIGTERM:step:13", "FAULT_SIGNAL_RANK": "1"}
        cwd = root / f"one-node-{stage}"
        queue(cwd.name, stopped_then_resumed, stage, stop_args(stage), cwd, **faults)
    for stage in ("single_gpu", "multigpu_torchrun"):  # stopped by the last rank after step 13
        args = [*stop_args(stage), *DROPOUT]
        queue(
            reference_name(stage, args),
            uninterrupted,
            stage,
            args,
            root / reference_name(stage, args),
        )
        faults = {
            "FAULT_SIGNAL": "SIGTERM:step:13",
            "FAULT_SIGNAL_RANK": str(int(stage != "single_gpu")),
        }
        queue(
            f"dropout-{stage}",
            stopped_then_resumed,
            stage,
            args,
            root / f"dropout-{stage}",
            **faults,
        )


def assert_stopped_cleanly(stopped: dict, name: str, stage: str) -> None:
    """What the README says a user sees: python and spawn's launcher exit with 128 + the signal
    and no traceback; torchrun (each node's) prints its own SignalException traceback and exits
    1. Within 30 s, one stop line, saved where it says."""
    output = own_output(stopped["output"])
    signum = int(signal.Signals[name])
    if stage in TORCHRUN_STAGES:
        agents = len(stopped["codes"])
        assert stopped["codes"] == [1] * agents, output
        torchruns = re.findall(
            rf"^\S*SignalException: Process \d+ got signal: {signum}$", output, re.M
        )
        assert output.count("Traceback") == len(torchruns) == agents, output
    else:
        assert stopped["codes"] == [128 + signum], output
        assert "Traceback" not in output, output
    assert stopped["seconds"] < 30, output  # within a Slurm KillWait or a Kubernetes grace
    assert_saved_where_it_stopped(stopped, name)


def assert_saved_where_it_stopped(stopped: dict, name: str) -> dict:
    """One stop line that says where the snapshot stands, inside an epoch, and no temporary
    file left."""
    ours = [line for line in stopped["output"].splitlines() if STOP_LINE in line]
    assert len(ours) == 1 and ours[0].startswith(f"{name}: stopped in epoch "), stopped["output"]
    snapshot = stopped["snapshot"]
    assert snapshot["samples"] > 0, snapshot["samples"]  # inside an epoch, not at its start
    assert f"stopped in epoch {snapshot['epoch'] + 1} after {snapshot['samples']} " in ours[0]
    assert not stopped["left"], stopped["output"]
    return snapshot


def assert_resumes_bit_for_bit(slow_runs, stage: str, args: list, stopped: dict, resumed: Run):
    """Started again, the run ends where the uninterrupted one ends, with its epoch lines (the
    stopped epoch's too)."""
    assert resumed.returncode == 0, resumed.output
    reference, lines = slow_runs[reference_name(stage, args)]
    assert_bitwise_equal(load(stopped["cwd"] / "snapshot.pt"), reference)
    logged = [e[:5] for e in Run(0, stopped["output"], 0).epochs()]
    logged += [e[:5] for e in resumed.epochs()]
    assert logged == lines, stopped["output"] + resumed.output


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "name"), CASES)
def test_stopped_run_resumes_bit_for_bit(slow_runs, stage, name):
    stopped, resumed = slow_runs[f"{stage}-{name}"]
    assert_stopped_cleanly(stopped, name, stage)
    assert_resumes_bit_for_bit(slow_runs, stage, stop_args(stage), stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
def test_loader_workers_leave_the_stop_to_their_process(slow_runs, stage):
    """--workers 2, and SIGTERM to every process of the run (Slurm's time limit and preemption):
    the workers neither die nor make their training process fail; it stops, saves, resumes."""
    stopped, resumed = slow_runs[f"{stage}-every-process"]
    assert_stopped_cleanly(stopped, "SIGTERM", stage)
    assert "DataLoader worker" not in stopped["output"], stopped["output"]
    assert resumed.returncode == 0, resumed.output
    reference, _ = slow_runs[reference_name(stage, stop_args(stage))]
    assert_bitwise_equal(load(stopped["cwd"] / "snapshot.pt"), reference)  # workers or not


@pytest.mark.slow
def test_a_slow_write_at_a_stop_is_waited_for(slow_runs):
    """multigpu.py stopped while its snapshot takes 15 s to write (a large model on NFS): the
    other rank waits for the write instead of exiting, so the launcher kills nobody. (Its first
    save is at the stop; the run that saves every epoch ends on the same model.)"""
    stopped, resumed = slow_runs["slow-write"]
    assert stopped["codes"] == [128 + signal.SIGTERM], stopped["output"]
    assert_saved_where_it_stopped(stopped, "SIGTERM")
    assert_resumes_bit_for_bit(slow_runs, "multigpu", stop_args("multigpu"), stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
@pytest.mark.parametrize("step", [13, 14])
def test_a_stop_at_the_end_of_an_epoch_resumes_exactly(slow_runs, stage, step):
    """14 steps an epoch, the last one short (640 = 13 x 48 + 16): stopped after step 14 or 15,
    the resumed run neither trains the short step again nor skips one."""
    stopped, resumed = slow_runs[f"epoch-end-{stage}-{step}"]
    assert stopped["codes"] == [128 + signal.SIGTERM], stopped["output"]
    assert_saved_where_it_stopped(stopped, "SIGTERM")
    assert_resumes_bit_for_bit(slow_runs, stage, epoch_end_args(stage), stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "hang"), SECOND_CTRL_C)
def test_a_second_ctrl_c_ends_the_job_at_once(slow_runs, stage, hang):
    """The first Ctrl-C is noted and waits for a step that never comes (a save or the loader
    workers hang); a second one ends every process within seconds, the stopped loader workers
    too (they held their rank's exit, unseen by its launcher), and the snapshot still holds epoch
    1 (the last one saved)."""
    result = slow_runs[f"second-ctrl-c-{hang}-{stage}"]
    assert result["alive"], result  # the first Ctrl-C waits for a step
    workers = 2 if stage == "single_gpu" else 4  # a train and a held-out loader's, per process
    assert len(result["stopped"]) == (workers if hang == "workers" else 0), result
    assert None not in result["codes"] and 0 not in result["codes"], result
    assert not result["left"] and result["epoch"] == 1, result


@pytest.mark.slow
def test_a_snapshot_that_cannot_be_written_at_a_stop_fails_the_job(slow_runs):
    run, left = slow_runs["full-at-stop"]
    assert run.returncode == 1 and run.output.count("error: ") == 1, run.output
    assert "cannot save snapshot.pt: [Errno 28] No space left on device" in run.output, run.output
    assert STOP_LINE not in run.output and "Traceback" not in run.output, run.output
    assert not left


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu_torchrun"])
def test_a_signal_during_a_write_stops_after_it(slow_runs, stage):
    """SIGTERM to rank 0 as its first periodic snapshot starts a 5 s write: the write ends, the
    run stops after the steps that follow, saved, and resumes bit for bit."""
    stopped, resumed = slow_runs[f"signal-in-write-{stage}"]
    assert all(code != 0 for code in stopped["codes"]), stopped["output"]
    assert "Epoch 1 " in stopped["output"], stopped["output"]
    snapshot = assert_saved_where_it_stopped(stopped, "SIGTERM")
    assert snapshot["epoch"] == 1 and snapshot["samples"] > 0, stopped["output"]
    assert_resumes_bit_for_bit(slow_runs, stage, stop_args(stage), stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu_torchrun"])
def test_a_model_with_dropout_resumes_bit_for_bit(slow_runs, stage):
    """SqueezeNet draws dropout masks at every step: each step's draws come from the seed, the
    rank and the step, so a run stopped in epoch 2 and started again draws the same ones."""
    stopped, resumed = slow_runs[f"dropout-{stage}"]
    assert_saved_where_it_stopped(stopped, "SIGTERM")
    assert_resumes_bit_for_bit(slow_runs, stage, [*stop_args(stage), *DROPOUT], stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["multinode", "fsdp"])
def test_a_stop_signal_to_one_node_stops_every_rank(slow_runs, stage):
    """SIGTERM to rank 1 alone, on the second node (a spot instance reclaimed, a pod evicted):
    every rank stops after the same step, rank 0 saves, and the run resumes bit for bit."""
    stopped, resumed = slow_runs[f"one-node-{stage}"]
    assert stopped["codes"] == [1], stopped["output"]  # torchrun: a rank exited 128 + 15
    assert_saved_where_it_stopped(stopped, "SIGTERM")
    assert_resumes_bit_for_bit(slow_runs, stage, stop_args(stage), stopped, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("handled", [False, True])
def test_sigusr1_to_torchrun_stops_and_saves(slow_runs, handled):
    """SIGUSR1 to torchrun itself (Slurm's --signal=USR1@T without B: signals every process of a
    step). Given --signals-to-handle with SIGUSR1 (the batch files), torchrun passes it on and
    exits 1. Without it torchrun dies of the signal, and its workers see at their next step that
    their parent died: they stop as for SIGTERM, save and end all the same. Either way the run
    resumes bit for bit."""
    stopped, resumed = slow_runs[f"usr1-to-torchrun-{handled}"]
    name = "SIGUSR1" if handled else "SIGTERM"
    assert stopped["codes"] == [1 if handled else -signal.SIGUSR1], stopped["output"]
    assert_saved_where_it_stopped(stopped, name)
    args = stop_args("multigpu_torchrun")
    assert_resumes_bit_for_bit(slow_runs, "multigpu_torchrun", args, stopped, resumed)
