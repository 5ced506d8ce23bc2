"""Stage 3 of 4, torchrun starts one process per GPU, gives them their ranks, restarts them:
torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10  (CPUs: --nproc_per_node=2)

50 epochs, a snapshot every 10 (--help: the flags); each next stage adds distribution only. GPUs
if any, else the CPU (CUDA_VISIBLE_DEVICES= forces it). Ctrl-C, SIGTERM or SIGUSR1: it stops after
an optimizer step, saved. Run again, it resumes from its last snapshot, inside an epoch too.
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
import sys
import time
from contextlib import nullcontext

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # Ctrl-C, kill, Slurm: README
stop_signals: list[int] = []  # noted by the handler below; training stops after the next step


def note_stop_signal(signum: int, frame: object) -> None:
    """Training stops after the next optimizer step, saved. A launcher passes the signal on to the
    processes it started (multigpu.py's), which a signal to its PID alone would not reach. A
    second Ctrl-C ends the job at once, as Python programs do: the last snapshot stays whole."""
    again = signum == signal.SIGINT and signum in stop_signals and __name__ == "__main__"
    stop_signals.append(signum)
    for child in multiprocessing.active_children():
        if not child.daemon:  # loader workers are daemons: their training process ends them
            os.kill(child.pid, signal.SIGKILL if again else signum)
    if again:
        os.write(2, b"SIGINT again: ended at once, unsaved; the last snapshot is kept\n")
        os._exit(128 + signum)


if __name__ in ("__main__", "__mp_main__"):  # run as a script (__mp_main__: a spawned process)
    for signum in STOP_SIGNALS:  # noted from here on: before torch, whose import takes seconds
        signal.signal(signum, note_stop_signal)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def setup(local_rank: int, local_world_size: int, global_rank: int) -> torch.device:
    """The one place that picks the hardware: CUDA when present, else the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, cores // local_world_size))  # local processes share the cores
    gpus = torch.cuda.device_count()  # 1 where the launcher shows each process its own GPU
    if 1 < gpus < local_world_size:  # two processes on one GPU: NCCL would fail at start
        error = f"error: {local_world_size} processes on this node and {gpus} GPUs: one GPU each"
        sys.exit(error if local_rank == 0 else 1)
    device = torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # where pinned memory and the backend's buffers go
    backend = dist.get_default_backend_for_device(device)  # NCCL between GPUs, gloo between CPUs
    dist.init_process_group(backend, rank=global_rank, device_id=device.index)  # WORLD_SIZE: env
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)  # orphans would hold the GPUs
    return device


