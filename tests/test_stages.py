"""Every stage trains for real, computes the same model, and resumes exactly (CPU + gloo)."""

import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from conftest import (
    EPOCHS,
    NODE_STAGES,
    REPO,
    STAGES,
    TORCHRUN,
    alone_under_torchrun,
    assert_bitwise_equal,
    assert_same_model,
    load,
    make_image_tree,
    own_output,
    single_gpu,
    stage_env,
    stage_module,
    write_bad_snapshot,
)


@pytest.mark.parametrize("stage", STAGES)
def test_learns_and_logs_global_figures(reference_runs, stage):
    cwd, run = reference_runs[stage]
    epochs = run.epochs()
    assert [e[0] for e in epochs] == list(range(1, EPOCHS + 1)), run.output  # rank 0, once
    losses, accuracies = [e[1] for e in epochs], [e[2] for e in epochs]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 4, losses
    assert accuracies[-1] >= 0.95 and accuracies[-1] > accuracies[0], accuracies
    assert {e[4] for e in epochs} == {64}, run.output  # the global batch, whatever the stage
    output = own_output(run.output)
    assert "Warning" not in output and "Traceback" not in output, run.output


def test_learning_rate_decays_to_zero_alike_in_every_stage(reference_runs):
    """Never above --lr (3e-3), falling every epoch to near 0 at the last, the same in every stage
    (the warm-up ends inside epoch 1, between the logged values)."""
    lrs = [e[3] for e in reference_runs["single_gpu"][1].epochs()]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] <= 3e-3 and lrs[-1] < 3e-3 / 50, lrs
    for stage in STAGES[1:]:
        assert [e[3] for e in reference_runs[stage][1].epochs()] == lrs, stage


def test_same_model_at_every_scale(reference_runs):
    """Seed 0 and global batch 64 give the same parameters after 2 epochs in all four stages."""
    reference = load(reference_runs["single_gpu"][0] / "snapshot.pt.epoch2")
    for stage in STAGES[1:]:
        other = load(reference_runs[stage][0] / "snapshot.pt.epoch2")
        assert_same_model(reference, other)
    logs = {stage: reference_runs[stage][1].epochs() for stage in STAGES}
    for stage in STAGES[1:]:  # the all-reduced loss and accuracy are the global ones
        for (_, loss, acc, *_), (_, loss0, acc0, *_) in zip(
            logs[stage], logs["single_gpu"], strict=True
        ):
            assert abs(loss - loss0) < 2e-3 and abs(acc - acc0) < 5e-3, (stage, logs)


@pytest.mark.parametrize("name", ["accumulate", "one-process", "accumulate-fsdp"])
def test_gradient_accumulation_gives_the_same_model(reference_runs, runs, name):
    """Global batch 64 as 2 processes x 8 x 4 micro-batches (DDP's no_sync but at updates), and as
    1 process x 16 x 4 under torchrun (no DDP: one process has no gradients to all-reduce): the
    model of single_gpu.py --batch_size 64, and the log says the global batch."""
    cwd, run = runs[name]
    assert run.returncode == 0, run.output
    assert [e[4] for e in run.epochs()] == [64] * EPOCHS, run.output
    reference = load(reference_runs["single_gpu"][0] / f"snapshot.pt.epoch{EPOCHS}")
    assert_same_model(load(cwd / "snapshot.pt"), reference)


def test_bf16_learns(runs):
    run = runs["exit-single_gpu"][1]  # --precision bf16, on the built-in data
    assert run.returncode == 0 and run.epochs()[-1][2] >= 0.9, run.output
    assert "Warning" not in run.output and "Traceback" not in run.output, run.output


@pytest.mark.parametrize("stage", STAGES)
def test_snapshot_is_plain_and_loads_safely(reference_runs, stage):
    """A plain dict of the unwrapped model's keys; where ranks may see different files
    (multinode.py, fsdp.py), each save also carries an id of its own, 8 random bytes."""
    snapshot = torch.load(reference_runs[stage][0] / "snapshot.pt", weights_only=True)
    assert snapshot["epoch"] == EPOCHS
    saves = [reference_runs[stage][0] / f"snapshot.pt.epoch{e}" for e in range(1, EPOCHS + 1)]
    ids = [load(save).get("id") for save in saves]
    if stage in NODE_STAGES:
        assert len(set(ids)) == EPOCHS and all(len(drawn) == 8 for drawn in ids), ids
    else:
        assert ids == [None] * EPOCHS, ids
    assert not any(k.startswith("module.") for k in snapshot["model"])
    model = single_gpu().build_model("convnet", 10, 32)
    model.load_state_dict(snapshot["model"])  # every key, every shape
    assert not list(reference_runs[stage][0].glob("*.tmp"))


@pytest.mark.parametrize("stage", STAGES)
def test_each_epoch_trains_in_a_new_order(reference_runs, stage):
    """The order each rank trained in, epoch by epoch (tests/faults records what its sampler
    gave): every epoch a new shuffle, the one of seed 0 + epoch, rank r of two taking every
    other sample of it from the r-th."""
    record = reference_runs[stage][0] / "record"
    ranks = (0,) if stage == "single_gpu" else (0, 1)
    orders = []
    for epoch in range(EPOCHS):
        shuffled = torch.randperm(640, generator=torch.Generator().manual_seed(epoch)).tolist()
        for rank in ranks:
            order = json.loads((record / f"train-rank{rank}-epoch{epoch}.json").read_text())
            assert order == shuffled[rank :: len(ranks)], (stage, epoch, rank)
        orders.append(shuffled)
    assert len({tuple(order) for order in orders}) == EPOCHS


