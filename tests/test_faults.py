"""Failures: a crash while saving loses nothing, a dead rank ends the job, ranks never resume
apart, restarts never hang, no run aborts at exit, and no worker outlives its launcher."""

import os
import re

import pytest

from conftest import (
    DEAD_RANKS,
    DIVERGED,
    EPOCHS,
    RESUMED_ON_THE_CLOCK,
    STAGES,
    assert_bitwise_equal,
    assert_same_model,
    load,
    processes_left,
    single_gpu,
    stage_module,
)


@pytest.mark.parametrize("name", DEAD_RANKS)
def test_a_dead_rank_ends_the_job(runs, name):
    """Within 60 s of the death, with the README's exit code: spawn's launcher 75 when a signal
    killed a rank (a retry may succeed), torchrun 1 whatever failed."""
    cwd, run = runs[name]
    _, _, named, code = DEAD_RANKS[name]
    assert run.returncode == code and run.ended - (cwd / "died").stat().st_mtime < 60, run.output
    assert named in run.output, run.output


def test_a_snapshot_path_in_a_new_folder_is_written(tmp_path):
    """--snapshot_path runs/a.pt: the first save makes the folder (no error after an epoch)."""
    assert single_gpu().save_snapshot(str(tmp_path / "runs" / "a.pt"), {"epoch": 1})
    assert load(tmp_path / "runs" / "a.pt") == {"epoch": 1}


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_reaches_the_disk_before_it_replaces_the_last(stage, tmp_path, monkeypatch):
    """A save writes beside the snapshot, syncs that file to the disk, and only then renames it
    over the snapshot: after a power cut the file is the old one or the new one, whole."""
    done, fsync, replace = [], os.fsync, os.replace

    def synced(fd: int) -> None:
        done.append(os.readlink(f"/proc/self/fd/{fd}"))  # the file that fd is open on
        fsync(fd)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", lambda *paths: done.append(paths) or replace(*paths))
    path = str(tmp_path / "a.pt")
    assert stage_module(stage).save_snapshot(path, {"epoch": 1})
    assert done == [f"{path}.tmp", (f"{path}.tmp", path)] and load(path) == {"epoch": 1}, done


def test_crash_while_saving_keeps_the_previous_snapshot(reference_runs, runs):
    """snapshot.pt still holds epoch 1, loads, and a restart from it ends with the uninterrupted
    run's model, bit for bit (--deterministic)."""
    cwd, run = runs["save"]
    assert run.returncode == -9, run.output
    assert load(cwd / "snapshot.pt")["epoch"] == 1
    assert (cwd / "snapshot.pt.tmp").exists()  # the half-written file never took its place
    cwd, run = runs["save-resume"]  # the same folder, copied, started again
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == list(range(2, EPOCHS + 1)), (
        run.output
    )
    uninterrupted = reference_runs["single_gpu"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(uninterrupted))


def test_ranks_that_see_different_snapshots_stop_together(runs):
    """Nobody trains from scratch while rank 0 resumes; the snapshot is left as it was."""
    cwd, run = runs["apart"]
    assert (
        run.returncode != 0
        and "error: ranks resume from different snapshots: share snapshot.pt" in run.output
    ), run.output
    assert "Epoch" not in run.output and load(cwd / "snapshot.pt")["epoch"] == 2
    node1 = cwd.parent / cwd.name.replace("node0", "node1")  # pytest numbers both: node00, node10
    assert (node1 / "snapshot.pt").read_bytes().startswith(b"this is not")


def test_restarts_without_the_variable_stop_before_training(runs):
    """torchrun --max-restarts=1 as most tutorials show it: rather than fail or hang after the
    kill, every worker stops at start, and rank 0 alone says what to set."""
    cwd, run = runs["plain-multigpu_torchrun"]  # multinode.py checks alike: test_errors.py
    assert run.returncode != 0 and "Epoch" not in run.output, run.output
    line = "error: restarts need c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n"
    assert run.output.count(line) == 2, run.output  # rank 0's, at the start and at its restart
    # Two starts (the restart too) on a loaded machine; a hang would last until a timeout.
    assert run.seconds < 120 and not processes_left(cwd), run.output


@pytest.mark.parametrize("stage", ["multigpu", "multigpu_torchrun"])
def test_workers_stop_when_their_launcher_dies(runs, stage):
    """The launcher (python multigpu.py, or torchrun) SIGKILLed after epoch 2 of 400: every
    worker stops within seconds, and the last snapshot is whole."""
    result = runs[f"orphans-{stage}"]
    assert "Epoch 2 " in result["output"], result["output"]
    assert result["gone"] is not None and result["gone"] < 10, result
    snapshot = load(result["cwd"] / "snapshot.pt")  # epoch 2's, or epoch 1's if killed while saving
    assert 1 <= snapshot["epoch"] < 400 and snapshot["model"]


