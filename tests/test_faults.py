"""Failures: a crash while saving loses nothing, a dead rank ends the job, ranks never resume apart."""
import shutil

import pytest

from conftest import assert_bitwise_equal, launch, load, stage_env


def test_crash_while_saving_keeps_the_previous_snapshot(reference_runs, tmp_path):
    """The second save writes half a file and is SIGKILLed: snapshot.pt still holds epoch 1, and resuming is exact."""
    run = launch("single_gpu", [3, 1, "--batch_size", 64], tmp_path, stage_env(SAVE_KILL_AT="2"))
    assert run.returncode == -9, run.output
    assert load(tmp_path / "snapshot.pt")["epoch"] == 1
    assert (tmp_path / "snapshot.pt.tmp").exists()  # the half-written file never took snapshot.pt's place
    run = launch("single_gpu", [3, 1, "--batch_size", 64], tmp_path)
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [2, 3], run.output
    assert_bitwise_equal(load(tmp_path / "snapshot.pt"), load(reference_runs["single_gpu"][0] / "snapshot.pt.epoch3"))


@pytest.mark.parametrize("stage, fault, named", [
    ("multigpu", "raise:1:0", "Process 1 terminated"),
    ("multigpu", "kill:1:0", "error: rank 1 stopped (SIGKILL)"),
    ("multigpu_torchrun", "raise:1:0", "rank      : 1 (local_rank: 1)"),
    ("multigpu_torchrun", "kill:0:0", "rank      : 0 (local_rank: 0)"),
])
def test_a_dead_rank_ends_the_job(tmp_path, stage, fault, named):
    run = launch(stage, [2, 1], tmp_path, stage_env(FAULT_AT=fault), timeout=60)
    assert run.returncode != 0 and run.seconds < 60, run.output
    assert named in run.output, run.output


def test_ranks_that_see_different_snapshots_stop_together(reference_runs, tmp_path):
    """Two nodes without shared storage: node 0 has a snapshot, node 1 has none. Nobody trains from scratch."""
    nodes = tmp_path / "node0", tmp_path / "node1"
    for node in nodes:
        node.mkdir()
    shutil.copyfile(reference_runs["multinode"][0] / "snapshot.pt.epoch2", nodes[0] / "snapshot.pt")
    before = (nodes[0] / "snapshot.pt").read_bytes()
    run = launch("multinode", [3, 1, "--batch_size", 32], tmp_path, node_cwds=nodes, timeout=60)
    assert run.returncode != 0 and "error: ranks see different snapshots at snapshot.pt" in run.output, run.output
    assert "Epoch" not in run.output and not (nodes[1] / "snapshot.pt").exists()
    assert (nodes[0] / "snapshot.pt").read_bytes() == before
