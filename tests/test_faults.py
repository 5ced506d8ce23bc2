"""Failures: a crash while saving loses nothing, a dead rank ends the job, ranks never resume apart."""
import pytest

from conftest import DEAD_RANKS, EPOCHS, assert_bitwise_equal, load


@pytest.mark.parametrize("name", DEAD_RANKS)
def test_a_dead_rank_ends_the_job(runs, name):
    cwd, run = runs[name]
    assert run.returncode != 0 and run.ended - (cwd / "died").stat().st_mtime < 60, run.output
    assert DEAD_RANKS[name][2] in run.output, run.output


def test_crash_while_saving_keeps_the_previous_snapshot(reference_runs, runs):
    """snapshot.pt still holds epoch 1, loads, and a restart resumes from it to the uninterrupted run's model."""
    cwd, run = runs["save"]
    assert run.returncode == -9, run.output
    assert load(cwd / "snapshot.pt")["epoch"] == 1
    assert (cwd / "snapshot.pt.tmp").exists()  # the half-written file never took snapshot.pt's place
    cwd, run = runs["save-resume"]  # the same folder, copied, started again
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == list(range(2, EPOCHS + 1)), run.output
    uninterrupted = reference_runs["single_gpu"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(uninterrupted))


def test_ranks_that_see_different_snapshots_stop_together(runs):
    """Nobody trains from scratch while rank 0 resumes; the snapshot is left as it was."""
    cwd, run = runs["apart"]
    assert run.returncode != 0 and "error: ranks resume from different snapshots: put snapshot.pt" in run.output, run.output
    assert "Epoch" not in run.output and not (cwd.parent / "node1" / "snapshot.pt").exists()
    assert load(cwd / "snapshot.pt")["epoch"] == 2