@pytest.mark.parametrize("stage", STAGES)
def test_the_held_out_pass_changes_nothing_and_draws_nothing(stage):
    """evaluate() runs the model as at inference: BatchNorm uses its running statistics and does
    not update them with held-out data, dropout is off, so the model is unchanged and the same
    images give the same count twice; and no forward keeps what a backward would need."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Dropout(0.5))
    model.append(nn.Linear(16, 3))
    model(torch.randn(8, 3, 2, 2))  # a training step's forward: statistics to keep
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [(torch.randn(16, 3, 2, 2), torch.randint(3, (16,))) for _ in range(3)]
    graphs = []
    model.register_forward_hook(lambda module, inputs, output: graphs.append(output.requires_grad))
    evaluate = stage_module(stage).evaluate
    counts = [evaluate(model, iter(batches), torch.device("cpu")).item() for _ in range(2)]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert counts[0] == counts[1] and graphs == [False] * 6, (counts, graphs)


@pytest.mark.parametrize("stage", STAGES)
def test_every_step_trains_in_training_mode(stage, tmp_path, world_of_one):
    """Dropout on and BatchNorm on the batch's statistics at every step: the model's check at the
    build and each held-out pass leave it in evaluation mode, and each epoch turns training back
    on (2 epochs of 4 steps)."""
    trainer = small_trainer(stage_module(stage), tmp_path)
    trainer.args.total_epochs = 2
    run_batch, modes = trainer._run_batch, []

    def run_batch_and_look(source, targets):
        modes.append(all(module.training for module in trainer.model.modules()))
        return run_batch(source, targets)

    trainer._run_batch = run_batch_and_look
    assert trainer.train() == 0
    assert modes == [True] * 8, modes


class PositionBias(torch.nn.Module):
    """The convnet plus a bias that a layer computes from a float32 buffer, not from the images,
    as Swin V2's attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.convnet = single_gpu().build_model("convnet", 10, 32)
        self.mlp = torch.nn.Linear(2, 10)
        self.register_buffer("table", torch.ones(2))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.convnet(images) + self.mlp(self.table)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_evaluates_as_it_trains(stage, tmp_path, world_of_one):
    """--precision bf16: the held-out pass computes in bfloat16 as the steps do (4 steps, then 2
    held-out batches), so that fsdp.py, whose weights are bfloat16, can evaluate a model that
    feeds a float32 buffer to a layer."""
    trainer = small_trainer(stage_module(stage), tmp_path, precision="bf16", model=PositionBias())
    dtypes = []
    trainer.model.register_forward_hook(lambda m, _, out: dtypes.append((m.training, out.dtype)))
    assert trainer.train() == 0
    assert dtypes == [(True, torch.bfloat16)] * 4 + [(False, torch.bfloat16)] * 2, dtypes


@pytest.mark.parametrize("stage", ["multigpu", "multigpu_torchrun", "multinode"])
def test_ddp_averages_the_gradients_once_a_step(stage, tmp_path, monkeypatch, world_of_one):
    """--grad_accum 2 under DDP (a process group of one that says it has two ranks, so that the
    stage wraps its model): micro-batches that end no step add up their gradients locally
    (no_sync), and DDP all-reduces them once a step: 2 times for a rank's 4 micro-batches."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    module = stage_module(stage)
    monkeypatch.setattr(module, "load_snapshot", lambda *_: (0, 0, 0.0))  # gathers from 2 ranks
    trainer = small_trainer(module, tmp_path, samples=16)
    trainer.args.grad_accum = 2
    synced = []

    def count(state, bucket):
        synced.append(bucket.is_last())
        return allreduce_hook(state, bucket)

    trainer.train_model.register_comm_hook(None, count)
    assert trainer.train() == 0
    assert synced.count(True) == 2, synced


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_asks_for_deterministic_kernels(stage, deterministic, tmp_path, monkeypatch):
    """--deterministic: by the time the trainer starts, torch allows only deterministic kernels,
    cuBLAS has the workspace they need and cuDNN does not pick kernels by timing them; without
    it, cuDNN times them (on GPUs: results bit for bit, or speed). main() runs here in a process
    group of one, as torchrun would start it, up to the trainer."""
    module, seen = stage_module(stage), []

    def trainer(*_):
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        enabled = torch.are_deterministic_algorithms_enabled()
        seen.append((enabled, torch.backends.cudnn.benchmark, config))
        raise InterruptedError  # out of main(), before it trains

    monkeypatch.setattr(module, "Trainer", trainer)
    alone_under_torchrun(monkeypatch)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    flags = dict(data_dir=None, image_size=32, augment="none", arch="convnet", seed=0, lr=3e-3)
    flags.update(precision="fp32", batch_size=2, grad_accum=1, workers=0, compile=False)
    args = argparse.Namespace(**flags, deterministic=deterministic)
    handlers = {signum: signal.getsignal(signum) for signum in module.STOP_SIGNALS}
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    try:
        with pytest.raises(InterruptedError):
            module.main(args) if stage == "single_gpu" else module.main(0, args)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = benchmark
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)  # main() sets it
        if dist.is_initialized():
            dist.destroy_process_group()
    expected = (True, False, ":4096:8") if deterministic else (False, True, None)
    assert seen == [expected], seen


def test_clipping_changes_the_step(tmp_path):
    """--grad_clip: a small norm changes what a step does (the stages' runs with it: the same
    model in every stage, test_faults.py)."""
    trained = []
    for clip in (0.0, 1e-3):
        (tmp_path / str(clip)).mkdir()
        torch.manual_seed(0)
        trainer = small_trainer(single_gpu(), tmp_path / str(clip))
        trainer.args.grad_clip = clip
        assert trainer.train() == 0
        trained.append(torch.cat([p.flatten() for p in trainer.model.parameters()]))
    assert (trained[0] - trained[1]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "cores, node, processes, threads",
    [
        (4, 16, 4, 4),  # 4 srun tasks x 4 cores, each bound to its own (Slurm's task/affinity)
        (16, 16, 4, 4),  # the same, unbound (--cpu-bind=none): each sees the node's 16
        (64, 8, 4, 2),  # a torchrun in a job of 8 of a node's 64 cores, unbound
        (8, None, 2, 4),  # no Slurm: a CPU set of 8 cores (taskset) for 2 processes
        (1, 4, 4, 1),  # 4 tasks of one core each
    ],
)
def test_a_process_takes_its_share_of_the_node(monkeypatch, cores, node, processes, threads):
    """setup() sets as many threads as its share of the cores Slurm gives the job on the node,
    and no more than the cores it may use."""
    module = stage_module("multinode")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    if node is None:
        monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_ON_NODE", str(node))
    taken = []
    monkeypatch.setattr(torch, "set_num_threads", taken.append)
    module.setup(0, 0)
    assert taken == [threads]


def test_ranks_see_disjoint_shards(reference_runs):
    record = reference_runs["multigpu"][0] / "record"
    train_set, val_set, _ = single_gpu().load_datasets(None, 32, "none")
    for epoch in range(EPOCHS):
        shards = [
            json.loads((record / f"train-rank{r}-epoch{epoch}.json").read_text()) for r in (0, 1)
        ]
        assert not set(shards[0]) & set(shards[1]) and len(shards[0]) == len(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(len(train_set)))
    val = [json.loads((record / f"val-rank{r}.json").read_text()) for r in (0, 1)]
    assert not set(val[0]) & set(val[1]) and sorted(val[0] + val[1]) == list(range(len(val_set)))
    # single_gpu.py's order in epoch 2 (seed 0 + epoch 1): rank 0 takes every other sample of it
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(1)).tolist()
    assert json.loads((record / "train-rank0-epoch1.json").read_text()) == order[0::2]


@pytest.mark.parametrize("stage", ["multigpu_torchrun", "multinode"])
def test_elastic_restart_resumes_exactly(reference_runs, runs, stage):
    """A worker (rank 0, the writer, or rank 1 on the other node) is SIGKILLed in epoch 3:
    torchrun restarts the workers, they resume from the epoch-2 snapshot, and the job ends with
    the uninterrupted run's model."""
    cwd, run = runs[f"elastic-{stage}"]
    assert run.returncode == 0, run.output
    assert (cwd / "killed").exists(), "the fault was never injected"
    assert [e[0] for e in run.epochs()] == list(range(1, EPOCHS + 1)), run.output  # 3 once
    final = reference_runs[stage][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_bitwise_equal(load(cwd / "snapshot.pt"), load(final))


@pytest.mark.parametrize("name", ["cross", "cross-fsdp"])
def test_snapshot_resumes_in_another_stage(reference_runs, runs, name):
    """fsdp.py's snapshot of epoch 2 resumed in single_gpu.py, and single_gpu.py's in fsdp.py:
    epoch 3 ends on the model of single_gpu.py's epoch 3."""
    cwd, run = runs[name]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [3], run.output
    reference = load(reference_runs["single_gpu"][0] / f"snapshot.pt.epoch{EPOCHS}")
    assert_same_model(load(cwd / "snapshot.pt"), reference)


def test_learns_characters_with_default_flags(runs):
    """Drawn characters (b, d, p, q...: a mirror image is another class), default flags: high
    held-out accuracy, and the last epoch is within 0.02 of the best."""
    run = runs["glyphs"][1]
    assert run.returncode == 0, run.output
    accuracies = [e[2] for e in run.epochs()]
    assert accuracies[-1] >= 0.9 and accuracies[-1] >= max(accuracies) - 0.02, run.output


def test_distributed_stage_trains_on_an_image_folder(runs):
    run = runs["exit-multigpu"][1]  # with 2 loader workers a process
    assert run.returncode == 0, run.output
    epochs = run.epochs()
    assert len(epochs) == 4 and epochs[-1][1] < epochs[0][1] and epochs[-1][2] >= 0.9, run.output


def test_cifar10_recipe_flags(runs):
    """ResNet-18 with padded random crops and flips, as the README's CIFAR-10 recipe, at batch 19
    on 96 images: the last batch, of one sample, is left out (BatchNorm cannot train on it)."""
    cwd, run = runs["cifar-flags"]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1, 2], run.output
    assert "Warning" not in run.output and "Traceback" not in run.output, run.output
    assert "fc.weight" in load(cwd / "snapshot.pt")["model"]


