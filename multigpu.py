"""Stage 2 of 4, spawn starts a process per GPU, DDP trains: python multigpu.py 50 10

50 epochs, a snapshot every 10 (--help lists the flags). GPUs when there are, else the CPU, where
the distributed stages start 2 processes. Ctrl-C, SIGTERM or SIGUSR1 stop a run after an
optimizer step, saved: the same command resumes it. Each next stage adds distribution only.
"""

import argparse
import atexit
import contextlib
import fcntl
import hashlib
import itertools
import multiprocessing
import os
import pickle
import random
import signal
import socket
import sys
import time

# Stop signals are noted from the start, as importing torch takes seconds: see "Stopping".
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
stop_signals: list[int] = []
if __name__ in ("__main__", "__mp_main__"):
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: stop_signals.append(signum))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def setup(local_rank: int, local_world_size: int, global_rank: int) -> torch.device:
    """The one place that picks the hardware: a GPU of its own for each process, else the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, cores // local_world_size))
    gpus = torch.cuda.device_count()
    if 1 < gpus < local_world_size:
        error = f"error: {local_world_size} processes on this node and {gpus} GPUs: one GPU each"
        sys.exit(error if local_rank == 0 else 1)
    device = torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    backend = dist.get_default_backend_for_device(device)  # NCCL between GPUs, gloo between CPUs
    dist.init_process_group(backend, rank=global_rank, device_id=device.index)  # the rest: env
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)  # no orphan holds a GPU
    return device


def load_datasets(data_dir: str | None, size: int, augment: str) -> tuple[Dataset, Dataset, int]:
    """Returns train, val and the number of classes: built-in data, or DIR/{train,val}/CLASS/*."""
    if data_dir is None:
        if augment != "none":
            sys.exit("error: --augment needs --data_dir: the built-in images are not augmented")
        # A smooth prototype per class under noise, the same in every process.
        generator = torch.Generator().manual_seed(1234)
        labels = torch.randint(10, (720,), generator=generator)
        prototypes = torch.randn(10, 3, 4, 4, generator=generator)
        prototypes = F.interpolate(prototypes, size=32, mode="bilinear")
        images = prototypes[labels] + 1.5 * torch.randn(720, 3, 32, 32, generator=generator)
        train = TensorDataset(images[:640], labels[:640])
        return train, TensorDataset(images[640:], labels[640:]), 10
    from torchvision import datasets
    from torchvision import transforms as T

    resize = [T.Resize(size), T.CenterCrop(size)]
    to_tensor = [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]
    randomly = {"crop": T.RandomCrop(size, padding=size // 8), "flip": T.RandomHorizontalFlip()}
    chosen = [randomly[name] for name in augment.split("+") if name != "none"]
    try:
        train = datasets.ImageFolder(f"{data_dir}/train", T.Compose(resize + chosen + to_tensor))
        val = datasets.ImageFolder(f"{data_dir}/val", T.Compose(resize + to_tensor))
    except OSError as e:
        sys.exit(f"error: --data_dir {data_dir}: {e} (expected DIR/train/CLASS/, DIR/val/CLASS/)")
    if train.classes != val.classes:
        sys.exit(f"error: --data_dir {data_dir}: train/ and val/ must hold the same class folders")
    return train, val, len(train.classes)


def seed_of(*key: int) -> int:
    """64 bits from the whole key (hash() gives -1 and -2 the same)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class Seeded(Dataset):
    """Samples by (seed, epoch, index) key, which seeds every generator a transform may draw
    from: a sample is augmented alike in any process, loader worker or resume."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> tuple:
        seed = seed_of(*key)
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if "numpy" in sys.modules:
            # random's words swapped: the same words would draw the same numbers.
            sys.modules["numpy"].random.seed([seed >> 32, seed & 0xFFFFFFFF])
        return self.dataset[key[-1]]


class EpochSampler(DistributedSampler):
    """This rank's keys of the epoch from the `start`-th on: a resume skips the rest unloaded."""

    start = 0

    def __iter__(self):
        share = itertools.islice(super().__iter__(), self.start, None)
        return ((self.seed, self.epoch, index) for index in share)


def build_model(arch: str, num_classes: int) -> nn.Module:
    """convnet: a small CNN normalized per sample (GroupNorm): the same at any number of ranks."""
    if arch == "convnet":
        # fmt: off
        return nn.Sequential(
            nn.Conv2d(3, 32, 2, stride=2), nn.GroupNorm(8, 32), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GELU(),
            nn.Conv2d(128, 128, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
        )
        # fmt: on
    from torchvision import models

    if arch not in models.list_models(module=models):
        sys.exit(f"error: unknown --arch {arch}: use convnet or a torchvision classifier")
    if arch in ("googlenet", "inception_v3"):
        sys.exit(f"error: --arch {arch} trains with auxiliary losses, which these scripts lack")
    return models.get_model(arch, num_classes=num_classes)


def get_lr(step: int, steps: int, peak: float) -> float:
    """At the middle of optimizer step `step` of `steps`: warm-up for 10%, then decay to 0."""
    done = (step + 0.5) / steps
    return peak * min(done / 0.1, (1 - done) / 0.9)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: DataLoader,
        val_data: DataLoader,
        device: torch.device,
        args: argparse.Namespace,
        run: dict,
    ) -> None:
        # Channels-last: the layout tensor cores read fastest.
        self.layout = torch.channels_last if device.type == "cuda" else torch.preserve_format
        self.model = model.to(memory_format=self.layout)
        self.optimizer = optimizer
        self.train_data = train_data
        self.val_data = val_data
        self.device = device
        self.args = args
        self.run = run
        self.global_rank = dist.get_rank()
        # Every rank resumes from the same snapshot, or none trains.
        self.resume = self._load_snapshot()
        loaded = [None] * dist.get_world_size()
        dist.all_gather_object(loaded, self.resume)
        errors = [done["error"] for done in loaded if "error" in done]
        if not errors and len({done["digest"] for done in loaded}) > 1:
            errors = [f"error: ranks resume from different snapshots: share {args.snapshot_path}"]
        if errors:
            dist.destroy_process_group()
            sys.exit(errors[0] if self.global_rank == 0 else 1)
        self.cpu_group = dist.new_group(backend="gloo")  # stops and saves agree off the GPU
        self.stop_check = StopCheck(self.cpu_group)
        # The training step calls train_model; evaluation and snapshots use the model.
        self.train_model = nn.parallel.DistributedDataParallel(model)
        if args.compile:
            # CUDA graphs launch a step at once, but a replay would overwrite summed gradients.
            mode = "reduce-overhead" if args.grad_accum == 1 else None
            self.train_model = torch.compile(self.train_model, mode=mode)

    def _load_snapshot(self) -> dict:
        """Where training resumes and the digest of the snapshot, or {"error": line}."""
        path = self.args.snapshot_path
        error = self._lock_snapshot() if self.global_rank == 0 else ""
        if error:
            return {"error": error}
        if not os.path.exists(path):
            return {"epoch": 0, "samples": 0, "loss_sum": 0.0, "digest": ""}
        try:
            # weights_only: tensors and plain data, never code from the file.
            snapshot = torch.load(path, map_location=self.device, weights_only=True)
            ran = snapshot.get("run", self.run)
            differs = [f"{k} {ran.get(k)}, not {v}" for k, v in self.run.items() if ran.get(k) != v]
            if differs:
                other = f"{path} holds another run ({'; '.join(differs)})"
                return {"error": f"error: {other}: give this one its own --snapshot_path"}
            self._restore(snapshot)
        except pickle.UnpicklingError:
            return {"error": f"error: cannot resume from {path}: not only tensors and plain data"}
        except Exception as e:
            return {"error": f"error: cannot resume from {path}: {' '.join(str(e).split())[:300]}"}
        total = self.args.total_epochs
        planned = snapshot.get("total_epochs", total)
        if self.global_rank == 0 and planned != total and snapshot.get("epoch", 0) < total:
            print(f"Resuming a {planned}-epoch run: the learning rate now decays to 0 at {total}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        resume = {key: snapshot.get(key, 0) for key in ("epoch", "samples", "loss_sum")}
        return {**resume, "digest": digest.hexdigest()}

    def _lock_snapshot(self) -> str:
        """Locks PATH.lock until this process ends: a second run on the path stops at start."""
        path = self.args.snapshot_path
        try:
            descriptor = os.open(f"{path}.lock", os.O_WRONLY | os.O_CREAT, 0o644)
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"error: {path} is in use by another run: give each run its own --snapshot_path"
        except OSError as e:
            return f"error: cannot save {path}: {e}"
        return ""

    def _restore(self, snapshot: dict) -> None:
        self.model.load_state_dict(snapshot["model"])
        # This machine's AdamW implementation, not the file's: a laptop's would turn fused off.
        saved_groups = snapshot["optimizer"]["param_groups"]
        for saved, group in zip(saved_groups, self.optimizer.param_groups, strict=True):
            saved.update(fused=group["fused"], foreach=group["foreach"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        # Fused AdamW needs moments with their parameter's strides (channels-last on GPUs).
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if value.dim() and value.shape == param.shape:
                    state[key] = torch.empty_like(param).copy_(value)

    def _save_snapshot(self, epochs_run: int, samples: int, loss_sum: float) -> str:
        """Writes the snapshot atomically; returns "" or the error."""
        snapshot = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        snapshot.update(epoch=epochs_run, samples=samples, loss_sum=loss_sum, run=self.run)
        snapshot.update(total_epochs=self.args.total_epochs)
        path = self.args.snapshot_path
        # Written beside it, then renamed over it: a crash or a full disk keeps the last one.
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "wb") as f:
                torch.save(snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except (OSError, RuntimeError) as e:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            reason = " ".join(str(e).split())[:300]
            return f"error: cannot save {path}: {reason}; the last snapshot is kept"
        return ""

    def _save(self, epochs_run: int, samples: int = 0, loss_sum: float = 0.0) -> bool:
        """Rank 0 writes; every rank waits for the write and learns whether it succeeded."""
        error = self._save_snapshot(epochs_run, samples, loss_sum) if self.global_rank == 0 else ""
        if error:
            print(error, file=sys.stderr, flush=True)
        failed = torch.tensor(1 if error else 0)
        dist.all_reduce(failed, group=self.cpu_group)
        return not failed

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, torch.bfloat16, self.args.precision == "bf16"):
            loss_sum = F.cross_entropy(self.train_model(source), targets, reduction="sum")
        # A mean over the global batch, whatever the micro-batch or the number of ranks.
        (loss_sum / (self.args.batch_size * self.args.grad_accum)).backward()
        return loss_sum.detach()

    def _train_epoch(self, epoch: int, samples: int) -> tuple[torch.Tensor, int, int]:
        """Trains the epoch from its `samples`-th sample (of all ranks) on. Returns this rank's
        loss sum and samples, and the stop signal that ended the epoch, or 0."""
        sampler = self.train_data.sampler
        sampler.set_epoch(epoch)
        batch_size, accumulate = self.args.batch_size, self.args.grad_accum
        # Resumed: after the last step trained, a short last one included.
        first = -(-samples // (sampler.num_replicas * batch_size))
        sampler.start = first * batch_size
        steps = len(self.train_data)
        updates = -(-steps // accumulate)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        report = time.monotonic() + 30
        self.model.train()
        for step, (source, targets) in enumerate(self.train_data, first):
            source = source.to(self.device, non_blocking=True, memory_format=self.layout)
            targets = targets.to(self.device, non_blocking=True)
            # Dropout's generator, seeded by step: the same at any scale and resume.
            torch.manual_seed(seed_of(self.args.seed, epoch, step, self.global_rank))
            update = (step + 1) % accumulate == 0 or step + 1 == steps
            # DDP all-reduces gradients in the backward pass of an update's last batch only.
            with contextlib.nullcontext() if update else self.train_model.no_sync():
                loss_sum += self._run_batch(source, targets)
            if not update:
                continue
            optimizer_step = epoch * updates + step // accumulate
            lr = get_lr(optimizer_step, self.args.total_epochs * updates, self.args.lr)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            stopped = self.stop_check()
            if stopped:
                return loss_sum, min(len(sampler), (step + 1) * batch_size), stopped
            if self.global_rank == 0 and time.monotonic() > report:
                print(f"  epoch {epoch + 1}: step {step + 1} of {steps}", flush=True)
                report = time.monotonic() + 30
        return loss_sum, min(len(sampler), steps * batch_size), 0

    def _evaluate(self) -> tuple[torch.Tensor, int, int]:
        """Returns this rank's correct answers and samples, and the stop signal that ended the
        evaluation, or 0."""
        self.model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        # Only the batches every rank has check for a stop (shards differ by one sample).
        shortest = len(self.val_data.dataset.dataset) // self.train_data.sampler.num_replicas
        checks = shortest // self.val_data.batch_size
        with torch.no_grad():
            for batch, (source, targets) in enumerate(self.val_data):
                source = source.to(self.device, non_blocking=True, memory_format=self.layout)
                targets = targets.to(self.device, non_blocking=True)
                correct += (self.model(source).argmax(1) == targets).sum()
                # A batch can be long: each checks, and waits for the answer.
                stopped = self.stop_check(now=True) if batch < checks else 0
                if stopped:
                    return correct, 0, stopped
        return correct, len(self.val_data.dataset), 0

    def train(self) -> int:
        """Returns 0 at the end; at a stop signal, saved, 128 + it; 1 if it cannot save."""
        epochs_run, skipped, loss_saved = [self.resume[k] for k in ("epoch", "samples", "loss_sum")]
        total = self.args.total_epochs
        if epochs_run >= total and self.global_rank == 0:
            path = self.args.snapshot_path
            print(f"{path} holds all {total} epochs already: raise total_epochs to train on")
        for epoch in range(epochs_run, total):
            began = time.perf_counter()
            loss_sum, samples, stopped = self._train_epoch(epoch, skipped)
            correct, evaluated = 0, 0
            if not stopped:
                correct, evaluated, stopped = self._evaluate()
            # The ranks' figures in one all-reduce: the epoch's one host sync.
            figures = [loss_sum, samples, correct, evaluated]
            figures = [torch.as_tensor(x, dtype=torch.float64, device=self.device) for x in figures]
            figures = torch.stack(figures)
            dist.all_reduce(figures)
            loss_sum, samples, correct, evaluated = figures.tolist()
            loss_sum += loss_saved
            if stopped:
                if not self._save(epoch, int(samples), loss_sum):
                    return 1
                if self.global_rank == 0:
                    where = f"in epoch {epoch + 1} after {int(samples)} samples"
                    print(f"{signal.Signals(stopped).name}: stopped {where}; run again to resume")
                return 128 + stopped
            lr = self.optimizer.param_groups[0]["lr"]
            speed = (samples - skipped) / (time.perf_counter() - began)
            if self.global_rank == 0:
                means = f"loss {loss_sum / samples:.4f} | acc {correct / evaluated:.4f}"
                rest = f"lr {lr:.2e} | batch {self.run['batch']} | {speed:.0f} samples/s"
                print(f"Epoch {epoch + 1} | {means} | {rest}", flush=True)
            last = epoch + 1 == total
            if ((epoch + 1) % self.args.save_every == 0 or last) and not self._save(epoch + 1):
                return 1
            skipped, loss_saved = 0, 0.0
        self.stop_check.close()
        return 0


# Stopping. Clusters stop jobs with signals (SIGTERM to preempt, SIGUSR1 before a time limit,
# SIGINT from Ctrl-C), often to every process. A training process only notes one. After each
# optimizer step the ranks learn together whether any noted one, and then save and stop after
# the same step. Loader workers ignore the signals: their training process ends them.


def note_stop_signal(signum: int, frame: object) -> None:
    """A second Ctrl-C ends the job at once, unsaved, as in other programs."""
    again = signum == signal.SIGINT and signum in stop_signals
    stop_signals.append(signum)
    pass_on_stop_signal(signal.SIGKILL if again else signum)
    if again:
        os.write(2, b"SIGINT again: ended at once, unsaved; the last snapshot is kept\n")
        os._exit(128 + signum)


def pass_on_stop_signal(signum: int = 0) -> None:
    """Sends `signum`, or the first stop signal noted, to the processes this one started
    (multigpu.py's ranks), not to loader workers."""
    for child in multiprocessing.active_children():
        if stop_signals and not child.daemon:
            os.kill(child.pid, signum or stop_signals[0])


class StopCheck:
    """Each check travels between the ranks while the next step computes, and is read at the
    next check: no step waits for the network."""

    def __init__(self, group: object) -> None:
        self.group = group
        self.noted = torch.tensor(0)
        self.pending = None

    def __call__(self, now: bool = False) -> int:
        """The signal any rank noted before the last check (with `now`: this one), or 0."""
        self.close()
        agreed = int(self.noted)
        self.noted = torch.tensor(stop_signals[0] if stop_signals else 0)
        self.pending = dist.all_reduce(self.noted, dist.ReduceOp.MAX, self.group, True)
        if now:
            self.close()
            return agreed or int(self.noted)
        return agreed

    def close(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def ignore_stop_signals(worker_id: int) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def end_loader_workers() -> None:
    """At exit: the workers ignore SIGTERM, which multiprocessing's exit would wait on."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in torch.multiprocessing.active_children():
        if worker.daemon:
            worker.kill()


def prepare_dataloaders(
    train_set: Dataset, val_set: Dataset, args: argparse.Namespace, gpu: bool
) -> tuple[DataLoader, DataLoader]:
    """The sampler deals each rank its share of the keys; each rank evaluates a shard of val."""
    sampler = EpochSampler(train_set, seed=args.seed)
    val_set = Subset(val_set, range(sampler.rank, len(val_set), sampler.num_replicas))
    # Loader processes prepare batches while GPUs compute; on a CPU the cores compute.
    workers = min(8, torch.get_num_threads()) if gpu else 0
    workers = workers if args.workers is None else args.workers
    # Forked as torchrun's ranks would: processes that spawn started would spawn theirs slowly.
    context = "fork" if workers else None
    loading = dict(num_workers=workers, pin_memory=gpu, multiprocessing_context=context)
    loading.update(worker_init_fn=ignore_stop_signals)
    atexit.register(end_loader_workers)
    # Compiled: one batch shape.
    drop_last = args.compile and len(sampler) >= args.batch_size
    train = dict(sampler=sampler, drop_last=drop_last, persistent_workers=workers > 0)
    train_data = DataLoader(train_set, args.batch_size, **train, **loading)
    return train_data, DataLoader(val_set, 2 * args.batch_size, **loading)


def main(local_rank: int, args: argparse.Namespace) -> int:
    global_rank = local_rank  # on one node, the rank in the job is the local rank
    torch.manual_seed(args.seed)
    # Data and model before the process group starts: every rank finds the same faults in the
    # input, and rank 0 alone says them.
    try:
        train_set, val_set, classes = load_datasets(args.data_dir, args.image_size, args.augment)
        model = build_model(args.arch, classes)
    except SystemExit as e:
        sys.exit(e.code if global_rank == 0 else 1)
    device = setup(local_rank, int(os.environ["LOCAL_WORLD_SIZE"]), global_rank)
    gpu = device.type == "cuda"
    if args.deterministic:
        # Before the first CUDA kernel: cuBLAS reads it once.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not args.deterministic
    model.to(device)
    if gpu:  # BatchNorm statistics over all ranks
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=gpu)
    train_data, val_data = prepare_dataloaders(Seeded(train_set), val_set, args, gpu)
    # What decides the result: a snapshot of another run is refused rather than resumed.
    run = {name: getattr(args, name) for name in ("arch", "lr", "seed", "augment", "image_size")}
    run.update(precision=args.precision, data=[classes, len(train_set), len(val_set)])
    run["batch"] = args.batch_size * args.grad_accum * train_data.sampler.num_replicas
    trainer = Trainer(model, optimizer, train_data, val_data, device, args, run)
    code = trainer.train()
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what Python's exit runs, but not past gloo's threads: README
    sys.stdout.flush()
    os._exit(code)


def integer(text: str, least: int = 1) -> int:
    if not text.isdigit() or int(text) < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return int(text)


if __name__ == "__main__":
    for signum in STOP_SIGNALS:
        signal.signal(signum, note_stop_signal)
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    # One line for bad input, without the usage.
    parser.error = lambda message: sys.exit(f"error: {message} (see --help)")
    add = parser.add_argument
    # Optional positionals, taken over the flags after parsing: both forms work.
    add("epochs", type=integer, nargs="?", metavar="total_epochs", help="as --total_epochs")
    add("every", type=integer, nargs="?", metavar="save_every", help="as --save_every")
    add("--total_epochs", type=integer, default=5)
    add("--save_every", type=integer, default=5, help="snapshot every N epochs and at the end")
    add("--batch_size", type=integer, default=32, help="per micro-batch and process")
    add("--grad_accum", type=integer, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--seed", type=int, default=0)
    add("--snapshot_path", default="snapshot.pt")
    add("--data_dir", help="DIR/train/CLASS/*, DIR/val/CLASS/* (default: built-in data)")
    add("--image_size", type=integer, default=32)
    add("--augment", default="none", choices=["none", "crop", "flip", "crop+flip"])
    add("--arch", default="convnet", help="convnet or a torchvision classifier")
    add("--precision", default="fp32", choices=["fp32", "bf16"])
    add("--deterministic", action="store_true", help="exact resume on GPUs, at some speed")
    add("--compile", action="store_true")
    gpus = torch.cuda.device_count()
    add("--world_size", type=integer, default=gpus or 2, choices=range(1, gpus + 1) or None)
    add("--workers", type=lambda text: integer(text, 0), help="loader processes (GPU: 8, CPU: 0)")
    args = parser.parse_args()
    args.total_epochs = args.epochs or args.total_epochs
    args.save_every = args.every or args.save_every
    try:
        with socket.socket() as s:  # a free port unless MASTER_PORT names one: runs never collide
            s.bind(("localhost", int(os.environ.get("MASTER_PORT", 0))))
            os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    except OSError as e:
        sys.exit(f"error: MASTER_PORT={os.environ['MASTER_PORT']}: {e}; choose a free one")
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(args.world_size)  # as torchrun
    ranks = torch.multiprocessing.spawn(main, args=(args,), nprocs=args.world_size, join=False)
    try:
        while not ranks.join(timeout=1, grace_period=5):  # a stop signal goes on to late ranks
            pass_on_stop_signal()
    except torch.multiprocessing.ProcessExitedException as e:
        sys.exit(f"error: {e}, so the job stopped" if e.signal_name else e.exit_code)