def test_workers_end_when_torchrun_dies_as_they_start(runs):
    """torchrun SIGKILLed once its workers exist, before they reach the store it holds: they end
    untrained as soon as they find it gone (within 2 minutes: each first imports torch, on a loaded
    machine), where connecting to the dead store would retry for minutes."""
    result = runs["orphans-at-start"]
    assert result["gone"] is not None, result
    assert not (result["cwd"] / "snapshot.pt").exists(), result


def test_the_launchers_port_stays_its_own(runs):
    """python multigpu.py holds the free port it picked for the job: a program that tries to bind
    it while the ranks start (seconds: each imports torch) cannot, and the run trains."""
    cwd, run = runs["exit-multigpu"]
    assert (cwd / "port-held").exists() and not (cwd / "port-taken").exists(), run.output
    assert run.returncode == 0 and run.epochs(), run.output


@pytest.mark.parametrize("stage", ["multigpu", "multinode"])  # torchrun's stages end alike
def test_user_exit_code_runs_in_every_process(runs, stage):
    """An atexit handler and an unflushed print, as a user adds them, with stdout not a terminal:
    every process that printed also ran its handler, the workers included."""
    cwd, run = runs[f"exit-{stage}"]
    assert run.returncode == 0 and run.epochs(), run.output
    printed = set(re.findall(r"unflushed line from (\d+)\n", run.output))  # lines may interleave
    handled = {path.name.split("-")[1] for path in cwd.glob("atexit-*")}
    workers = 2  # besides one launcher per node
    assert len(printed) >= workers + 1 and printed == handled, (printed, handled, run.output)


@pytest.mark.parametrize("stage", ["single_gpu", "multigpu", "multinode"])
def test_loader_workers_end_before_the_exit_functions(runs, stage):
    """--workers 2: no loader worker is alive when a training process's exit functions start
    (torch before 2.13 joins each for up to 5 s there), and the job ends within seconds of them
    (10 s: the suite runs 3 jobs a core)."""
    cwd, run = runs[f"exit-{stage}"]
    assert run.returncode == 0 and run.epochs(), run.output
    counts = [path.read_text().split() for path in cwd.glob("workers-*")]
    assert len(counts) == (1 if stage == "single_gpu" else 2), (counts, run.output)
    assert all(alive == "0" for alive, _ in counts), counts
    assert all(run.ended - float(at) < 10 for _, at in counts), (counts, run.ended)  # 6 runs a core


@pytest.mark.parametrize("name", ["error-single_gpu", "torchrun-raise"])  # the others: as torchrun
def test_an_error_in_a_step_ends_the_loader_workers_at_once(runs, name):
    """A rank raises in a step (single_gpu.py) or as an epoch starts (rank 1 of
    multigpu_torchrun.py), with 2 loader workers a process: a failing exit code, and no loader
    worker alive when its exit functions start (on a GPU with torch before 2.13 each would be
    joined for 5 s there: 16 workers held an error for 80 s)."""
    cwd, run = runs[name]
    assert run.returncode != 0 and "RuntimeError: injected failure" in run.output
    counts = [path.read_text().split() for path in cwd.glob("workers-*")]
    assert counts and all(alive == "0" for alive, _ in counts), (counts, run.output)
    assert all(run.ended - float(at) < 10 for _, at in counts), (counts, run.ended)


@pytest.mark.parametrize("name", ["apart", "apart-fresh"])
def test_ranks_that_load_different_files_stop_at_once(runs, name):
    """A file that one rank cannot read, while the other's is whole or missing (a new run there):
    one error line for the job, nobody trains or saves, and no rank waits for another until a
    timeout."""
    cwd, run = runs[name]  # node 1's snapshot is unreadable
    assert run.returncode != 0 and run.output.count("error: ") == 1, run.output
    assert (cwd / "snapshot.pt").exists() == (name == "apart"), list(cwd.iterdir())
    assert "different snapshots" in run.output and "Epoch" not in run.output, run.output
    # Two nodes' start on a loaded machine takes up to a minute or so; a rank that waited for
    # another would wait for the stages' timeout, 5 minutes.
    assert run.seconds < 120, run.output


