"""Bad input gets one clear line and a non-zero exit, never a traceback, and leaves an existing snapshot untouched."""
import os
import pickle
import runpy
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch, stage_env


def run_in_process(stage: str, args: list, monkeypatch) -> str:
    """Run a script's __main__ here (torch is already imported, so each case takes milliseconds)."""
    monkeypatch.setattr(sys, "argv", [f"{stage}.py", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path


@pytest.mark.parametrize("args, expected", [
    (["0", "1"], "argument total_epochs"), (["-1", "1"], "argument total_epochs"), (["x", "1"], "argument total_epochs"),
    (["1.5", "1"], "argument total_epochs"), (["2", "0"], "argument save_every"), (["--total_epochs", "0"], "total_epochs"),
    (["2", "1", "--batch_size", "0"], "--batch_size"), (["2", "1", "--batch_size", "many"], "--batch_size"),
    (["2", "1", "--arch", "resnet_9000"], "unknown --arch resnet_9000"), (["2", "1", "3"], "unrecognized arguments"),
])
def test_bad_arguments(workdir, monkeypatch, args, expected):
    assert expected in run_in_process("single_gpu", args, monkeypatch)


@pytest.mark.parametrize("stage", ["multigpu_torchrun", "multinode"])
def test_torchrun_scripts_started_with_python_say_how_to_launch(workdir, monkeypatch, stage):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert "with torchrun" in run_in_process(stage, ["2", "1"], monkeypatch)


def test_world_size(workdir, monkeypatch):
    assert "--world_size" in run_in_process("multigpu", ["2", "1", "--world_size", "0"], monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with 2 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "--world_size: invalid choice: 3" in run_in_process("multigpu", ["2", "1", "--world_size", "3"], monkeypatch)


def test_master_port_in_use(workdir, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        assert f"MASTER_PORT={busy.getsockname()[1]}" in run_in_process("multigpu", ["2", "1"], monkeypatch)


def make_bad_tree(root, case):
    if case == "empty":
        root.mkdir()
    elif case == "no_val":
        (root / "train" / "a").mkdir(parents=True)
    elif case == "no_images":
        (root / "train" / "a").mkdir(parents=True)
        (root / "val" / "a").mkdir(parents=True)
    elif case == "other_classes":
        for split, name in (("train", "a"), ("val", "b")):
            (root / split / name).mkdir(parents=True)
            from PIL import Image
            Image.new("RGB", (8, 8)).save(root / split / name / "0.png")


@pytest.mark.parametrize("case", ["missing", "empty", "no_val", "no_images", "other_classes"])
def test_bad_data_dir(workdir, monkeypatch, case):
    make_bad_tree(workdir / "data", case)
    assert "--data_dir" in run_in_process("single_gpu", ["2", "1", "--data_dir", workdir / "data"], monkeypatch)


class Payload:
    def __reduce__(self):
        return os.system, (f"touch {os.getcwd()}/payload-ran",)


def write_bad_snapshot(path, case):
    from conftest import load  # noqa: F401  (keeps one import style)
    if case == "garbage":
        path.write_bytes(b"this is not a snapshot\n" * 10)
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        model = torch.nn.Linear(2, 2)
        torch.save({"model": model.state_dict()}, path)
        path.write_bytes(path.read_bytes()[:200])
    elif case == "other_model":
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4))
        optimizer = torch.optim.AdamW(model.parameters())
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, path)
    elif case == "payload":
        torch.save({"model": {}, "optimizer": Payload(), "epoch": 1}, path)


@pytest.mark.parametrize("case", ["garbage", "empty", "truncated", "other_model", "payload"])
def test_bad_snapshot_is_refused_and_kept(workdir, monkeypatch, case):
    write_bad_snapshot(workdir / "snapshot.pt", case)
    before = (workdir / "snapshot.pt").read_bytes()
    message = run_in_process("single_gpu", ["2", "1"], monkeypatch)
    assert "cannot resume from snapshot.pt" in message
    assert (workdir / "snapshot.pt").read_bytes() == before
    assert not (workdir / "payload-ran").exists() and not list(workdir.glob("*.tmp"))


def test_one_line_on_stderr_as_a_user_sees_it(tmp_path):
    for stage in ("single_gpu", "multigpu_torchrun"):
        result = subprocess.run([sys.executable, str(REPO / f"{stage}.py"), "0", "1"], cwd=tmp_path, env=stage_env(),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and result.stdout == "", result
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    result = subprocess.run([sys.executable, str(REPO / "multinode.py"), "2", "1"], cwd=tmp_path, env=stage_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stderr.strip() == (
        "error: start multinode.py with torchrun, as the first lines of the file show"), result.stderr


@pytest.mark.parametrize("stage, case", [("multigpu", "payload"), ("multigpu_torchrun", "truncated")])
def test_distributed_stages_refuse_a_bad_snapshot(tmp_path, stage, case):
    write_bad_snapshot(tmp_path / "snapshot.pt", case)
    before = (tmp_path / "snapshot.pt").read_bytes()
    run = launch(stage, [2, 1], tmp_path, timeout=60)
    assert run.returncode != 0 and "error: cannot resume from snapshot.pt" in run.output, run.output
    assert "Traceback (most recent call last)" not in run.output, run.output
    assert (tmp_path / "snapshot.pt").read_bytes() == before and not (tmp_path / "payload-ran").exists()
