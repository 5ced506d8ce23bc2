"""The four sbatch files, unmodified, on a real two-node Slurm cluster on this machine (see
slurm_cluster.py). The jobs run in the background from the session's start (conftest.py)."""

import pytest

from conftest import EPOCH_LINE, STAGES, load


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