def test_a_last_batch_of_one_is_left_out_unless_it_is_the_only_one():
    """BatchNorm cannot train on one sample; a folder of one image (a rank's share of two, at
    two ranks) still trains on it: nothing trained made the epoch's line divide by zero."""
    args = argparse.Namespace(workers=0, batch_size=2, seed=0)
    for samples, batches in ((5, [2, 2]), (4, [2, 2]), (1, [1])):
        data = TensorDataset(torch.zeros(samples, 1), torch.zeros(samples))
        train_data, _ = single_gpu().prepare_dataloaders(data, data, args, gpu=False)
        assert [len(targets) for _, targets in train_data] == batches


def small_trainer(stage, tmp_path, samples: int = 8, precision: str = "fp32", model=None) -> object:
    """The stage's Trainer (of the convnet unless `model` is given) on random images at batch 2
    (4 steps for 8 samples), on the CPU; the distributed stages in a process group of one
    (world_of_one)."""
    flags = dict(total_epochs=1, save_every=1, batch_size=2, grad_accum=1, lr=3e-3, seed=0)
    flags.update(workers=0, compile=False, precision=precision, grad_clip=0.0, save_minutes=30.0)
    args = argparse.Namespace(**flags, snapshot_path=str(tmp_path / "snapshot.pt"))
    data = TensorDataset(torch.randn(samples, 3, 32, 32), torch.arange(samples) % 10)
    train_data, val_data = stage.prepare_dataloaders(data, data, args, gpu=False)
    if model is None:  # an nn.Sequential of no layers would read as false
        model = stage.build_model("convnet", 10, 32)
    if hasattr(stage, "shard_model"):  # fsdp.py
        stage.shard_model(model, precision, torch.device("cpu"), False)
    run = {"batch": 2, "data": [10, samples, samples, 32]}
    return stage.Trainer(model, train_data, val_data, torch.device("cpu"), args, run)


def test_a_clipped_step_applies_the_norm_asked_for(tmp_path):
    """--grad_clip 0.01: the gradient that every step applies has the global norm 0.01 (the norm
    of all of the model's gradients together), computed here from the gradients themselves."""
    trainer = small_trainer(single_gpu(), tmp_path)
    trainer.args.grad_clip = 0.01
    norms = []

    def norm_before_step(optimizer, *_) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())

    trainer.optimizer.register_step_pre_hook(norm_before_step)
    assert trainer.train() == 0
    assert len(norms) == 4 and norms == pytest.approx([0.01] * 4, rel=1e-4), norms


@pytest.mark.parametrize("name", STAGES)
def test_saves_on_the_clock_every_save_minutes(name, tmp_path, monkeypatch, world_of_one):
    """--save_minutes 1, each step 25 s on the stage's own clock, 32 steps of one epoch: a save
    whenever a minute has passed since the last save, by this test's own count; in stages 2 to 5
    the ranks agree a step later, so each save comes a step after it is due."""
    stage = stage_module(name)
    now = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(stage, "time", fake_time)  # this module's clock only: runs go on beside
    saved = []
    monkeypatch.setattr(stage, "save_snapshot", lambda path, s: saved.append(s["samples"]) or True)
    trainer = small_trainer(stage, tmp_path, samples=64)
    trainer.args.save_minutes = 1.0
    trainer.saved_at = 0.0
    trainer.optimizer.register_step_post_hook(lambda *_: now.__setitem__(0, now[0] + 25))
    assert trainer.train() == 0
    expected, last = [], 0.0
    late = name != "single_gpu"
    due_at = None
    for step in range(1, 33):
        clock = 25.0 * step
        if due_at is None and clock > last + 60:
            due_at = step
        if due_at is not None and step == due_at + late:
            expected.append(2 * step)  # samples trained: 2 a step
            last, due_at = clock, None
    assert saved == [*expected, 0], saved  # then the epoch's end
    assert expected[:2] == ([6, 12] if not late else [8, 16]), expected


