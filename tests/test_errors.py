"""Bad input gets one clear line and a non-zero exit, never a traceback, and leaves an existing
snapshot untouched."""

import atexit
import contextlib
import io
import runpy
import shutil
import socket
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from conftest import (
    NODE_STAGES,
    REPO,
    TORCHRUN_STAGES,
    alone_under_torchrun,
    own_output,
    write_bad_snapshot,
)


def run_in_process(stage: str, args: list, monkeypatch) -> str:
    """Run a script's __main__ here (torch is already imported: each case takes milliseconds). It
    must exit with one line, the message, and print nothing else, warnings included; or with
    argparse's usage and error lines (exit code 2): then the error line is returned."""
    monkeypatch.setattr(sys, "argv", [f"{stage}.py", *map(str, args)])
    monkeypatch.setattr(atexit, "register", lambda function, *args: function)  # not in pytest's
    printed = io.StringIO()
    with (
        pytest.raises(SystemExit) as exit_info,
        warnings.catch_warnings(record=True) as warned,
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(printed),
    ):
        warnings.simplefilter("always")
        runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    message = exit_info.value.code
    if message == 2:
        lines = printed.getvalue().splitlines()
        assert lines[0].startswith("usage: ") and ": error: " in lines[-1] and not warned, lines
        return lines[-1]
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, (
        message
    )
    assert not printed.getvalue() and not warned, (
        printed.getvalue(),
        [str(w.message) for w in warned],
    )
    return message


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path


@pytest.mark.parametrize(
    "args, expected",
    [
        (["0", "1"], "argument epochs"),
        (["-1", "1"], "argument epochs"),
        (["x", "1"], "argument epochs"),
        (["1.5", "1"], "argument epochs"),
        (["2", "0"], "argument every"),
        (["--total_epochs", "0"], "total_epochs"),
        (["2", "1", "--batch_size", "0"], "--batch_size"),
        (["2", "1", "--batch_size", "many"], "--batch_size"),
        (["2", "1", "--arch", "resnet_9000"], "--arch resnet_9000: use convnet"),
        (["2", "1", "3"], "unrecognized arguments"),
        (["2", "1", "--grad_accum", "0"], "--grad_accum"),
        (["2", "1", "--lr", "-1"], "argument --lr: expected a number >= 0"),
        (["2", "1", "--lr", "nan"], "argument --lr: expected a number >= 0"),
        (["2", "1", "--grad_clip", "-1"], "argument --grad_clip: expected a number >= 0"),
        (["2", "1", "--grad_clip", "inf"], "argument --grad_clip: expected a number >= 0"),
        (["2", "1", "--save_minutes", "-5"], "argument --save_minutes: expected a number >= 0"),
        (["2", "1", "--save_minutes", "nan"], "argument --save_minutes: expected a number >= 0"),
        (["2", "1", "--workers", "-1"], "--workers"),
        (["2", "1", "--seed", "-1"], "--seed"),
        (["2", "1", "--seed", str(2**64)], "argument --seed: expected an integer in [0, 2**32)"),
        (["2", "1", "--precision", "fp16"], "--precision"),
        (["2", "1", "--augment", "rotate"], "--augment"),
        (["2", "1", "--augment", "flip"], "--augment needs --data_dir"),
        (["2", "1", "--arch", "vit_b_16"], "--arch vit_b_16 cannot take --image_size 32"),
        (["2", "1", "--image_size", "2"], "--arch convnet cannot take --image_size 2"),
        (["2", "1", "--arch", "resnet18", "--batch_size", "1"], "use --batch_size 2 or more"),
    ],
)
def test_bad_arguments(workdir, monkeypatch, args, expected):
    assert expected in run_in_process("single_gpu", args, monkeypatch)


@pytest.mark.parametrize("stage", TORCHRUN_STAGES)
def test_torchrun_scripts_started_with_python_say_how_to_launch(workdir, monkeypatch, stage):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert "with torchrun" in run_in_process(stage, ["2", "1"], monkeypatch)


