"""Stop signals (python -m pytest -m slow): a run stopped in the middle of an epoch saves where it
stands, says so in one line, and, started again, ends bit for bit where an uninterrupted run ends,
with the same lines per epoch."""

import contextlib
import functools
import os
import queue
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    EPOCHS,
    STAGES,
    Run,
    assert_bitwise_equal,
    end_processes_in,
    global_batch_args,
    launch,
    load,
    processes_in,
    stage_env,
    start,
)

STOP_LINE = "stopped in epoch"
CASES = [(stage, "SIGTERM") for stage in STAGES]  # a launcher each: python, spawn, torchrun x 1, 2
CASES += [(stage, "SIGINT") for stage in ("single_gpu", "multigpu", "multinode")]  # Ctrl-C
CASES += [(stage, "SIGUSR1") for stage in ("single_gpu", "multigpu")]  # torchrun: README


def stop_after(
    stage: str, args: list, cwd: Path, signum: int, line: str = "Epoch 1 ", every: bool = False
) -> dict:
    """Start a run, send `signum` to its launchers (both "nodes" of multinode; SIGINT to their
    process groups, as a terminal sends Ctrl-C; every: to each of its processes, loader workers
    included, as Slurm does) once a logged line starts with `line`, and wait for the exit:
    {"codes", "seconds" (signal to exit), "output"}."""
    procs = start(stage, args, cwd)
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


@functools.cache
def uninterrupted(stage: str, root: Path, *args) -> tuple:
    """The same run, never stopped: (snapshot, its per-epoch lines)."""
    cwd = root / f"uninterrupted-{stage}-{abs(hash(args))}"
    cwd.mkdir()
    run = launch(stage, list(args), cwd, timeout=600)
    assert run.returncode == 0, run.output
    return load(cwd / "snapshot.pt"), [epoch[:5] for epoch in run.epochs()]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stops")


def stop_and_resume(stage: str, args: list, cwd: Path, name: str, every: bool = False) -> tuple:
    """Stopped by signal `name` in epoch 2, then run again to the end: (stopped, resumed run)."""
    stopped = stop_after(stage, args, cwd, signal.Signals[name], every=every)
    stopped["snapshot"] = load(cwd / "snapshot.pt")
    return stopped, launch(stage, args, cwd, timeout=600)


def assert_stopped_cleanly(stopped: dict, name: str) -> None:
    output = stopped["output"]
    assert all(code != 0 for code in stopped["codes"]), output  # not finished: not a success
    assert stopped["seconds"] < 30, output  # within a Slurm KillWait or a Kubernetes grace
    ours = [line for line in output.splitlines() if STOP_LINE in line]
    assert len(ours) == 1 and ours[0].startswith(f"{name}: stopped in epoch "), output
    assert "Traceback" not in output or "SignalException" in output, output  # torchrun's own
    snapshot = stopped["snapshot"]
    assert snapshot["samples"] > 0, snapshot["samples"]  # inside an epoch, not at its start
    assert f"stopped in epoch {snapshot['epoch'] + 1} after {snapshot['samples']} " in ours[0]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "name"), CASES)
def test_stopped_run_resumes_bit_for_bit(root, stage, name):
    args = [EPOCHS, 1, *global_batch_args(stage)]
    cwd = root / f"{stage}-{name}"
    cwd.mkdir()
    stopped, resumed = stop_and_resume(stage, args, cwd, name)
    assert_stopped_cleanly(stopped, name)
    assert resumed.returncode == 0, resumed.output
    reference, lines = uninterrupted(stage, root, *args)
    assert_bitwise_equal(load(cwd / "snapshot.pt"), reference)
    logged = [e[:5] for e in Run(0, stopped["output"], 0).epochs()] + [
        e[:5] for e in resumed.epochs()
    ]
    assert logged == lines, stopped["output"] + resumed.output  # the stopped epoch's too


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
def test_loader_workers_leave_the_stop_to_their_process(root, stage):
    """--workers 2, and SIGTERM to every process of the run (Slurm's time limit and preemption):
    the workers neither die nor make their training process fail; it stops, saves, resumes."""
    args = [EPOCHS, 1, *global_batch_args(stage), "--workers", "2"]
    cwd = root / f"{stage}-every-process"
    cwd.mkdir()
    stopped, resumed = stop_and_resume(stage, args, cwd, "SIGTERM", every=True)
    assert_stopped_cleanly(stopped, "SIGTERM")
    assert "DataLoader worker" not in stopped["output"], stopped["output"]
    assert resumed.returncode == 0, resumed.output
    reference, _ = uninterrupted(stage, root, EPOCHS, 1, *global_batch_args(stage))
    assert_bitwise_equal(load(cwd / "snapshot.pt"), reference)  # workers or not: same model