@pytest.mark.parametrize("name", STAGES)
def test_snapshots_are_saved_every_save_every_epochs(name, tmp_path, monkeypatch, world_of_one):
    """5 epochs with --save_every 2: saves after epochs 2 and 4, and after the last."""
    stage = stage_module(name)
    saved = []
    monkeypatch.setattr(stage, "save_snapshot", lambda path, s: saved.append(s["epoch"]) or True)
    trainer = small_trainer(stage, tmp_path)
    trainer.args.total_epochs, trainer.args.save_every = 5, 2
    assert trainer.train() == 0
    assert saved == [2, 4, 5], saved


@pytest.mark.parametrize("case", ["moment", "loss"])
@pytest.mark.parametrize("name", STAGES)
def test_a_moment_or_loss_not_finite_is_never_saved(
    name, case, tmp_path, monkeypatch, capsys, world_of_one
):
    """Weights that stay finite beside a value that is not: AdamW's second moment infinite (a
    gradient so large that its square overflows), or the loss infinite (an overflowed sum, which
    the snapshot would hold). The save (after the epoch, or the one the loss asks for a step or
    two later) is refused with one line, and the trainer ends with exit code 1."""
    stage = stage_module(name)
    saved = []
    monkeypatch.setattr(stage, "save_snapshot", lambda path, s: saved.append(s["epoch"]) or True)
    trainer = small_trainer(stage, tmp_path)
    if case == "moment":
        trainer.optimizer.register_step_post_hook(
            lambda optimizer, *_: next(iter(optimizer.state.values()))["exp_avg_sq"].fill_(math.inf)
        )
    else:
        run_batch = trainer._run_batch
        trainer._run_batch = lambda source, targets: run_batch(source, targets) * math.inf
    assert trainer.train() == 1 and not saved, saved
    assert all(p.isfinite().all() for p in trainer.model.state_dict().values())
    steps = {"moment": 4, "loss": 2 if name == "single_gpu" else 3}[case]
    error = "error: the run diverged: NaN or infinite values in epoch 1, "
    assert capsys.readouterr().err.startswith(f"{error}{steps} steps into the run")


@pytest.mark.parametrize("name", STAGES[1:])
def test_a_rank_whose_launcher_died_stops_and_saves(name, tmp_path, monkeypatch, world_of_one):
    """A rank whose parent is no longer its launcher (the launcher died, SIGKILLed) stops as on
    SIGTERM: it notes it after step 1, the ranks agree after step 2, and it saves there (the
    launchers killed for real: test_faults.py)."""
    stage = stage_module(name)
    monkeypatch.setattr(stage, "stop_signals", [])  # the module's own list, kept between tests
    saved = []
    monkeypatch.setattr(stage, "save_snapshot", lambda path, s: saved.append(s["samples"]) or True)
    trainer = small_trainer(stage, tmp_path)
    trainer.launcher = -1  # a process ID that no parent has
    assert trainer.train() == 128 + signal.SIGTERM
    assert saved == [4], saved  # 2 steps of 2 samples


@pytest.mark.parametrize("stage", STAGES)
def test_each_step_takes_the_scheduled_learning_rate(stage, tmp_path, world_of_one):
    """2 epochs of 9 micro-batches, 2 a step (--grad_accum 2) and the epoch's last alone: 10
    steps, whose learning rates rise linearly to --lr over the first 10% of the run and fall
    linearly to 0 at its end, each taken at the middle of its step."""
    trainer = small_trainer(stage_module(stage), tmp_path, samples=18)
    trainer.args.total_epochs, trainer.args.grad_accum = 2, 2
    rates = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, *_: rates.append(optimizer.param_groups[0]["lr"])
    )
    assert trainer.train() == 0
    middles = [(step + 0.5) / 10 for step in range(10)]
    expected = [3e-3 * (t / 0.1 if t < 0.1 else (1 - t) / 0.9) for t in middles]
    assert rates == pytest.approx(expected), rates


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one process, here, as setup() starts it in a run."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", STAGES)
def test_speed_counts_what_this_start_trained(name, tmp_path, monkeypatch, capsys, world_of_one):
    """samples/s: the samples an epoch trained since it began, resumed or saved, over that time.
    Resumed after 4 of 8 samples, with each step 1 s on the stage's own clock: 2 steps of 2
    samples in epoch 1, then 4 in epoch 2, both 2 samples/s."""
    stage = stage_module(name)
    now = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0])
    monkeypatch.setattr(stage, "time", fake_time)  # this module's clock only: runs go on beside
    trainer = small_trainer(stage, tmp_path)
    trainer.optimizer.register_step_post_hook(lambda *_: now.__setitem__(0, now[0] + 1))
    trainer.args.total_epochs = 2
    trainer.resume = (0, 4, 0.0)  # as a snapshot saved after 2 steps would give
    capsys.readouterr()  # what the start printed
    assert trainer.train() == 0
    epochs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch")]
    assert [line.rsplit(" | ", 1)[1] for line in epochs] == ["2 samples/s"] * 2, epochs


@pytest.mark.parametrize("name", STAGES)
def test_a_long_epoch_says_how_far_it_is(name, tmp_path, monkeypatch, capsys, world_of_one):
    """Inside an epoch, rank 0 prints `epoch N: step S of T` once 30 s have passed since the
    epoch began or the last such line (README). Each optimizer step here takes 1 s on a clock of
    the stage's own: 64 steps, lines after steps 31 and 62 (an interval of 29 s or 31 s fails)."""
    stage = stage_module(name)
    now = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(stage, "time", fake_time)  # this module's clock only: runs go on beside
    trainer = small_trainer(stage, tmp_path, samples=128)
    trainer.optimizer.register_step_post_hook(lambda *_: now.__setitem__(0, now[0] + 1))
    capsys.readouterr()  # what the start printed
    assert trainer.train() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["  epoch 1: step 31 of 64", "  epoch 1: step 62 of 64"], lines
    assert len(lines) == 3 and lines[2].startswith("Epoch 1 | loss "), lines