@pytest.mark.parametrize("stage", TORCHRUN_STAGES)
def test_restarts_over_torchruns_shared_store_are_refused(workdir, monkeypatch, stage):
    """What torchrun --max-restarts=1 sets without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, with its
    store listening: one line, before the process group starts."""
    alone_under_torchrun(monkeypatch)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("it started"))
    threads = torch.get_num_threads()
    with socket.create_server(("127.0.0.1", 0)) as store:  # torchrun's, up
        monkeypatch.setenv("MASTER_PORT", str(store.getsockname()[1]))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
        message = run_in_process(stage, ["2", "1"], monkeypatch)
    torch.set_num_threads(threads)  # setup() took the share of a process alone on the machine
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message


def test_world_size(workdir, monkeypatch):
    assert "--world_size" in run_in_process(
        "multigpu", ["2", "1", "--world_size", "0"], monkeypatch
    )


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
    assert "--data_dir" in run_in_process(
        "single_gpu", ["2", "1", "--data_dir", workdir / "data"], monkeypatch
    )


@pytest.mark.parametrize("case", ["garbage", "empty", "truncated", "other_model", "payload"])
def test_bad_snapshot_is_refused_and_kept(workdir, monkeypatch, case):
    write_bad_snapshot(workdir / "snapshot.pt", case)
    before = (workdir / "snapshot.pt").read_bytes()
    message = run_in_process(
        "single_gpu", ["2", "1", "--snapshot_path", "snapshot.pt"], monkeypatch
    )
    assert "cannot resume from snapshot.pt" in message
    assert (workdir / "snapshot.pt").read_bytes() == before
    assert not (workdir / "payload-ran").exists() and not list(workdir.glob("*.tmp"))


@pytest.mark.parametrize("stage", TORCHRUN_STAGES)
def test_a_rank_that_refuses_a_snapshot_leaves_the_process_group(workdir, monkeypatch, stage):
    """A snapshot refused after the process group started: the error line, and the rank leaves the
    group before it exits (NCCL prints a warning at exit for a group left open). A group of one."""
    write_bad_snapshot(workdir / "snapshot.pt", "garbage")
    alone_under_torchrun(monkeypatch)
    monkeypatch.setattr(sys, "argv", [f"{stage}.py", "2", "1", "--snapshot_path", "snapshot.pt"])
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    torch.set_num_threads(threads)  # setup() took the share of a process alone on the machine
    assert "cannot resume from snapshot.pt" in exit_info.value.code and not dist.is_initialized()


def test_a_bad_flag_under_torchrun_is_said_once(runs):
    """Two nodes under torchrun, every rank parses `--lr -1`: argparse's usage and error from
    rank 0 alone, and torchrun fails."""
    run = runs["bad-flag"][1]
    output = own_output(run.output)
    assert output.count("usage: ") == 1 and output.count("error: ") == 1, run.output
    assert "error: argument --lr: expected a number >= 0, got -1.0" in output, run.output
    assert run.returncode == 1, run.output


def test_one_line_as_a_user_sees_it(runs):
    """The whole output of a real process, torch's import included, is the one line."""
    run = runs["no-torchrun"][1]
    assert run.returncode != 0 and run.output.strip() == (
        "error: start multinode.py with torchrun (see its first lines)"
    ), run.output


def test_distributed_stage_refuses_a_bad_snapshot(runs):
    """Every rank refuses the pickled payload (nothing runs), the job stops, the file is kept."""
    cwd, run = runs["bad-snapshot"]
    assert run.returncode != 0 and "error: cannot resume from snapshot.pt" in run.output, run.output
    assert "Traceback" not in run.output, run.output
    assert not (cwd / "payload-ran").exists() and not list(cwd.glob("*.tmp"))


