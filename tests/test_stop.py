"""Stop signals (python -m pytest -m slow): a run stopped in the middle of an epoch saves where it
stands, says so in one line, and, started again, ends bit for bit where an uninterrupted run ends,
with the same lines per epoch. Random augmentation is a function of (seed, epoch, sample)."""

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
    make_image_tree,
    max_param_diff,
    processes_in,
    start,
)

STOP_LINE = "stopped in epoch"
CASES = [(stage, "SIGTERM") for stage in STAGES]  # a launcher each: python, spawn, torchrun x 1, 2
CASES += [(stage, "SIGINT") for stage in ("single_gpu", "multigpu", "multinode")]  # Ctrl-C
CASES += [(stage, "SIGUSR1") for stage in ("single_gpu", "multigpu")]  # torchrun: README


def stop_after(
    stage: str, args: list, cwd: Path, signum: int, line: str = "Epoch 1 ", every: bool = False
) -> dict:
    """Start a run, send `signum` to its launchers (both "nodes" of multinode; every: to each of
    its processes, loader workers included, as Slurm does) once a logged line starts with `line`,
    and wait for the exit: {"codes", "seconds" (signal to exit), "output"}."""
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


@pytest.fixture(scope="module")
def images(root) -> Path:
    make_image_tree(root / "images", train=40)  # 160 images: 20 steps of 8 an epoch
    return root / "images"


def augmented(images: Path, batch: int, epochs: int = 4) -> list:
    return [epochs, 1, "--data_dir", images, "--augment", "crop+flip", "--batch_size", batch]


@pytest.mark.slow
def test_augmentation_is_the_same_at_every_scale(root, images):
    """crop+flip: one process or two (same global batch) agree; loader workers 0 or 2 give the
    same model to the last bit; a stopped and resumed run too, with the same epoch lines."""
    single, lines = uninterrupted("single_gpu", root, *augmented(images, 8))
    workers, _ = uninterrupted("single_gpu", root, *augmented(images, 8), "--workers", "2")
    assert_bitwise_equal(workers, single)
    spawned, _ = uninterrupted("multigpu", root, *augmented(images, 4))
    assert max_param_diff(spawned, single) <= 1e-4
    cwd = root / "augmented-stopped"
    cwd.mkdir()
    stopped, resumed = stop_and_resume("single_gpu", augmented(images, 8), cwd, "SIGTERM")
    assert_stopped_cleanly(stopped, "SIGTERM")
    assert resumed.returncode == 0, resumed.output
    assert_bitwise_equal(load(cwd / "snapshot.pt"), single)
    logged = [e[:5] for e in Run(0, stopped["output"], 0).epochs()] + [
        e[:5] for e in resumed.epochs()
    ]
    assert logged == lines


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