def test_rank_0_says_how_far_it_is_as_it_goes(runs):
    """Two processes (multigpu.py), steps of 10 s on the stage's clock: rank 0 alone prints the line
    every 30 s (steps 12, 24 and 36 of 40), each as it happens, not when the epoch's line flushes
    the output (the epoch's last 7 steps take 3.5 s after the first)."""
    _, (code, lines) = runs["two-cores"]
    output = "\n".join(line for _, line in lines)
    progress = [(at, line) for at, line in lines if line.startswith("  epoch 1: step")]
    expected = [f"  epoch 1: step {step} of 40" for step in (12, 24, 36)]
    assert code == 0 and [line for _, line in progress] == expected, output
    (epoch,) = [at for at, line in lines if line.startswith("Epoch 1 |")]
    assert epoch - progress[0][0] > 2, lines


def test_processes_share_the_cores_of_their_cpu_set(runs):
    """python multigpu.py --world_size 2 in a CPU set of two cores (taskset -c 0,1): one thread
    in each training process, not the set's two (the launcher, which trains nothing, and
    multiprocessing's helper keep torch's default)."""
    cwd, (code, lines) = runs["two-cores"]
    threads = [int(path.read_text()) for path in cwd.glob("threads-*")]
    assert code == 0 and threads.count(1) == 2, threads


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_and_step_draws_its_own_dropout(stage, tmp_path, world_of_one):
    """Dropout's draws come from the seed, the rank, the epoch and the step (README): two ranks
    draw apart, every step of 2 epochs draws anew, and the same rank and step draw the same
    again, as a resume does. Each epoch's samples load with that epoch in their keys' seed."""
    draws, epochs = [], []
    for run, rank in enumerate((0, 1, 0)):
        (tmp_path / str(run)).mkdir()
        trainer = small_trainer(stage_module(stage), tmp_path / str(run))
        trainer.global_rank, trainer.args.total_epochs = rank, 2
        seen = []

        def run_batch(source, targets, seen=seen, trainer=trainer) -> torch.Tensor:
            seen.append(torch.rand(()).item())  # where dropout draws
            epochs.append(trainer.train_data.sampler.epoch)  # in each sample's key: its crop, flip
            return torch.zeros((), dtype=torch.float64)

        trainer._run_batch = run_batch
        assert trainer.train() == 0
        draws.append(seen)
    assert draws[0] == draws[2] and len(set(draws[0])) == 8, draws
    assert not set(draws[0]) & set(draws[1]), draws
    assert epochs == [0, 0, 0, 0, 1, 1, 1, 1] * 3, epochs


def test_own_output_keeps_a_ranks_cpp_warnings():
    """The "no Warning" checks read own_output(): torchrun's agent lines go, a rank's C++
    warning (DDP's reducer, say) stays, and fails them."""
    agent = "W1126 12:00:00.517000 8903 torch/distributed/run.py:982] Setting OMP_NUM_THREADS"
    rank = "[W1126 12:00:00.517286934 reducer.cpp:1457] Warning: find_unused_parameters=True"
    output = own_output(f"{agent}\nEpoch 1 | loss 1.0\n{rank}\n")
    assert agent not in output and rank in output and "Warning" in output


def test_no_step_waits_for_the_device(tmp_path, monkeypatch):
    """On a GPU, reading a tensor on the host waits for the GPU to catch up. The stage reads its
    tensors twice an epoch, after it (loss and accuracy), and never inside a step but for its
    host copy of whether the loss is finite, which the GPU fills without a wait (one read a
    step). A save checks every tensor it writes (reads at the save only). The distributed stages
    add one read a step: the vote's CPU tensor, a step old."""
    stage = single_gpu()
    trainer = small_trainer(stage, tmp_path)
    reads = []

    def counting(name: str):
        read = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename == stage.__file__:  # the stage's own reads
                reads.append((name, frame.f_code.co_name, tensor is trainer.finite))
            return read(tensor, *args, **kwargs)

        return counted

    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    assert trainer.train() == 0
    steps = [read for read in reads if read[2]]
    saves = [read for read in reads if read[1] == "_save_snapshot"]
    others = [read[0] for read in reads if read not in steps and read not in saves]
    assert others == ["__float__", "__float__"], reads
    assert steps == [("__bool__", "_run_epoch", True)] * 4, reads  # 4 steps
    assert saves and {read[0] for read in saves} == {"__bool__"}, reads


@pytest.mark.parametrize("stage", STAGES)
def test_the_image_size_check_computes_nothing(monkeypatch, stage):
    """build_model() checks that the model takes --image_size on the meta device: every layer
    sees shapes, no numbers (at 7B parameters a forward on the host takes minutes)."""
    devices, forward = [], torch.nn.Conv2d.forward

    def seen(layer, images):
        devices.append(images.device.type)
        return forward(layer, images)

    monkeypatch.setattr(torch.nn.Conv2d, "forward", seen)
    model = stage_module(stage).build_model("resnet18", 10, 32)
    assert devices and set(devices) == {"meta"}, devices
    assert next(model.parameters()).device.type == "cpu"


def test_arch_takes_a_torchvision_model():
    model = single_gpu().build_model("resnet18", 4, 32)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_image_size_is_the_side_of_the_built_in_images_too():
    train, val, _ = single_gpu().load_datasets(None, 48, "none")
    assert train[0][0].shape == val[0][0].shape == (3, 48, 48)


def test_augmentation_keeps_the_class_unless_asked(tmp_path):
    """By default no random change: a flip would turn b into d. crop+flip: CIFAR-10's recipe."""
    from torchvision import transforms as T

    make_image_tree(tmp_path, classes=2, train=1, val=1)
    plain, _, _ = single_gpu().load_datasets(str(tmp_path), 32, "none")
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in plain.transform.transforms)
    both, _, _ = single_gpu().load_datasets(str(tmp_path), 32, "crop+flip")
    crop = [t for t in both.transform.transforms if isinstance(t, T.RandomCrop)]
    assert len(crop) == 1 and crop[0].padding == 4  # at 32x32: the usual 4-pixel padding
    assert any(isinstance(t, T.RandomHorizontalFlip) for t in both.transform.transforms)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_augmentation_draws_alike_whatever_the_workers_and_the_resume(tmp_path):
    """crop+flip: each image's crop and flip come from the seed, the epoch and its index, so an
    epoch's batches are the same with 0 or 2 loader workers, a resumed epoch's batches are those
    the uninterrupted epoch gives from there on, and another epoch draws anew."""
    make_image_tree(tmp_path, classes=2, train=8, val=1)
    train, val, _ = single_gpu().load_datasets(str(tmp_path), 32, "crop+flip")

    def batches(workers: int, epoch: int = 1, start: int = 0) -> list:
        args = argparse.Namespace(workers=workers, batch_size=4, seed=0)
        loader, _ = single_gpu().prepare_dataloaders(train, val, args, gpu=False)
        loader.sampler.set_epoch(epoch)
        loader.sampler.start = start
        return [images for images, _ in loader]

    whole = batches(0)
    assert len(whole) == 4 and all(map(torch.equal, whole, batches(2)))
    assert all(map(torch.equal, whole[2:], batches(2, start=8)))
    assert not all(map(torch.equal, whole, batches(0, epoch=2)))


