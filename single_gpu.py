"""Stage 1 of 5: a complete trainer in one process, on one GPU or on the CPU.

    python single_gpu.py 50 10

50 10 trains 50 epochs, saving a snapshot every 10. Ctrl-C, SIGTERM or SIGUSR1 stops and saves the
run after the first optimizer step to end after the signal (in stages 2 to 5, one step later), or
lets it finish if none does. The same command resumes it. A second Ctrl-C ends it at once, unsaved.
"""

import argparse
import contextlib
import itertools
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

# Ctrl-C, SIGTERM (a preemption, scancel) and SIGUSR1 (Slurm's time-limit warning) stop and save.
STOP_SIGNALS = [getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, s)]
stop_signals: list[int] = []


def note_stop_signal(signum: int, frame: object) -> None:
    """Notes a stop signal. After a Ctrl-C, a second stop signal ends the process at once."""
    stop_signals.append(signum)
    if signum == signal.SIGINT:
        for stop in STOP_SIGNALS:
            signal.signal(stop, signal.SIG_DFL)


def start_loader_worker(worker_id: int) -> None:
    """A loader worker leaves the stop signals to its training process, and dies with it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # The kernel kills the worker when its training process dies, even a worker stopped in a read.
    # torch has no public call for it: test_a_second_ctrl_c_ends_the_job_at_once fails without it.
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGKILL)


def setup() -> torch.device:
    """The one place that picks the hardware: a GPU if there is one, else the CPU."""
    gpus = torch.cuda.device_count()
    device = torch.device("cuda" if gpus else "cpu")
    if gpus:
        torch.set_float32_matmul_precision("high")  # float32 matmuls use the faster TF32 cores
    return device


def load_datasets(data_dir: str | None, size: int, augment: str) -> tuple[Dataset, Dataset, int]:
    """The training set, the held-out set and the number of classes: the built-in images, or
    your folders DIR/train/CLASS/* and DIR/val/CLASS/*."""
    if data_dir is None:
        if augment != "none":
            raise ValueError("--augment needs --data_dir: the built-in images are not augmented")
        g = torch.Generator().manual_seed(1234)  # each class has a pattern; each image adds noise
        labels = torch.randint(10, (720,), generator=g)
        prototypes = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=size)
        images = prototypes[labels] + 1.5 * torch.randn(720, 3, size, size, generator=g)
        train = TensorDataset(images[:640], labels[:640])
        return train, TensorDataset(images[640:], labels[640:]), 10
    from torchvision import datasets
    from torchvision import transforms as T

    resize = [T.Resize(size), T.CenterCrop(size)]
    to_tensor = [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]
    randomly = {"crop": T.RandomCrop(size, padding=size // 8), "flip": T.RandomHorizontalFlip()}
    chosen = [transform for name, transform in randomly.items() if name in augment]
    try:
        train = datasets.ImageFolder(f"{data_dir}/train", T.Compose(resize + chosen + to_tensor))
        val = datasets.ImageFolder(f"{data_dir}/val", T.Compose(resize + to_tensor))
    except OSError as e:
        raise ValueError(f"--data_dir {data_dir}: {e} (expects DIR/{{train,val}}/CLASS/)") from None
    if train.classes != val.classes:
        raise ValueError(f"--data_dir {data_dir}: train/ and val/ need the same class folders")
    return train, val, len(train.classes)


class SeededSamples(Dataset):
    """Seeds each sample's random draws (an image's crop and flip) from the run's seed, the epoch
    and the sample's index: neither the number of loader processes nor a resume changes them."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __getitem__(self, key: tuple[int, int]) -> tuple:  # the sampler gives (epoch, index)
        torch.manual_seed(hash((self.seed, *key)))
        return self.dataset[key[1]]


class EpochSampler(RandomSampler):
    """Shuffles by seed and epoch, so every epoch has its own order and a resume the same one;
    it gives (epoch, index) pairs from the epoch's `start`-th sample on (where a stop resumes)."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        super().__init__(dataset, generator=torch.Generator())
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.generator.manual_seed(self.seed + epoch)

    def __iter__(self):
        return ((self.epoch, i) for i in itertools.islice(super().__iter__(), self.start, None))


def build_model(arch: str, classes: int, size: int) -> nn.Module:
    """convnet, a small CNN, or a torchvision classifier. convnet normalises with GroupNorm,
    which works within each sample, so it trains alike at any number of ranks."""
    if arch == "convnet":
        # fmt: off
        model = nn.Sequential(
            nn.Conv2d(3, 32, 2, stride=2), nn.GroupNorm(8, 32), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GELU(), nn.Conv2d(128, 128, 3, padding=1),
            nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes),
        )
        # fmt: on
    else:
        from torchvision import models

        if arch not in models.list_models(module=models) or arch in ("googlenet", "inception_v3"):
            raise ValueError(f"--arch {arch}: use convnet or torchvision classifiers (no aux loss)")
        model = models.get_model(arch, num_classes=classes)
    # A meta-device forward pass checks the image size (ViT takes 224 only), computing nothing.
    try:
        named = [*model.named_parameters(), *model.named_buffers()]
        with torch.device("meta"), torch.no_grad():
            shapes = {name: tensor.to("meta") for name, tensor in named}
            torch.func.functional_call(model.eval(), shapes, torch.zeros(1, 3, size, size))
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"--arch {arch} cannot take --image_size {size}: {e}") from None
    return model


def get_lr(step: int, steps: int, peak: float) -> float:
    """The learning rate in the middle of step `step` of `steps`: it rises linearly over the
    first 10% of the steps, then falls linearly to 0."""
    done = (step + 0.5) / steps
    return peak * min(done / 0.1, (1 - done) / 0.9)


def load_snapshot(path: str, model: nn.Module, optimizer: torch.optim.AdamW, run: dict) -> tuple:
    """Loads the snapshot, if there is one, into the model and optimizer. Returns where to
    resume: the epochs done, then the samples trained and their loss sum in the next one."""
    if not os.path.exists(path):
        return 0, 0, 0.0
    try:
        snapshot = torch.load(path, "cpu", weights_only=True, mmap=True)  # runs no code in the file
        ran = snapshot.get("run", run)
        differs = [f"{k} {ran.get(k)}, not {v}" for k, v in run.items() if ran.get(k) != v]
        if differs:
            raise ValueError(f"it holds another run ({'; '.join(differs)}): give each its own path")
        model.load_state_dict(snapshot["model"])
        for group in snapshot["optimizer"]["param_groups"]:  # fused on GPUs, whatever the file says
            group["fused"] = optimizer.defaults["fused"]
        optimizer.load_state_dict(snapshot["optimizer"])
    except Exception as e:
        raise ValueError(f"cannot resume from {path}: {' '.join(str(e).split())[:200]}") from None
    return snapshot["epoch"], snapshot["samples"], snapshot["loss_sum"]


def save_snapshot(path: str, snapshot: dict) -> bool:
    """Writes beside the last snapshot and renames over it: a crash or full disk leaves it whole."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(f"{path}.tmp", "wb") as f:
            torch.save(snapshot, f)
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)
        return True
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        print(f"error: cannot save {path}: {e}; the last one, if any, is kept", file=sys.stderr)
        return False


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        train_data: DataLoader,
        val_data: DataLoader,
        device: torch.device,
        args: argparse.Namespace,
        run: dict,
    ) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), args.lr, fused=device.type == "cuda")
        self.train_data = train_data
        self.val_data = val_data
        self.device = device
        self.args = args
        self.run = run
        self.global_rank = 0
        self.saved_at = time.monotonic()
        self.unsaved_steps = 0
        # The GPU copies here whether the loss is still finite; a read a step later never waits.
        self.finite = torch.tensor(True, pin_memory=device.type == "cuda")
        self.resume = load_snapshot(args.snapshot_path, model, self.optimizer, run)
        self.autocast = torch.autocast(device.type, torch.bfloat16, args.precision == "bf16")
        # CUDA graphs ("reduce-overhead") would overwrite the gradients that micro-batches add up.
        mode = "reduce-overhead" if args.grad_accum == 1 else None
        self.train_model = torch.compile(model, mode=mode) if args.compile else model

    def _save_snapshot(self, epoch: int, samples: int = 0, loss_sum: float = 0.0) -> bool:
        saved = True
        if self.global_rank == 0:
            snapshot = dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
            snapshot.update(epoch=epoch, samples=samples, loss_sum=loss_sum, run=self.run)
            # Nothing NaN is written: not the loss, nor a weight or moment of the last update.
            moments = [m for s in snapshot["optimizer"]["state"].values() for m in s.values()]
            tensors = [torch.tensor(loss_sum), *snapshot["model"].values(), *moments]
            finite = all(t.isfinite().all() for t in tensors)
            if not finite:
                when = f"{self.unsaved_steps} steps after the last snapshot, which is kept"
                if not os.path.exists(self.args.snapshot_path):
                    when = f"{self.unsaved_steps} steps into the run, before any snapshot"
                where = f"in epoch {epoch + 1 if samples else epoch}, {when}"  # the epoch that ran
                print(f"error: the run diverged: NaN or infinite values {where}", file=sys.stderr)
            saved = finite and save_snapshot(self.args.snapshot_path, snapshot)
        self.saved_at = time.monotonic()
        self.unsaved_steps = 0
        return saved

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        source = source.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with self.autocast:
            loss_sum = F.cross_entropy(self.train_model(source), targets, reduction="sum")
        # Dividing by this process's batch (the ranks' gradients are averaged) weighs every sample
        # alike, however micro-batches and ranks split it. A short last batch takes a smaller step.
        (loss_sum / (self.args.batch_size * self.args.grad_accum)).backward()
        return loss_sum.detach()

    def _run_epoch(self, epoch: int, samples: int) -> tuple[torch.Tensor, int, int]:
        """Trains the epoch from its `samples`-th sample on. Returns this rank's loss sum and
        samples, and why it ended: 0 at its end, the signal at a stop, None for a save or a NaN."""
        sampler = self.train_data.sampler
        sampler.set_epoch(epoch)
        first = math.ceil(samples / self.args.batch_size)
        sampler.start = first * self.args.batch_size  # a resume starts after the last step trained
        steps = len(self.train_data)
        updates = math.ceil(steps / self.args.grad_accum)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        trained = 0
        report = time.monotonic() + 30
        self.model.train()
        for step, (source, targets) in enumerate(self.train_data, first):
            # Dropout draws from the seed, rank, epoch and step: a resumed run draws the same masks.
            torch.manual_seed(hash((self.args.seed, self.global_rank, epoch, step)))
            update = (step + 1) % self.args.grad_accum == 0 or step + 1 == steps
            loss_sum += self._run_batch(source, targets)
            trained += len(targets)
            if not update:
                continue
            run_step = epoch * updates + step // self.args.grad_accum  # its number in the whole run
            for group in self.optimizer.param_groups:
                group["lr"] = get_lr(run_step, self.args.total_epochs * updates, self.args.lr)
            if self.args.grad_clip:  # it clips by the norm of the step's whole gradient, all ranks'
                nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.unsaved_steps += 1
            stopped = max(stop_signals, default=0)
            due = time.monotonic() > self.saved_at + 60 * (self.args.save_minutes or math.inf)
            diverged = not self.finite
            self.finite.copy_(loss_sum.isfinite(), non_blocking=True)
            if stopped or due or diverged:
                return loss_sum, trained, stopped or None
            if self.global_rank == 0 and time.monotonic() > report:
                print(f"  epoch {epoch + 1}: step {step + 1} of {steps}", flush=True)
                report = time.monotonic() + 30
        return loss_sum, trained, 0

    def train(self) -> int:
        """Returns the exit code: 0 at the end, 128 + the signal after a stop and its save, 1 if a
        save failed or the run diverged."""
        epoch, samples, loss_sum = self.resume
        if self.global_rank == 0 and (epoch or samples):
            left = max(0, self.args.total_epochs - epoch)
            where = f" and {samples} samples of epoch {epoch + 1}" if samples else ""
            print(f"{self.args.snapshot_path}: resumed after epoch {epoch}{where}, {left} to go")
        while epoch < self.args.total_epochs:
            began = time.perf_counter()
            val_batches = iter(self.val_data)  # the loader's workers load while the epoch trains
            loss, trained, stopped = self._run_epoch(epoch, samples)
            with self.autocast:
                correct = evaluate(self.model, val_batches, self.device) if stopped == 0 else 0
            evaluated = len(self.val_data.dataset)
            loss_sum += float(loss)
            samples += trained
            if stopped != 0:  # a stop signal or a save (None) ended the epoch early
                if not self._save_snapshot(epoch, int(samples), loss_sum):
                    return 1
                if stopped is None:  # after a periodic save the epoch goes on
                    continue
                if self.global_rank == 0:
                    where = f"in epoch {epoch + 1} after {int(samples)} samples"
                    print(f"{signal.Signals(stopped).name}: stopped {where}; run again to resume")
                return 128 + stopped
            if self.global_rank == 0:
                speed = trained / (time.perf_counter() - began)
                means = f"loss {loss_sum / samples:.4f} | acc {float(correct) / evaluated:.4f}"
                rest = f"lr {self.optimizer.param_groups[0]['lr']:.2e} | batch {self.run['batch']}"
                print(f"Epoch {epoch + 1} | {means} | {rest} | {speed:.0f} samples/s", flush=True)
            due = (epoch + 1) % self.args.save_every == 0 or epoch + 1 == self.args.total_epochs
            if due and not self._save_snapshot(epoch + 1):
                return 1
            epoch, samples, loss_sum = epoch + 1, 0, 0.0
        return 0


@torch.no_grad()
def evaluate(model: nn.Module, val_batches: Iterator, device: torch.device) -> torch.Tensor:
    model.eval()
    correct = torch.tensor(0, device=device)
    for source, targets in val_batches:
        outputs = model(source.to(device, non_blocking=True))
        correct += (outputs.argmax(1) == targets.to(device, non_blocking=True)).sum()
    return correct


def prepare_dataloaders(
    train_set: Dataset, val_set: Dataset, args: argparse.Namespace, gpu: bool
) -> tuple[DataLoader, DataLoader]:
    """The training and held-out loaders: loader processes load batches while the GPU computes."""
    default = min(8, torch.get_num_threads()) if gpu else 0
    workers = default if args.workers is None else args.workers
    load = dict(num_workers=workers, pin_memory=gpu, persistent_workers=workers > 0)
    load.update(worker_init_fn=start_loader_worker)
    sampler = EpochSampler(train_set, seed=args.seed)
    train_set = SeededSamples(train_set, args.seed)
    # BatchNorm cannot train on a batch of one: a last batch of one is dropped if there are others.
    one_left = len(sampler) % args.batch_size == 1 and len(sampler) > 1
    train_data = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=one_left, **load)
    return train_data, DataLoader(val_set, 2 * args.batch_size, **load)


def main(args: argparse.Namespace) -> int:
    for signum in STOP_SIGNALS:
        signal.signal(signum, note_stop_signal)
    torch.manual_seed(args.seed)
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS needs this to be deterministic
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not args.deterministic
    try:
        train_set, val_set, classes = load_datasets(args.data_dir, args.image_size, args.augment)
        model = build_model(args.arch, classes, args.image_size)
        if args.batch_size == 1 and any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
            raise ValueError(f"--arch {args.arch} has BatchNorm: use --batch_size 2 or more")
        device = setup()
        model.to(device)
        # The settings that decide the result: a snapshot from a run with other settings is refused.
        run = {name: getattr(args, name) for name in ("arch", "lr", "seed", "augment", "precision")}
        run.update(data=[classes, len(train_set), len(val_set), args.image_size])
        run["batch"] = args.batch_size * args.grad_accum
        train_data, val_data = prepare_dataloaders(train_set, val_set, args, device.type == "cuda")
        trainer = Trainer(model, train_data, val_data, device, args, run)
    except ValueError as e:  # bad input ends the job with one error line
        sys.exit(f"error: {e}")
    try:
        return trainer.train()
    except Exception:  # an error of the program's own: exit code 1, once the loader workers end
        traceback.print_exc()
        return 1


def natural(text: str, least: int = 0) -> int:
    if not text.isdigit() or not least <= int(text) < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [{least}, 2**32), got {text!r}")
    return int(text)


def positive(text: str) -> int:
    return natural(text, least=1)


if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter  # prints the docstring's lines as written
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("epochs", type=positive, nargs="?", help="the same as --total_epochs")
    parser.add_argument("every", type=positive, nargs="?", help="the same as --save_every")
    snapshot = os.path.basename(__file__).replace(".py", ".pt")  # single_gpu.pt, say
    flags = [
        ("--total_epochs", positive, 5, "epochs to train"),
        ("--save_every", positive, 5, "save every this many epochs and after the last"),
        ("--batch_size", positive, 32, "samples per micro-batch and process"),
        ("--grad_accum", positive, 1, "micro-batches that an optimizer step adds up"),
        ("--lr", float, 3e-3, "AdamW's peak learning rate"),
        ("--seed", natural, 0, "seeds the weights, the order of samples and dropout"),
        ("--snapshot_path", str, snapshot, "the file the run resumes from and saves to"),
        ("--image_size", positive, 32, "the side of the images in pixels"),
        ("--arch", str, "convnet", "convnet, or a torchvision classifier such as resnet18"),
        ("--save_minutes", float, 30.0, "also save inside an epoch this often, 0 for never"),
        ("--grad_clip", float, 0.0, "clip each step's gradient to this global norm, 0 for never"),
    ]
    for flag, kind, default, text in flags:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    augment = ["none", "crop", "flip", "crop+flip"]
    text = "random crops and flips of your training images (default: %(default)s)"
    parser.add_argument("--augment", default="none", choices=augment, help=text)
    text = "bf16 trains in bfloat16, with float32 weights (default: %(default)s)"
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help=text)
    text = "images in DIR/train/CLASS/ and DIR/val/CLASS/ (default: built-in images)"
    parser.add_argument("--data_dir", help=text)
    text = "loader processes per process (default: 8 on GPUs, at most its threads; 0 on a CPU)"
    parser.add_argument("--workers", type=natural, help=text)
    text = "deterministic GPU kernels, for resumes bit for bit on GPUs"
    parser.add_argument("--deterministic", action="store_true", help=text)
    parser.add_argument("--compile", action="store_true", help="compile the model (slower start)")
    args = parser.parse_args()
    for name in ("lr", "save_minutes", "grad_clip"):
        if not 0 <= getattr(args, name) < math.inf:
            parser.error(f"argument --{name}: expected a number >= 0, got {getattr(args, name)}")
    args.total_epochs = args.epochs or args.total_epochs
    args.save_every = args.every or args.save_every
    sys.exit(main(args))