@pytest.mark.parametrize("stage", ["single_gpu", "multinode"])  # multigpu.py: as multinode.py
def test_a_snapshot_that_cannot_be_written_ends_the_job(runs, stage):
    """The second save meets a full disk: one error line for the job, a failing exit code, every
    process ended, the first snapshot intact, no temporary file."""
    cwd, run = runs[f"disk-full-{stage}"]
    assert run.returncode == 1 and run.output.count("error: ") == 1, run.output
    assert "error: cannot save snapshot.pt: [Errno 28] No space left on device" in run.output
    assert [e[0] for e in run.epochs()] == [1, 2] and not processes_left(cwd), run.output
    assert load(cwd / "snapshot.pt")["epoch"] == 1 and not list(cwd.glob("*.tmp"))


@pytest.mark.parametrize("stage", STAGES)
def test_a_crash_without_a_signal_costs_minutes_and_a_diverged_run_is_never_saved(
    reference_runs, runs, stage
):
    """--save_minutes 1, a step moving the clock on by 25 s (at two ranks, rank 1's clock alone,
    so every rank saves when one says it is time), weights NaN after step 5 of epoch 1: a save
    inside epoch 1 before it, none after it, one error line that says where, exit code 1. The
    same command again (one process, a node, FSDP) resumes inside epoch 1 and ends bit for bit on
    the uninterrupted model."""
    cwd, run = runs[f"periodic-{stage}"]
    resumed = runs[f"periodic-resume-{stage}"]  # once the snapshot is kept aside as kept.pt
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and len(errors) == 1, run.output
    assert errors[0].startswith("error: the run diverged: NaN or infinite values in epoch 1, ")
    assert "steps after the last snapshot, which is kept" in errors[0], errors
    kept = load(cwd / "kept.pt")
    assert kept["epoch"] == 0 and 0 < kept["samples"] <= 5 * 64, kept["samples"]
    assert all(tensor.isfinite().all() for tensor in kept["model"].values())
    assert not list(cwd.glob("*.tmp")), list(cwd.iterdir())
    if stage not in RESUMED_ON_THE_CLOCK:  # their saves are multinode.py's lines
        return
    _, resumed = resumed
    assert resumed.returncode == 0, resumed.output
    resumed_at = f"snapshot.pt: resumed after epoch 0 and {kept['samples']} samples of epoch 1"
    assert f"{resumed_at}, 3 to go" in resumed.output, resumed.output
    assert [e[0] for e in resumed.epochs()] == list(range(1, EPOCHS + 1)), resumed.output
    # The epoch it resumed inside logs what the uninterrupted run logs: loss, accuracy, lr, batch.
    logged = [epoch[:5] for epoch in resumed.epochs()]
    assert logged == [epoch[:5] for epoch in reference_runs[stage][1].epochs()], resumed.output
    final = reference_runs[stage][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(final))


@pytest.mark.parametrize("stage", STAGES[1:])
def test_gradients_are_clipped_by_the_global_norm_of_the_step(runs, stage):
    """--grad_clip 1 for an epoch: every stage ends on single_gpu.py's model (batch 64 in one
    process), also from micro-batches (2 x 8 x 4) under DDP and FSDP: the norm is the whole
    step's, over every rank and after accumulation, not a rank's or a micro-batch's."""
    reference_cwd, reference = runs["clip-single_gpu"]
    cwd, run = runs[f"clip-{stage}"]
    assert reference.returncode == 0 and run.returncode == 0, reference.output + run.output
    assert_same_model(load(cwd / "snapshot.pt"), load(reference_cwd / "snapshot.pt"))


@pytest.mark.parametrize(("stage", "case"), DIVERGED)
def test_nothing_non_finite_is_saved(runs, stage, case):
    """Every weight NaN after the last update before a save (an epoch's end, the clock, a stop):
    the save is refused with one line that says where, and the last good snapshot stays as it
    was. A NaN loss far from any save ends the run within two steps (three where the ranks agree
    a step late), not at the epoch's end, and the line says that nothing was saved yet. Exit code
    1: an error that a new start would meet again."""
    cwd, run = runs[f"nan-{case}-{stage}"]
    late = int(stage != "single_gpu")  # the step that the ranks' vote adds
    epoch, steps, kept, logged = {  # logged: the epochs whose line was printed
        "epoch": (2, 10, (1, 0), [1, 2]),
        "clock": (1, 3 + late, (0, (3 + late) * 64), []),
        "stop": (2, 5 + late, (1, 0), [1]),
        "loss": (1, 5 + late, None, []),
    }[case]
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    where = f"in epoch {epoch}, {steps} steps after the last snapshot, which is kept"
    if kept is None:
        where = f"in epoch {epoch}, {steps} steps into the run, before any snapshot"
    assert errors == [f"error: the run diverged: NaN or infinite values {where}"], run.output
    assert run.returncode == 1, run.output
    assert [e[0] for e in run.epochs()] == logged and "resumed" not in run.output, run.output
    assert "stopped in epoch" not in run.output and not list(cwd.glob("*.tmp")), run.output
    if kept is None:
        assert not (cwd / "snapshot.pt").exists()
        return
    snapshot = load(cwd / "snapshot.pt")
    assert (snapshot["epoch"], snapshot["samples"]) == kept
    assert all(tensor.isfinite().all() for tensor in snapshot["model"].values())