def test_learning_rate_warms_up_then_decays_to_zero():
    """Linear from 0 to --lr over the first 10% of the run, then linear to 0 at its end."""

    def rate(done: float) -> float:  # at that fraction of a 1000-step run
        return single_gpu().get_lr(done * 1000 - 0.5, 1000, 1.0)

    assert rate(0.0) == 0 and rate(0.05) == pytest.approx(0.5) and rate(0.1) == pytest.approx(1)
    assert rate(0.55) == pytest.approx(0.5) and rate(1.0) == pytest.approx(0)


def model_and_optimizer(fused: bool, stage=None) -> tuple:
    """The default model and AdamW, fused when asked (as on GPUs), on the CPU; with fsdp.py's
    module, over the model's shards."""
    model = single_gpu().build_model("convnet", 10, 32)
    if hasattr(stage, "shard_model"):
        stage.shard_model(model, "fp32", torch.device("cpu"), False)
    return model, torch.optim.AdamW(model.parameters(), fused=fused)


@pytest.mark.parametrize("name", STAGES)
@pytest.mark.parametrize("fused", [True, False])
def test_the_optimizer_implementation_comes_from_the_machine(tmp_path, fused, name, world_of_one):
    """A snapshot of the other device type (fused AdamW on GPUs, not on a laptop) resumes with
    this machine's choice: the file's `fused` would switch the GPU's fused kernel off for good."""
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer(fused=not fused)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**snapshot, "epoch": 1, "samples": 0, "loss_sum": 0.0}, tmp_path / "snapshot.pt")
    stage = stage_module(name)
    model, optimizer = model_and_optimizer(fused=fused, stage=stage)
    assert stage.load_snapshot(tmp_path / "snapshot.pt", model, optimizer, {}) == (1, 0, 0)
    group = optimizer.param_groups[0]
    assert group["fused"] is fused and group["foreach"] is None, group
    step = next(iter(optimizer.state.values()))["step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 1  # where it goes
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()  # the chosen implementation runs from the loaded state
    assert optimizer.state_dict()["param_groups"][0]["fused"] is fused


@pytest.mark.parametrize("name", STAGES)
def test_a_file_no_rank_can_read_is_named_with_torchs_reason(tmp_path, name, world_of_one):
    """Garbage in the snapshot's place: the error names the file and torch's own reason, in every
    stage (multinode.py and fsdp.py raise it once the ranks agree that each found the same)."""
    path = tmp_path / "snapshot.pt"
    write_bad_snapshot(path, "garbage")
    with pytest.raises(RuntimeError) as reason:  # torch's words: mmap needs a zip file
        torch.load(path, "cpu", weights_only=True, mmap=True)
    model, optimizer = model_and_optimizer(fused=False, stage=stage_module(name))
    with pytest.raises(ValueError) as error:
        stage_module(name).load_snapshot(path, model, optimizer, {})
    said = f"cannot resume from {path}: {' '.join(str(reason.value).split())[:60]}"
    assert str(error.value).startswith(said), error.value


@pytest.mark.parametrize("stage", STAGES)
def test_a_process_on_a_gpu_node_takes_its_own_gpu_and_nccl(monkeypatch, stage):
    """On a node that shows 2 GPUs (torch told so: CI has none), setup() gives local rank 1 GPU
    1 and makes it the current device, lets float32 matmuls use TF32, and starts NCCL bound to
    that GPU as global rank 3 (single_gpu.py: the current GPU, TF32)."""
    module, called = stage_module(stage), {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: called.update(current=device))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: called.update(matmul=p))
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(
        dist, "init_process_group", lambda *args, **kw: called.update(group=(*args, kw))
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    if stage == "single_gpu":
        assert module.setup() == torch.device("cuda") and called == {"matmul": "high"}, called
        return
    gpu = torch.device("cuda", 1)
    assert module.setup(1, 3) == gpu
    group = ("nccl", {"rank": 3, "device_id": gpu, "timeout": module.TIMEOUT})
    assert called == {"current": gpu, "matmul": "high", "group": group}, called


@pytest.mark.parametrize("stage", STAGES[1:])
@pytest.mark.parametrize("gpus, processes", [(2, 4), (1, 2)])
def test_more_processes_than_gpus_are_refused(monkeypatch, stage, gpus, processes):
    """4 processes on a node that shows 2 GPUs, or two on one GPU (`--world_size 2` on a machine
    with one, torchrun's --nproc_per_node=2 there), would share a GPU (NCCL: "Duplicate GPU
    detected"): one line from local rank 0 before the process group starts, the others exit 1."""
    module = stage_module(stage)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    with pytest.raises(SystemExit) as exit_info:
        module.setup(0, 0)
    expected = f"error: {processes} processes on this node and {gpus} GPUs: one GPU each"
    assert exit_info.value.code == expected
    with pytest.raises(SystemExit) as exit_info:
        module.setup(processes - 1, 0)
    assert exit_info.value.code == 1


def test_flags_as_the_walkthroughs_write_them(runs):
    """--total_epochs N --save_every N (the exit runs; multigpu_torchrun.py parses as multinode.py
    does): it trains N epochs, where Python 3.10 and 3.11 refused the flags of a positional's
    pair."""
    for name, epochs in [("exit-single_gpu", EPOCHS), ("exit-multigpu", 4), ("exit-multinode", 1)]:
        run = runs[name][1]
        assert run.returncode == 0, (name, run.output)
        assert [e[0] for e in run.epochs()] == list(range(1, epochs + 1)), (name, run.output)


def test_the_legacy_launcher_trains(runs):
    """python -m torch.distributed.launch --nproc_per_node=2 (the accumulation run): --local-rank=N,
    then training. A torch without the module skips it (in CI: fails); test_errors.py checks the
    flag itself."""
    if importlib.util.find_spec("torch.distributed.launch") is None:
        pytest.skip("this torch has no torch.distributed.launch")
    run = runs["accumulate"][1]
    assert run.returncode == 0 and len(run.epochs()) == EPOCHS, run.output
    assert "unrecognized arguments" not in run.output, run.output


def test_nodes_meet_at_an_ipv6_endpoint(runs):
    """--rdzv-endpoint=[::1]:PORT, as the walkthrough writes [ipv6_address_master_node]:29603."""
    run = runs["exit-multinode"][1]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1], run.output
    assert [e[4] for e in run.epochs()] == [64], run.output