def assert_saved_where_it_stopped(output: str, cwd: Path, name: str) -> dict:
    """One stop line that says where the snapshot stands, and no temporary file left."""
    ours = [line for line in output.splitlines() if STOP_LINE in line]
    assert len(ours) == 1 and ours[0].startswith(f"{name}: stopped in epoch "), output
    snapshot = load(cwd / "snapshot.pt")
    assert f"stopped in epoch {snapshot['epoch'] + 1} after {snapshot['samples']} " in ours[0]
    assert not list(cwd.glob("*.tmp")), output
    return snapshot


def assert_resumes_bit_for_bit(stage: str, args: list, cwd: Path, root: Path, first: str) -> None:
    """Started again, the run ends where the uninterrupted one ends, with its epoch lines."""
    resumed = launch(stage, args, cwd, timeout=600)
    assert resumed.returncode == 0, resumed.output
    reference, lines = uninterrupted(stage, root, *args)
    assert_bitwise_equal(load(cwd / "snapshot.pt"), reference)
    logged = [e[:5] for e in Run(0, first, 0).epochs()] + [e[:5] for e in resumed.epochs()]
    assert logged == lines, first + resumed.output


def faulty_run(stage: str, args: list, cwd: Path, **faults: str) -> Run:
    cwd.mkdir()
    return launch(stage, args, cwd, env=stage_env(**faults), timeout=600)


@pytest.mark.slow
def test_a_slow_write_at_a_stop_is_waited_for(root):
    """multigpu.py stopped while its snapshot takes 15 s to write (a large model on NFS): the
    other rank waits for the write instead of exiting, so the launcher kills nobody."""
    args = [EPOCHS, 10, *global_batch_args("multigpu")]  # no save before the stop
    cwd = root / "slow-write"
    run = faulty_run("multigpu", args, cwd, FAULT_SAVE="slow:15", FAULT_SIGNAL="SIGTERM:step:15")
    assert run.returncode == 128 + signal.SIGTERM, run.output
    assert assert_saved_where_it_stopped(run.output, cwd, "SIGTERM")["samples"] > 0
    assert_resumes_bit_for_bit("multigpu", args, cwd, root, run.output)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
@pytest.mark.parametrize("step", [13, 14])
def test_a_stop_at_the_end_of_an_epoch_resumes_exactly(root, stage, step):
    """14 steps an epoch, the last one short (640 = 13 x 48 + 16): stopped after step 14 or 15,
    the resumed run neither trains the short step again nor skips one."""
    args = [2, 1, "--batch_size", 48 if stage == "single_gpu" else 24]
    cwd = root / f"epoch-end-{stage}-{step}"
    run = faulty_run(stage, args, cwd, FAULT_SIGNAL=f"SIGTERM:step:{step}")
    assert run.returncode == 128 + signal.SIGTERM, run.output
    assert_saved_where_it_stopped(run.output, cwd, "SIGTERM")
    assert_resumes_bit_for_bit(stage, args, cwd, root, run.output)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
def test_a_second_ctrl_c_ends_the_job_at_once(root, stage):
    """The second save hangs (a hung filesystem). Ctrl-C (to the process group, as a terminal
    sends it) is noted and waits for a step that never comes; a second one ends every process
    within seconds (its default action), and snapshot.pt still holds epoch 1."""
    cwd = root / f"second-ctrl-c-{stage}"
    cwd.mkdir()
    env = stage_env(FAULT_SAVE="slow:600", FAULT_SAVE_FROM="2")
    (proc,) = start(stage, [EPOCHS, 1], cwd, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("Epoch 2 "):
                break
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None, "the first Ctrl-C waits for a step"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()
        proc.communicate()
    time.sleep(1)
    assert not processes_in(cwd)
    end_processes_in(cwd)
    assert load(cwd / "snapshot.pt")["epoch"] == 1


@pytest.mark.slow
def test_a_snapshot_that_cannot_be_written_at_a_stop_fails_the_job(root):
    cwd = root / "full-at-stop"
    run = faulty_run(
        "multigpu", [EPOCHS, 10], cwd, FAULT_SAVE="full", FAULT_SIGNAL="SIGTERM:step:3"
    )
    assert run.returncode == 1 and run.output.count("error: ") == 1, run.output
    assert "cannot save snapshot.pt: [Errno 28] No space left on device" in run.output, run.output
    assert STOP_LINE not in run.output and "Traceback" not in run.output, run.output
    assert not list(cwd.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu_torchrun"])
def test_a_signal_during_a_write_stops_after_it(root, stage):
    """SIGTERM to rank 0 as its first periodic snapshot starts a 5 s write: the write ends, the
    run stops after the steps that follow, saved, and resumes bit for bit."""
    args = [EPOCHS, 1, *global_batch_args(stage)]
    cwd = root / f"signal-in-write-{stage}"
    run = faulty_run(stage, args, cwd, FAULT_SAVE="slow:5", FAULT_SIGNAL="SIGTERM:save")
    assert run.returncode != 0 and "Epoch 1 " in run.output, run.output
    snapshot = assert_saved_where_it_stopped(run.output, cwd, "SIGTERM")
    assert snapshot["epoch"] == 1 and snapshot["samples"] > 0, run.output
    assert_resumes_bit_for_bit(stage, args, cwd, root, run.output)
