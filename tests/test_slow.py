"""Runs that take minutes on the 2-core machine: python -m pytest -m slow (CI runs them too)."""

import statistics
import sys

import pytest

from conftest import (
    EPOCHS,
    REPO,
    launch,
    load,
    max_param_diff,
    processes_in,
    single_gpu,
    stage_env,
)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["multigpu", "multigpu_torchrun"])
def test_compile_under_ddp_with_accumulation(tmp_path, stage):
    """--compile with DDP and --grad_accum 2 (2 processes x 16 x 2): the model of the same run
    uncompiled, and a log line per epoch."""
    args = [EPOCHS, EPOCHS, "--batch_size", 16, "--grad_accum", 2]
    for name in ("plain", "compiled"):
        (tmp_path / name).mkdir()
    plain = launch(stage, args, tmp_path / "plain", timeout=600)
    compiled = launch(stage, [*args, "--compile"], tmp_path / "compiled", timeout=900)
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.output
    assert [e[0] for e in compiled.epochs()] == list(range(1, EPOCHS + 1)), compiled.output
    assert "Traceback" not in compiled.output, compiled.output
    snapshots = [load(tmp_path / name / "snapshot.pt") for name in ("plain", "compiled")]
    difference = max_param_diff(*snapshots)
    assert difference <= 1e-3, difference


@pytest.mark.slow
def test_compile_runs_on_the_cpu(tmp_path):
    """single_gpu.py --compile, in the flags' form: it trains, and its snapshot is the model's."""
    run = launch("single_gpu", ["--total_epochs", 1, "--save_every", 1, "--compile"], tmp_path)
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1], run.output
    assert "Traceback" not in run.output, run.output
    snapshot = load(tmp_path / "snapshot.pt")
    single_gpu().build_model("convnet", 10).load_state_dict(snapshot["model"])


@pytest.mark.slow
def test_compile_when_a_share_is_smaller_than_a_batch(tmp_path):
    """640 samples over 2 processes, --batch_size 512: no full batch to keep, still no traceback."""
    run = launch("multigpu", [1, 1, "--batch_size", 512, "--compile"], tmp_path, timeout=600)
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1], run.output


@pytest.mark.slow
@pytest.mark.parametrize("run_index", range(3))
def test_ten_epoch_runs_exit_cleanly(tmp_path, run_index):
    """No abort as torchrun's workers exit (it took about 1 in 30 such runs before)."""
    run = launch("multigpu_torchrun", [10, 5], tmp_path, timeout=600)
    assert run.returncode == 0 and len(run.epochs()) == 10, run.output
    assert "terminate called" not in run.output and not processes_in(tmp_path), run.output
    assert load(tmp_path / "snapshot.pt")["epoch"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["single_gpu", "multigpu_torchrun"])
def test_a_stage_keeps_up_with_the_plain_loop(tmp_path, stage):
    """benchmarks/stage_overhead.py, small: ResNet-18 on PNGs with 2 loader workers, the stage at
    world size 1 against the plain loop of the tutorials, in pairs. A stage's host work per step
    and per epoch would show as a ratio below 1 (measured: 0.96-1.04); 0.8 leaves room for this
    machine's noise."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import stage_overhead

    opts = stage_overhead.options(["--pairs", "2", "--images", "256", "--val", "64"])
    stage_overhead.bench.make_folder(tmp_path, opts.images, opts.val)
    env = stage_env()
    ratios = stage_overhead.paired_ratios(stage, opts, tmp_path, env)
    assert statistics.median(ratios) >= 0.8, ratios