def test_a_process_takes_the_cores_of_its_cpu_set(runs):
    """Started in a CPU set of one core (taskset -c 0, as Slurm's --cpus-per-task confines a job
    on a larger machine), torchrun's process takes one thread, not the machine's count; so does
    its launcher (two processes in two cores: test_processes_share_the_cores_of_their_cpu_set)."""
    cwd, run = runs["one-process"]
    assert run.returncode == 0, run.output
    threads = [int(path.read_text()) for path in cwd.glob("threads-*")]
    assert len(threads) >= 2 and set(threads) == {1}, threads


def test_fsdp_says_its_units(reference_runs):
    """fsdp.py's start line: how many units, the largest's bytes and the model's; the snapshot
    holds the whole model."""
    cwd, run = reference_runs["fsdp"]
    model = single_gpu().build_model("convnet", 10, 32)
    units, largest, total = units_of(model)
    line = f"FSDP: {len(units) + 1} units, the largest {largest:,} of {total:,} bytes"
    assert run.output.count(line) == 1 and len(units) == 3, run.output
    snapshot = load(cwd / "snapshot.pt")
    for name, tensor in model.state_dict().items():
        assert snapshot["model"][name].shape == tensor.shape, name


def fsdp():
    return stage_module("fsdp")


def units_of(model: torch.nn.Module) -> tuple[list, int, int]:
    """fsdp.py's units (groups of blocks) of a model not yet sharded, the largest one's bytes (the
    root's own part counted as one) and the model's bytes."""
    total = sum(p.nbytes for p in model.parameters())
    units = fsdp().units(model)
    sizes = [sum(p.nbytes for block in unit for p in block.parameters()) for unit in units]
    return units, max([*sizes, total - sum(sizes)]), total


MODELS = ["resnet18", "resnet50", "vit_b_16", "convnext_tiny", "efficientnet_b0", "mobilenet_v2"]
MODELS += ["mobilenet_v3_large", "regnet_y_400mf", "densenet121", "swin_t", "squeezenet1_0"]


