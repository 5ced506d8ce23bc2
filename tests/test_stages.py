"""Every stage trains for real, computes the same model, and resumes exactly (CPU + gloo)."""
import json

import pytest
import torch

from conftest import EPOCHS, STAGES, assert_bitwise_equal, load, max_param_diff, single_gpu


@pytest.mark.parametrize("stage", STAGES)
def test_learns_and_logs_global_figures(reference_runs, stage):
    cwd, run = reference_runs[stage]
    epochs = run.epochs()
    assert [e[0] for e in epochs] == list(range(1, EPOCHS + 1)), run.output  # rank 0 alone prints, once per epoch
    losses, accuracies = [e[1] for e in epochs], [e[2] for e in epochs]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 4, losses
    assert accuracies[-1] >= 0.95 and accuracies[-1] > accuracies[0], accuracies
    assert "Warning" not in run.output and "Traceback" not in run.output, run.output


def test_same_model_at_every_scale(reference_runs):
    """Seed 0 and global batch 64 give the same parameters after 2 epochs in all four stages."""
    reference = load(reference_runs["single_gpu"][0] / "snapshot.pt.epoch2")
    for stage in STAGES[1:]:
        other = load(reference_runs[stage][0] / "snapshot.pt.epoch2")
        assert max_param_diff(reference, other) <= 1e-4, stage
    logs = {stage: reference_runs[stage][1].epochs() for stage in STAGES}
    for stage in STAGES[1:]:  # the all-reduced loss and accuracy are the global ones, not rank 0's
        for (_, loss, acc, _), (_, loss0, acc0, _) in zip(logs[stage], logs["single_gpu"]):
            assert abs(loss - loss0) < 2e-3 and abs(acc - acc0) < 5e-3, (stage, logs[stage], logs["single_gpu"])


@pytest.mark.parametrize("stage", STAGES)
def test_snapshot_is_plain_and_loads_safely(reference_runs, stage):
    snapshot = torch.load(reference_runs[stage][0] / "snapshot.pt", weights_only=True)
    assert snapshot["epoch"] == EPOCHS and {"model", "optimizer", "epoch"} <= snapshot.keys()
    assert not any(k.startswith("module.") for k in snapshot["model"])
    single_gpu().build_model("convnet", 10).load_state_dict(snapshot["model"])  # strict: every key, every shape
    assert not list(reference_runs[stage][0].glob("*.tmp"))


def test_ranks_see_disjoint_shards(reference_runs):
    record = reference_runs["multigpu"][0] / "record"
    train_set, val_set, _ = single_gpu().load_datasets(None, 32)
    for epoch in range(EPOCHS):
        shards = [json.loads((record / f"train-rank{r}-epoch{epoch}.json").read_text()) for r in range(2)]
        assert not set(shards[0]) & set(shards[1]) and len(shards[0]) == len(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(len(train_set)))
    val = [json.loads((record / f"val-rank{r}.json").read_text()) for r in range(2)]
    assert not set(val[0]) & set(val[1]) and sorted(val[0] + val[1]) == list(range(len(val_set)))
    single = json.loads((reference_runs["single_gpu"][0] / "record" / "train-rank0-epoch1.json").read_text())
    assert [single[i] for i in range(0, 64, 2)] == json.loads((record / "train-rank0-epoch1.json").read_text())[:32]


def test_resume_is_exact(reference_runs, runs):
    """multigpu.py stopped after epoch 2 and started again to the end: bit for bit the uninterrupted run.
    (single_gpu.py: test_crash_while_saving_keeps_the_previous_snapshot, resumed from epoch 1.)"""
    cwd, run = runs["resume-multigpu"]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == list(range(3, EPOCHS + 1)), run.output
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(reference_runs["multigpu"][0] / f"snapshot.pt.epoch{EPOCHS}"))


@pytest.mark.parametrize("stage", ["multigpu_torchrun", "multinode"])
def test_elastic_restart_resumes_exactly(reference_runs, runs, stage):
    """A worker (rank 0, the writer, or rank 1 on the other node) is SIGKILLed in epoch 3: torchrun restarts the
    workers, they resume from the epoch-2 snapshot, and the job ends with the uninterrupted run's model."""
    cwd, run = runs[f"elastic-{stage}"]
    assert run.returncode == 0, run.output
    assert (cwd / "killed").exists(), "the fault was never injected"
    assert [e[0] for e in run.epochs()] == list(range(1, EPOCHS + 1)), run.output  # epoch 3 once: the restart resumed
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(reference_runs[stage][0] / f"snapshot.pt.epoch{EPOCHS}"))


def test_snapshot_resumes_in_another_stage(reference_runs, runs):
    cwd, run = runs["cross"]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == list(range(3, EPOCHS + 1)), run.output
    reference = load(reference_runs["single_gpu"][0] / f"snapshot.pt.epoch{EPOCHS}")
    assert max_param_diff(load(cwd / "snapshot.pt"), reference) <= 1e-4


def test_trains_on_an_image_folder(runs):
    cwd, run = runs["images"]
    assert run.returncode == 0, run.output
    epochs = run.epochs()
    assert len(epochs) == 4 and epochs[-1][1] < epochs[0][1] and epochs[-1][2] >= 0.9, run.output


def test_arch_takes_a_torchvision_model():
    model = single_gpu().build_model("resnet18", 4)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)