def load_datasets(data_dir: str | None, size: int, augment: str) -> tuple[Dataset, Dataset, int]:
    """(train, val, number of classes): built-in synthetic images, or DIR/{train,val}/CLASS/*."""
    if data_dir is None:
        if augment != "none":
            sys.exit("error: --augment needs --data_dir: the built-in images are not augmented")
        generator = torch.Generator().manual_seed(1234)  # every process and every run: same data
        labels = torch.randint(10, (640 + 80,), generator=generator)
        prototypes = torch.randn(10, 3, 4, 4, generator=generator)  # smooth: one per class
        prototypes = F.interpolate(prototypes, size=32, mode="bilinear")
        noise = torch.randn(len(labels), 3, 32, 32, generator=generator)
        data = TensorDataset(prototypes[labels] + 1.5 * noise, labels)
        return Subset(data, range(640)), Subset(data, range(640, 720)), 10
    from torchvision import datasets  # imported when used: it adds seconds to every start
    from torchvision import transforms as T

    resize = [T.Resize(size), T.CenterCrop(size)]
    to_tensor = [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]
    randomly = {"crop": T.RandomCrop(size, padding=size // 8), "flip": T.RandomHorizontalFlip()}
    chosen = [randomly[name] for name in augment.split("+") if name != "none"]
    try:
        train = datasets.ImageFolder(f"{data_dir}/train", T.Compose(resize + chosen + to_tensor))
        val = datasets.ImageFolder(f"{data_dir}/val", T.Compose(resize + to_tensor))
    except OSError as e:  # no such folder, no class folders, no images
        sys.exit(f"error: --data_dir {data_dir}: {e} (expected DIR/train/CLASS/, DIR/val/CLASS/)")
    if train.classes != val.classes:
        sys.exit(f"error: --data_dir {data_dir}: train/ and val/ must hold the same class folders")
    return train, val, len(train.classes)


def seed_of(*key: int) -> int:
    """64 bits from the whole key: hash() would give --seed -1 and -2 the same numbers."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class Seeded(Subset):
    """Samples by (seed, epoch, index) key, augmented alike in any process, worker or resume."""

    __getitems__ = None  # not by batches of indices: key by key, through __getitem__

    def __getitem__(self, key: tuple[int, int, int]) -> tuple:
        seed = seed_of(*key)  # every generator a transform may draw from: torch, random, numpy
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if "numpy" in sys.modules:  # the words of random's seed, swapped: other numbers
            sys.modules["numpy"].random.seed([seed >> 32, seed & 0xFFFFFFFF])
        return self.dataset[self.indices[key[-1]]]


class EpochSampler(DistributedSampler):
    """The epoch's share as keys, from its `start`-th on: a resume skips, never loads, the rest."""

    start = 0

    def __iter__(self):
        share = itertools.islice(super().__iter__(), self.start, None)
        return ((self.seed, self.epoch, index) for index in share)


def build_model(arch: str, num_classes: int) -> nn.Module:
    """convnet: a small smooth CNN (GELU, average pooling) without BatchNorm or dropout: README."""
    if arch == "convnet":
        # fmt: off
        return nn.Sequential(  # GroupNorm is per sample: every stage computes the same model
            nn.Conv2d(3, 32, 2, stride=2), nn.GroupNorm(8, 32), nn.GELU(),  # 2x2 patches: 16x16
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GELU(),  # at 8x8
            nn.Conv2d(128, 128, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
        )
        # fmt: on
    from torchvision import models  # imported when used: it adds seconds to every start

    if arch not in models.list_models(module=models):
        sys.exit(f"error: unknown --arch {arch}: use convnet or a torchvision classifier")
    if arch in ("googlenet", "inception_v3"):  # auxiliary heads: outputs in tuples when training
        sys.exit(f"error: --arch {arch} trains with auxiliary losses, which these scripts lack")
    return models.get_model(arch, num_classes=num_classes)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: DataLoader,
        val_data: DataLoader,
        device: torch.device,
        args: argparse.Namespace,
        definition: dict,
    ) -> None:
        self.model = model  # the plain model: evaluated and saved
        self.layout = torch.channels_last if device.type == "cuda" else torch.preserve_format
        self.model.to(memory_format=self.layout)  # NHWC: what tensor cores read fastest
        self.optimizer = optimizer
        self.train_data = train_data
        self.val_data = val_data
        self.device = device
        self.args = args
        self.definition = definition  # of the run: a snapshot of another run is not resumed
        self.bf16 = args.precision == "bf16"  # autocast matrix work to bfloat16
        shortest = len(val_data.dataset.dataset) // train_data.sampler.num_replicas  # val share
        self.val_checks = shortest // val_data.batch_size  # evaluation batches every rank has
        self.stop = torch.tensor(0)  # the stop signal noted at the last check, 0 for none
        self.agreement = None  # that check on its way between the ranks
        self.global_rank = dist.get_rank()  # unique in the job: rank 0 logs and writes snapshots
        loaded = [None] * dist.get_world_size()  # what each rank loaded, or why it could not:
        dist.all_gather_object(loaded, self._load_snapshot())  # none waits for one that left
        errors = [what for what in loaded if what.startswith("error:")]
        if errors or len(set(loaded)) > 1:  # every rank stops: none trains from another start
            dist.destroy_process_group()
            apart = f"error: ranks resume from different snapshots: share {args.snapshot_path}"
            sys.exit((errors + [apart])[0] if self.global_rank == 0 else 1)  # one line for the job
        self.cpu_group = dist.new_group(backend="gloo")  # agrees to stop without a GPU sync
        self.train_model = nn.parallel.DistributedDataParallel(model)  # all-reduces gradients
        if args.compile:  # fixed shapes; CUDA graphs launch a step at once, but each replay would
            mode = "reduce-overhead" if args.grad_accum == 1 else None  # overwrite summed gradients
            self.train_model = torch.compile(self.train_model, mode=mode)

    def _lock_snapshot(self) -> str:
        """The writer holds PATH.lock while it runs: a second run on the path stops at start."""
        path = self.args.snapshot_path
        try:  # held until this process ends, however it ends
            self.lock = os.open(f"{path}.lock", os.O_WRONLY | os.O_CREAT, 0o644)
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"error: {path} is in use by another run: give each run its own --snapshot_path"
        except OSError as e:  # a missing or read-only folder: no snapshot could be saved there
            return f"error: cannot save {path}: {e}"
        return ""

    def _load_snapshot(self) -> str:
        """Sets resume_at; returns what was loaded (a digest, or "none") or an error line."""
        path = self.args.snapshot_path
        self.resume_at = [0, 0, 0.0]  # epochs done; samples and loss sum into the next epoch
        locked = self._lock_snapshot() if self.global_rank == 0 else ""
        if locked or not os.path.exists(path):
            return locked or "none"
        try:  # weights_only=True: tensors and plain data only, never code from the file
            snapshot = torch.load(path, map_location=self.device, weights_only=True)
            ran = snapshot.get("run", self.definition)  # older snapshots did not record it
            differs = [
                f"{k} {ran.get(k)}, not {v}" for k, v in self.definition.items() if ran.get(k) != v
            ]
            if differs:  # resumed, it would end as neither run: say what differs
                other = f"{path} holds another run ({'; '.join(differs)})"
                return f"error: {other}: give this one its own --snapshot_path"
            self.model.load_state_dict(snapshot["model"])
            chosen = self.optimizer.param_groups  # fused or not: this machine's, not the file's
            for saved, group in zip(snapshot["optimizer"]["param_groups"], chosen, strict=True):
                saved.update(fused=group["fused"], foreach=group["foreach"])
            self.optimizer.load_state_dict(snapshot["optimizer"])
            self.resume_at = [snapshot.get(key, 0) for key in ("epoch", "samples", "loss_sum")]
            planned = int(snapshot.get("total_epochs", self.args.total_epochs))
        except pickle.UnpicklingError:  # pickled objects, or not a snapshot at all: nothing ran
            return f"error: cannot resume from {path}: not a file of tensors and plain data"
        except Exception as e:  # truncated, another model...: say which
            return f"error: cannot resume from {path}: {' '.join(str(e).split())[:300]}"
        for param, state in self.optimizer.state.items():  # moments in their parameter's layout
            for key, value in state.items():  # (channels-last on GPUs): fused AdamW needs it
                if value.dim() and value.shape == param.shape:
                    state[key] = torch.empty_like(param).copy_(value)
        total = self.args.total_epochs
        if self.global_rank == 0 and planned != total and self.resume_at[0] < total:
            print(f"Resuming a {planned}-epoch run: the learning rate now decays to 0 at {total}")
        digest = hashlib.sha256()  # of the same bytes on every rank, or they resume apart
        with open(path, "rb") as f:
            while block := f.read(1 << 20):  # a block at a time: snapshots can be large
                digest.update(block)
        return digest.hexdigest()

    def _save_snapshot(self, epochs_run: int, samples: int = 0, loss_sum: float = 0.0) -> str:
        """Writes the snapshot atomically; returns "", or the error line when it could not."""
        snapshot = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        snapshot.update(epoch=epochs_run, total_epochs=self.args.total_epochs)  # plain data
        snapshot.update(samples=samples, loss_sum=loss_sum)  # into the next epoch, when stopped
        snapshot.update(run=self.definition)
        path = self.args.snapshot_path
        temporary = f"{path}.{os.getpid()}.tmp"  # same folder: the rename below is atomic
        try:
            with open(temporary, "wb") as f:
                torch.save(snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)  # a crash before this keeps the last one
        except (OSError, RuntimeError) as e:  # a full disk, a folder gone: the last one stays
            with contextlib.suppress(OSError):
                os.remove(temporary)
            reason = " ".join(str(e).split())[:300]  # on one line
            return f"error: cannot save {path}: {reason}; the last snapshot is kept"
        return ""

    def _save(self, epochs_run: int, samples: int = 0, loss_sum: float = 0.0) -> bool:
        """Rank 0 writes the snapshot; every rank learns whether it could, once it is written."""
        error = self._save_snapshot(epochs_run, samples, loss_sum) if self.global_rank == 0 else ""
        failed = torch.tensor(1 if error else 0)
        dist.all_reduce(failed, group=self.cpu_group)  # the other ranks wait for the write
        if error:
            print(error, file=sys.stderr, flush=True)
        return not failed

    def _agreed_stop(self, now: bool = False) -> int:
        """The stop signal noted by any rank before the previous check, or 0; with `now`, before
        this one. A check travels between the ranks while the next training step computes: no
        step waits for the network. Evaluation batches wait (now): one batch can be long."""
        if self.agreement is not None:
            self.agreement.wait()
        agreed = int(self.stop)
        self.stop = torch.tensor(stop_signals[0] if stop_signals else 0)
        self.agreement = dist.all_reduce(self.stop, dist.ReduceOp.MAX, self.cpu_group, True)
        if now and self.agreement is not None:
            self.agreement.wait()
        return agreed or (int(self.stop) if now else 0)

    def _learning_rate(self, done: float) -> float:
        """One cycle: linear warm-up over the first 10% of the run, linear decay to 0 at its end."""
        return self.args.lr * min(done / 0.1, (1 - done) / 0.9)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed loss."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
            loss_sum = F.cross_entropy(self.train_model(source), targets, reduction="sum")
        (loss_sum / (self.args.batch_size * self.args.grad_accum)).backward()  # a mean, see README
        return loss_sum.detach()

    def _run_epoch(self, epoch: int, samples: int, loss_sum: float) -> tuple[torch.Tensor, int]:
        """Train one epoch from its `samples`-th sample (of all ranks) on, then evaluate; returns
        [train loss sum, samples, val correct, val samples] and 0, or the signal that stopped it."""
        sampler = self.train_data.sampler
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        per_step = sampler.num_replicas * self.args.batch_size  # samples of all ranks
        resumed = -(-samples // per_step)  # steps trained already, a short last one included
        sampler.start = resumed * self.args.batch_size  # samples skipped, not even loaded
        steps = len(self.train_data)
        trained = min(len(sampler), steps * self.args.batch_size)  # drop_last
        stats = [loss_sum * (self.global_rank == 0), trained, 0, len(self.val_data.dataset)]
        stats = torch.tensor(stats, dtype=torch.float64, device=self.device)  # sums in any order
        self.model.train()
        for step, (source, targets) in enumerate(self.train_data, resumed):
            source = source.to(self.device, non_blocking=True, memory_format=self.layout)
            targets = targets.to(self.device, non_blocking=True)
            torch.manual_seed(seed_of(self.args.seed, epoch, step, self.global_rank))  # dropout
            update = (step + 1) % self.args.grad_accum == 0 or step + 1 == steps
            with nullcontext() if update else self.train_model.no_sync():  # all-reduce only then
                stats[0] += self._run_batch(source, targets)  # no .item(): no host sync per step
            if update:  # the fraction of the run done at the middle of this update's samples
                first = step - step % self.args.grad_accum
                done = (epoch + (first + step + 1) / 2 / steps) / self.args.total_epochs
                for group in self.optimizer.param_groups:
                    group["lr"] = self._learning_rate(done)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stopped = self._agreed_stop()
                if stopped:  # after this step: what this rank trained on until now
                    stats[1] = min(len(sampler), (step + 1) * self.args.batch_size)
                    return stats, stopped
        self.model.eval()
        with torch.no_grad():
            for batch, (source, targets) in enumerate(self.val_data):
                source = source.to(self.device, non_blocking=True, memory_format=self.layout)
                targets = targets.to(self.device, non_blocking=True)
                stats[2] += (self.model(source).argmax(1) == targets).sum()
                stopped = self._agreed_stop(now=True) if batch < self.val_checks else 0
                if stopped:  # however long the evaluation: a resume evaluates this epoch again
                    return stats, stopped
        return stats, 0

    def train(self) -> int:
        """Trains to the end (returns 0), or until a stop signal (returns 128 + it, as a shell);
        1 when a snapshot could not be written."""
        global_batch = self.definition["batch"]  # samples per optimizer step, all ranks
        epochs_run, skipped, loss_sum = self.resume_at
        if epochs_run >= self.args.total_epochs and self.global_rank == 0:
            path, total = self.args.snapshot_path, self.args.total_epochs
            print(f"{path} holds all {total} epochs already: raise total_epochs to train on")
        for epoch in range(epochs_run, self.args.total_epochs):
            start = time.perf_counter()
            stats, stopped = self._run_epoch(epoch, skipped, loss_sum)
            dist.all_reduce(stats)  # sums over all ranks: rank 0 prints global figures
            loss_sum, samples, correct, evaluated = stats.tolist()  # the epoch's one host sync
            if stopped and not self._save(epoch, int(samples), loss_sum):  # where it stands
                return 1
            if stopped and self.global_rank == 0:
                where = f"in epoch {epoch + 1} after {int(samples)} samples"
                print(f"{signal.Signals(stopped).name}: stopped {where}; run again to resume")
            if stopped:
                return 128 + stopped
            lr = self.optimizer.param_groups[0]["lr"]
            figures = f"loss {loss_sum / samples:.4f} | acc {correct / evaluated:.4f} | lr {lr:.2e}"
            elapsed = time.perf_counter() - start
            speed = f"batch {global_batch} | {(samples - skipped) / elapsed:.0f} samples/s"
            if self.global_rank == 0:
                print(f"Epoch {epoch + 1} | {figures} | {speed}", flush=True)
            last = epoch + 1 == self.args.total_epochs
            if ((epoch + 1) % self.args.save_every == 0 or last) and not self._save(epoch + 1):
                return 1
            skipped = loss_sum = 0  # the next epoch from its start
        if self.agreement is not None:  # the last check: answered before the ranks part
            self.agreement.wait()
        return 0


def ignore_stop_signals(worker_id: int) -> None:
    """In loader workers. Slurm signals every process of a job, but the training process stops."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def end_loader_workers() -> None:
    """At exit: loader workers ignore SIGTERM, so multiprocessing's own exit would wait on them."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # nor is the loaders' check of their deaths due
    for worker in torch.multiprocessing.active_children():
        if worker.daemon:  # not the processes that multigpu.py's launcher waits for
            worker.kill()


def main(local_rank: int, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)  # the same initial weights in every stage
    try:  # each rank finds the same faults in the same input: rank 0 alone says them, once
        train_set, val_set, classes = load_datasets(args.data_dir, args.image_size, args.augment)
        model = build_model(args.arch, classes)  # both before the process group starts
    except SystemExit as e:
        sys.exit(e.code if local_rank == 0 else 1)
    device = setup(local_rank, int(os.environ["WORLD_SIZE"]), local_rank)  # global = local rank
    if args.deterministic:  # before the first CUDA kernel: cuBLAS reads this once
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not args.deterministic  # time kernels once, keep the fastest
    model.to(device)
    if device.type == "cuda":  # BatchNorm's statistics over all ranks (GPUs only)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    fused = device.type == "cuda"  # one kernel updates all parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused)
    train_set = Seeded(train_set, range(len(train_set)))  # augmented by sample, not by process
    sampler = EpochSampler(train_set, seed=args.seed)  # each rank: its share of each batch
    val_set = Subset(val_set, range(sampler.rank, len(val_set), sampler.num_replicas))  # a shard
    workers = min(8, torch.get_num_threads()) if fused else 0  # on the CPU: cores compute
    workers = workers if args.workers is None else args.workers  # prepare batches meanwhile
    atexit.register(end_loader_workers)  # runs before multiprocessing's: registered after it
    loading = {"num_workers": workers, "pin_memory": fused, "worker_init_fn": ignore_stop_signals}
    if workers:  # forked as under torchrun: a process that spawn started would spawn them, slowly
        loading["multiprocessing_context"] = "fork"
    drop_last = args.compile and len(sampler) >= args.batch_size  # compiled: one batch shape
    train = {"sampler": sampler, "drop_last": drop_last, "persistent_workers": workers > 0}
    train_data = DataLoader(train_set, args.batch_size, **train, **loading)
    val_data = DataLoader(val_set, 2 * args.batch_size, **loading)  # workers only while evaluating
    kept = ("arch", "lr", "seed", "augment", "image_size", "precision")  # decide the result
    definition = {name: getattr(args, name) for name in kept}
    processes = sampler.num_replicas  # that share each optimizer step
    global_batch = args.batch_size * args.grad_accum * processes
    definition.update(data=[classes, len(train_set), len(val_set.dataset)], batch=global_batch)
    trainer = Trainer(model, optimizer, train_data, val_data, device, args, definition)
    code = trainer.train()
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what Python's exit runs: logging's, trackers' and your handlers
    sys.stdout.flush()  # and prints still buffered (under Slurm stdout is a file)
    os._exit(code)  # not the rest: DDP keeps gloo's threads alive, and they can abort it: README


if __name__ == "__main__":

    def integer(text: str, least: int = 1) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return int(text)

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, no usage
    add = parser.add_argument
    add("epochs", type=integer, nargs="?", metavar="total_epochs", help="as --total_epochs")
    add("every", type=integer, nargs="?", metavar="save_every", help="as --save_every")
    add("--total_epochs", type=integer, default=5, help="epochs in all (5)")
    add("--save_every", type=integer, default=5, help="snapshot every N epochs and at the end")
    add("--batch_size", type=integer, default=32, help="samples per micro-batch and process")
    add("--grad_accum", type=integer, default=1, help="micro-batches per optimizer step (1)")
    add("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (3e-3)")
    add("--seed", type=int, default=0, help="seed of weights, shuffling and augmentation (0)")
    add("--snapshot_path", default="snapshot.pt", help="resume from and save to (snapshot.pt)")
    add("--data_dir", help="DIR/train/CLASS/*, DIR/val/CLASS/* images (default: built-in data)")
    add("--image_size", type=integer, default=32, help="side of the model's input (32)")
    add("--augment", default="none", choices=["none", "crop", "flip", "crop+flip"], help="(none)")
    add("--arch", default="convnet", help="convnet, or a torchvision classifier: resnet18...")
    add("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast (fp32)")
    add("--deterministic", action="store_true", help="exact resume on GPUs, at some speed")
    add("--compile", action="store_true", help="torch.compile: faster steps, a slow start")
    add("--workers", type=lambda text: integer(text, 0), help="loader processes (GPU: 8, CPU: 0)")
    add("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)  # the legacy launcher's
    args = parser.parse_args()
    args.total_epochs = args.epochs or args.total_epochs  # positionals, or flags: either form
    args.save_every = args.every or args.save_every
    if "LOCAL_RANK" not in os.environ:
        sys.exit(f"error: start {os.path.basename(__file__)} with torchrun (see its first lines)")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # README, #135712
        sys.exit("error: with --max-restarts, run TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun")
    main(int(os.environ["LOCAL_RANK"]), args)