@pytest.mark.parametrize("arch", MODELS)
def test_fsdp_groups_the_repeated_blocks_into_a_few_units(arch):
    """Every repeated block (ResNet's, a transformer's layers, ConvNeXt's...) in a unit with its
    neighbours: 4 to 8 units, none over about a quarter of the model's parameter bytes, the rest in
    the root's unit. Each unit costs a gather and hooks a step (pytorch#173680): ViT-B/16's 12
    layers make 4 units, ResNet-18's blocks and layer4's parts 5."""
    from torchvision import models

    model = models.get_model(arch, num_classes=10)
    units, largest, total = units_of(model)
    assert 4 <= len(units) <= 8 and largest <= 0.3 * total, (arch, len(units), largest / total)
    grouped = [block for unit in units for block in unit]
    assert grouped == list(fsdp().blocks(model, total // 4))  # each block once, in order
    kinds = {type(block).__name__ for block in grouped}
    expected = {"resnet18": "BasicBlock", "vit_b_16": "EncoderBlock", "convnext_tiny": "CNBlock"}
    assert expected.get(arch, next(iter(kinds))) in kinds, kinds


def test_fsdp_builds_a_model_that_the_meta_device_cannot(runs):
    """RegNet computes its widths with tensors, which the meta device cannot: rank 1, which builds
    shapes only, builds it on the CPU instead, and the job trains an epoch on two nodes."""
    _, run = runs["regnet-fsdp"]
    assert run.returncode == 0 and [e[0] for e in run.epochs()] == [1], run.output


# Two ranks shard a model with a buffer outside the state dict: rank 1 builds it on the meta device,
# as fsdp.py does, so only rank 0's values can fill it.
BUFFERS = """
import importlib.util, os, sys
import torch, torch.distributed as dist
from torch import nn

spec = importlib.util.spec_from_file_location("fsdp", sys.argv[1])
fsdp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fsdp)

class Scaled(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("scale", torch.full((4,), 3.25), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale

def build():
    torch.manual_seed(0)
    return nn.Sequential(Scaled(), nn.GELU(), Scaled(), nn.Linear(4, 2))

dist.init_process_group("gloo")
images = torch.randn(3, 4)
expected = build()(images)
with torch.device("meta" if dist.get_rank() else "cpu"):
    model = build()
fsdp.shard_model(model, "fp32", torch.device("cpu"), False)
assert torch.equal(model[0].scale, torch.full((4,), 3.25)), model[0].scale
assert torch.equal(model(images), expected)
dist.destroy_process_group()
os._exit(0)  # as the stages end: Python's teardown of torch can abort ("terminate called")
"""


def test_fsdp_keeps_every_buffer(tmp_path):
    """A buffer outside the state dict (persistent=False: rotary tables, masks, constants) keeps
    its built value once sharded, as every other buffer and weight, on rank 0 and on a rank that
    built shapes only: the same output as before, at 2 processes."""
    (tmp_path / "buffers.py").write_text(BUFFERS)
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", "buffers.py", REPO / "fsdp.py"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,  # the test can end exactly what it started
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output


def test_fsdp_accumulates_gradients_at_a_ranks_share(tmp_path, world_of_one):
    """--grad_accum 2: after a micro-batch that ends no step, every parameter already holds its
    sharded gradient (reduce-scattered, a rank's share), not a whole one kept until the step."""
    trainer = small_trainer(fsdp(), tmp_path)
    trainer.args.grad_accum = 2
    run_batch, held = trainer._run_batch, []

    def run_batch_and_look(source, targets):
        loss = run_batch(source, targets)
        held.append(all(p.grad is not None for p in trainer.model.parameters()))
        return loss

    trainer._run_batch = run_batch_and_look
    assert trainer.train() == 0
    assert held and all(held), held


def two_groups(model: torch.nn.Module) -> list[dict]:
    """The usual AdamW groups: biases and norms without weight decay, first, then the weights:
    another order than named_parameters()."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        {"params": [p for p in params if p.ndim > 1]},
    ]


def test_fsdp_saves_and_loads_adamws_state_for_any_grouping(world_of_one):
    """AdamW in two parameter groups, one step on the same batch unsharded and under FSDP: the
    state fsdp.py writes is the plain optimizer's state dict (what the other stages write and
    read: parameters numbered in the optimizer's order), and loaded back it is FSDP's own."""
    from torch.distributed.checkpoint import state_dict as dcp

    torch.manual_seed(0)
    plain = single_gpu().build_model("convnet", 10, 32)
    sharded = fsdp().build_model("convnet", 10, 32)
    sharded.load_state_dict(plain.state_dict())
    fsdp().shard_model(sharded, "fp32", torch.device("cpu"), False)
    images, labels = torch.randn(4, 3, 32, 32), torch.arange(4)
    optimizers = []
    for model in (plain, sharded):
        optimizer = torch.optim.AdamW(two_groups(model), lr=1e-2)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizers.append(optimizer)
    _, state = dcp.get_state_dict(sharded, optimizers[1], options=fsdp().WHOLE)
    written, expected = fsdp().keyed(state, sharded, optimizers[1]), optimizers[0].state_dict()
    assert [g["params"] for g in written["param_groups"]] == [
        g["params"] for g in expected["param_groups"]
    ]
    assert written["state"].keys() == expected["state"].keys()
    for number, moments in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(written["state"][number][key], moments[key], atol=1e-7), number
    named = fsdp().keyed(written, sharded, optimizers[1])
    assert named["state"].keys() == state["state"].keys()
    dcp.set_optimizer_state_dict(sharded, optimizers[1], named, options=fsdp().BROADCAST)


def test_fsdp_trains_a_batchnorm_model_in_bf16(world_of_one):
    """shard_model() makes each repeated block an FSDP unit (layer4's, each over a quarter of the
    model, are cut into their convolutions) and BatchNorm one float32 unit: ResNet-18 takes an
    AdamW step in bf16, its convolutions and linear layer on bfloat16 weights, BatchNorm on
    float32 weights and statistics."""
    from torch.distributed.fsdp import FSDPModule
    from torchvision import models

    model = models.get_model("resnet18", num_classes=10)
    blocks = [m for m in model.modules() if isinstance(m, models.resnet.BasicBlock)]
    fsdp().shard_model(model, "bf16", torch.device("cpu"), False)
    assert all(isinstance(block, FSDPModule) for block in blocks[:6])  # layer4's: over a quarter
    assert all(isinstance(block.conv2, FSDPModule) for block in blocks[6:])
    assert isinstance(model.bn1, FSDPModule) and isinstance(model, FSDPModule)
    dtypes = {"norms": set(), "others": set()}

    def record(layer, *_) -> None:  # after FSDP gathers the layer's weights
        kind = "norms" if isinstance(layer, torch.nn.BatchNorm2d) else "others"
        dtypes[kind].add(layer.weight.dtype)

    for layer in model.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.BatchNorm2d)):
            layer.register_forward_hook(record, prepend=True)
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(torch.randn(4, 3, 32, 32)).float().logsumexp(1).mean()
    loss.backward()
    optimizer.step()
    assert dtypes == {"norms": {torch.float32}, "others": {torch.bfloat16}}, dtypes
    assert model.bn1.running_mean.dtype == torch.float32 and loss.isfinite()


def test_fsdp_cuts_a_block_into_parts_it_calls(world_of_one):
    """Swin-T's last blocks, each over a quarter of the model, are cut into their parts: its
    attention a unit whole, since it multiplies by its layers' weights without calling them (as
    units of their own, they would still be sharded). Sharded, it takes a step with the model's
    own gradients, so FSDP2's warning that some units return views (an in-place change of one
    would skip a gather; Swin changes none) is harmless here."""
    import copy
    import warnings

    from torch.distributed.fsdp import FSDPModule
    from torchvision import models

    model = models.get_model("swin_t", num_classes=10)
    whole = copy.deepcopy(model)
    last = model.features[-1][-1]
    assert sum(p.nbytes for p in last.parameters()) > sum(p.nbytes for p in model.parameters()) / 4
    fsdp().shard_model(model, "fp32", torch.device("cpu"), False)
    assert not isinstance(last, FSDPModule) and isinstance(last.attn, FSDPModule)
    assert not isinstance(last.attn.qkv, FSDPModule)
    images = torch.randn(1, 3, 64, 64)  # windows padded: the same units, a 12th of the work
    for net in (model, whole):
        torch.manual_seed(0)  # the same stochastic depth draws
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
            net(images).sum().backward()
    for (name, sharded), param in zip(model.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(sharded.grad.full_tensor(), param.grad), name


def test_fsdp_evaluates_every_held_out_image_once(monkeypatch, world_of_one):
    """2 held-out images at 4 ranks: each rank runs one forward (FSDP gathers in every one), and
    rank 3's is a copy of an image that never counts (target -1)."""
    from torch.utils.data import TensorDataset

    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 3)
    args = argparse.Namespace(workers=0, batch_size=2, seed=0)
    data = TensorDataset(torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.int64))
    val = TensorDataset(torch.ones(2, 3, 4, 4), torch.tensor([1, 2]))
    _, val_data = fsdp().prepare_dataloaders(data, val, args, gpu=False)
    batches = list(val_data)
    assert len(batches) == 1 and batches[0][1].tolist() == [-1], batches


@pytest.mark.parametrize("name", ["2to1", "1to2"])
def test_a_run_resumes_on_another_number_of_processes(reference_runs, runs, name):
    """Stopped in epoch 2 on 2 processes and resumed on 1 with --grad_accum 2, and the reverse:
    the global batch stays 64, the resume starts after the samples all ranks trained, and the run
    ends on the uninterrupted model to rounding (the sums add up in another order)."""
    cwd, stopped = runs[f"ranks-{name}"]
    assert stopped.returncode != 0 and "SIGTERM: stopped in epoch 2 after " in stopped.output
    _, resumed = runs[f"ranks-{name}-resumed"]
    assert resumed.returncode == 0, resumed.output
    assert "snapshot.pt: resumed after epoch 1 and " in resumed.output, resumed.output
    reference = reference_runs["multigpu_torchrun"][0] / f"snapshot.pt.epoch{EPOCHS}"
    assert_same_model(load(cwd / "snapshot.pt"), load(reference), params=1e-5, moments=1e-3)