def test_ranks_whose_snapshots_differ_only_in_content_stop_together(runs):
    """Two nodes, each with its own copy: of the same size, epoch and samples, from another save
    (a stale copy: each save draws its own id). One error line, nobody trains, both files stay as
    they were."""
    cwd, run = runs["stale"]
    assert run.returncode != 0 and run.output.count("error: ") == 1, run.output
    assert "error: ranks resume from different snapshots" in run.output, run.output
    assert "Epoch" not in run.output, run.output
    node1 = cwd.parent / cwd.name.replace("stale0", "stale1")  # pytest numbers both
    ours, theirs = (cwd / "snapshot.pt").read_bytes(), (node1 / "snapshot.pt").read_bytes()
    assert len(ours) == len(theirs) and ours != theirs
    assert load(cwd / "snapshot.pt")["epoch"] == load(node1 / "snapshot.pt")["epoch"] == 2


def test_a_rank_that_stops_answering_ends_the_job_and_torchrun_restarts_it(reference_runs, runs):
    """Rank 1 stopped (SIGSTOP) after step 15, with every timeout a tenth of the stages' (30 s):
    rank 0 says in one line that a rank stopped answering and exits 75, torchrun restarts the job
    from the last snapshot (epoch 1), and it ends on the uninterrupted model. Without the timeout,
    rank 0 would wait for gloo's 30 minutes."""
    cwd, run = runs["hung"]
    assert run.returncode == 0, run.output
    line = "error: rank 0 timed out waiting for a rank that stopped answering"
    assert run.output.count(line) == 1 and "(exitcode: 75)" in run.output, run.output
    assert "snapshot.pt: resumed after epoch 1, 2 to go" in run.output, run.output
    final = reference_runs["multigpu_torchrun"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(final))


def test_a_slow_save_does_not_end_the_job(runs):
    """A save that takes 45 s, while the training collectives' timeout is 30 s (a tenth of the
    stages'): the other rank waits for it in the save's own group (3 minutes here)."""
    cwd, run = runs["slow-save"]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1], run.output
    assert load(cwd / "snapshot.pt")["epoch"] == 1


def test_a_stop_to_one_worker_under_restarts_is_restarted_and_ends_exactly(reference_runs, runs):
    """SIGTERM to rank 1 alone under torchrun --max-restarts=1: every rank stops after the same
    step and rank 0 saves; torchrun restarts every failure, this exit too, and the restart
    resumes where the stop saved and ends on the uninterrupted model. (A stop meant for the job
    goes to torchrun: README.)"""
    cwd, run = runs["stop-restarts"]
    assert run.returncode == 0, run.output
    stops = [line for line in run.output.splitlines() if "stopped in epoch 2 after" in line]
    assert len(stops) == 1 and stops[0].startswith("SIGTERM: "), run.output
    samples = stops[0].split(" after ")[1].split()[0]
    resumed = f"snapshot.pt: resumed after epoch 1 and {samples} samples of epoch 2, 2 to go"
    assert resumed in run.output, run.output
    final = reference_runs["multigpu_torchrun"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(final))


def test_a_rank_that_stops_answering_at_a_save_ends_the_job_in_minutes(reference_runs, runs):
    """Rank 1 stopped (SIGSTOP) once epoch 1's figures are summed, before the save, with every
    timeout a tenth of the stages' (30 s; the wait for rank 0's write 3 minutes): rank 0 says so
    within the training timeout, not the save's, torchrun restarts the job, and it ends on the
    uninterrupted model."""
    cwd, (code, lines) = runs["hung-save"]
    output = "\n".join(line for _, line in lines)
    assert code == 0, output
    epoch = next(at for at, line in lines if line.startswith("Epoch 1 "))
    line = "error: rank 0 timed out waiting for a rank that stopped answering"
    timed_out = [at for at, text in lines if text == line]
    assert len(timed_out) == 1 and timed_out[0] - epoch < 90, output
    final = reference_runs["multigpu_torchrun"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(final))
