"""Every stage trains for real, computes the same model, and resumes exactly (CPU + gloo)."""
import json
import shutil

import pytest
import torch

from conftest import (STAGES, assert_bitwise_equal, global_batch_args, launch, load, max_param_diff, stage_env)


@pytest.mark.parametrize("stage", STAGES)
def test_learns_and_logs_global_figures(reference_runs, stage):
    cwd, run = reference_runs[stage]
    epochs = run.epochs()
    assert [e[0] for e in epochs] == [1, 2, 3], run.output  # rank 0 alone prints, once per epoch
    losses, accuracies = [e[1] for e in epochs], [e[2] for e in epochs]
    assert losses[0] > losses[1] > losses[2], losses
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
    import importlib.util
    spec = importlib.util.spec_from_file_location("single_gpu", reference_runs and __import__("conftest").REPO / "single_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    snapshot = torch.load(reference_runs[stage][0] / "snapshot.pt", weights_only=True)
    assert snapshot["epoch"] == 3 and {"model", "optimizer", "epoch"} <= snapshot.keys()
    assert not any(k.startswith("module.") for k in snapshot["model"])
    module.build_model("convnet", 10).load_state_dict(snapshot["model"])  # strict: every key, every shape
    assert not list(reference_runs[stage][0].glob("*.tmp"))


def test_ranks_see_disjoint_shards(reference_runs):
    record = reference_runs["multigpu"][0] / "record"
    for epoch in range(3):
        shards = [json.loads((record / f"train-rank{r}-epoch{epoch}.json").read_text()) for r in range(2)]
        assert not set(shards[0]) & set(shards[1]) and len(shards[0]) == len(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(2048))
    val = [json.loads((record / f"val-rank{r}.json").read_text()) for r in range(2)]
    assert not set(val[0]) & set(val[1]) and sorted(val[0] + val[1]) == list(range(512))
    single = json.loads((reference_runs["single_gpu"][0] / "record" / "train-rank0-epoch1.json").read_text())
    assert [single[i] for i in range(0, 64, 2)] == json.loads((record / "train-rank0-epoch1.json").read_text())[:32]


@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
def test_resume_is_exact(reference_runs, tmp_path, stage):
    """Stopped after epoch 2 and started again to epoch 3: bit for bit the uninterrupted run."""
    cwd = reference_runs[stage][0]
    shutil.copyfile(cwd / "snapshot.pt.epoch2", tmp_path / "snapshot.pt")
    run = launch(stage, [3, 1, *global_batch_args(stage)], tmp_path)
    assert run.returncode == 0, run.output
    assert [e[0] for e in run.epochs()] == [3], run.output
    assert_bitwise_equal(load(tmp_path / "snapshot.pt"), load(cwd / "snapshot.pt.epoch3"))


@pytest.mark.parametrize("stage, rank", [("multigpu_torchrun", 0), ("multinode", 1)])
def test_elastic_restart_resumes_exactly(reference_runs, tmp_path, stage, rank):
    """SIGKILL one worker (the writer, or another node's) in epoch 3: torchrun restarts all, they resume, exit 0."""
    env = stage_env(FAULT_AT=f"kill:{rank}:2", FAULT_ONCE=str(tmp_path / "killed"))
    run = launch(stage, [3, 1, *global_batch_args(stage)], tmp_path, env, torchrun_args=("--max-restarts=1",))
    assert run.returncode == 0, run.output
    assert (tmp_path / "killed").exists(), "the fault was never injected"
    assert [e[0] for e in run.epochs()] == [1, 2, 3], run.output  # epoch 3 once: the restart resumed from epoch 2
    assert_bitwise_equal(load(tmp_path / "snapshot.pt"), load(reference_runs[stage][0] / "snapshot.pt.epoch3"))


def test_snapshot_resumes_in_another_stage(reference_runs, tmp_path):
    shutil.copyfile(reference_runs["single_gpu"][0] / "snapshot.pt.epoch2", tmp_path / "snapshot.pt")
    run = launch("multigpu_torchrun", [3, 1, "--batch_size", 32], tmp_path)
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [3], run.output
    reference = load(reference_runs["multigpu_torchrun"][0] / "snapshot.pt.epoch3")
    assert max_param_diff(load(tmp_path / "snapshot.pt"), reference) <= 1e-4


def make_image_tree(root, classes=4, train=24, val=8, size=24):
    """PNG files in the ImageFolder layout; a class is a colour, so a few epochs suffice."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    colours = torch.rand(classes, 3, generator=g) * 200
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True)
            for i in range(count):
                pixels = (colours[c] + 55 * torch.rand(size, size, 3, generator=g)).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / f"class{c}" / f"{i}.png")


@pytest.mark.parametrize("stage", ["single_gpu", "multigpu"])
def test_trains_on_an_image_folder(tmp_path, stage):
    make_image_tree(tmp_path / "data")
    run = launch(stage, [4, 4, "--data_dir", tmp_path / "data", "--batch_size", 8, "--lr", "3e-3"], tmp_path)
    assert run.returncode == 0, run.output
    epochs = run.epochs()
    assert len(epochs) == 4 and epochs[-1][1] < epochs[0][1] and epochs[-1][2] >= 0.9, run.output