def test_distributed_stage_says_an_input_error_once(runs):
    """Every rank finds it: the job prints the line once (the launcher adds none), no traceback."""
    run = runs["bad-data_dir"][1]
    assert run.returncode != 0 and run.output.count("error: ") == 1, run.output
    assert "Traceback" not in run.output and "so the job stopped" not in run.output, run.output


def test_googlenet_is_refused_in_one_line(workdir, monkeypatch):
    assert "aux loss" in run_in_process(
        "single_gpu", ["2", "1", "--arch", "googlenet"], monkeypatch
    )


@pytest.mark.parametrize(
    "flags, differs",
    [
        (["--batch_size", "16"], "batch 64, not 16"),  # the reference's global batch: 64
        (["--total_epochs", "5", "--batch_size", "64", "--lr", "0.001"], "lr 0.003, not 0.001"),
        (["--batch_size", "64", "--seed", "1"], "seed 0, not 1"),
        (["--batch_size", "32", "--grad_accum", "2", "--arch", "resnet18"], "arch convnet, not"),
    ],
)
def test_a_snapshot_of_another_run_is_refused(reference_runs, workdir, monkeypatch, flags, differs):
    """Another experiment on the same path: one line that names what differs, the file kept."""
    shutil.copyfile(reference_runs["single_gpu"][0] / "snapshot.pt", workdir / "snapshot.pt")
    before = (workdir / "snapshot.pt").read_bytes()
    message = run_in_process("single_gpu", [*flags, "--snapshot_path", "snapshot.pt"], monkeypatch)
    assert "cannot resume from snapshot.pt: it holds another run" in message, message
    assert differs in message, message
    assert (workdir / "snapshot.pt").read_bytes() == before


@pytest.mark.parametrize("stage", TORCHRUN_STAGES)
@pytest.mark.parametrize("flag", ["--local-rank=0", "--local_rank=0"])
def test_the_legacy_launchers_flag_is_accepted(workdir, monkeypatch, stage, flag):
    """torch.distributed.launch passes --local-rank=N: no "unrecognized arguments"."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    assert "with torchrun" in run_in_process(stage, ["2", "1", flag], monkeypatch)


@pytest.mark.parametrize("stage", NODE_STAGES)
def test_srun_tasks_without_an_address_say_so_once(workdir, monkeypatch, stage):
    """srun python multinode.py (or fsdp.py) without MASTER_ADDR: rank 0 prints torch's line that
    names the variable, the others exit without a line (setup's errors are bad input in main)."""
    # The task sets the first four from Slurm's: monkeypatch removes them after the test.
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    slurm = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_GTIDS": "0,1", "SLURM_NODEID": "0"}
    for name, value in {**slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert "MASTER_ADDR expected, but not set" in run_in_process(stage, ["2", "1"], monkeypatch)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.delenv("LOCAL_RANK")  # another task, as srun starts it
    assert run_silently(stage, ["2", "1"], monkeypatch) == 1


@pytest.mark.parametrize("stage", TORCHRUN_STAGES)
def test_a_bad_flag_is_said_by_rank_0_alone(workdir, monkeypatch, stage):
    """Every rank parses the flags: rank 0 prints argparse's usage and error, the others exit
    with the same code, 2, and print nothing (under torchrun: test_a_bad_flag_under_torchrun)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert "expected a number >= 0" in run_in_process(stage, ["2", "1", "--lr", "-1"], monkeypatch)
    monkeypatch.setenv("RANK", "1")
    assert run_silently(stage, ["2", "1", "--lr", "-1"], monkeypatch) == 2


def run_silently(stage: str, args: list, monkeypatch) -> int:
    """Run a script's __main__ here, as run_in_process() does, where it must print nothing: its
    exit code."""
    monkeypatch.setattr(sys, "argv", [f"{stage}.py", *map(str, args)])
    printed = io.StringIO()
    with (
        pytest.raises(SystemExit) as exit_info,
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(printed),
    ):
        runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    assert not printed.getvalue(), printed.getvalue()
    return exit_info.value.code
