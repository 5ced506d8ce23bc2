"""Stage 4 of 4, multinode.py: one torchrun per node; LOCAL_RANK picks the device, RANK the role in the job.
On every node (HOST: the first one; --snapshot_path on storage that every node shares; on CPUs: --nproc_per_node=2):
torchrun --nnodes=2 --nproc_per_node=gpu --rdzv-id=JOB --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 multinode.py 50 10
Restarts: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=3 ...; each restart resumes from the snapshot.
Every stage is a complete trainer (data, model, train loop, held-out eval, logging, snapshot/resume) and adds only
distribution to the one before: single_gpu.py, multigpu.py, multigpu_torchrun.py, multinode.py (diff two neighbours).
Arguments: total_epochs save_every [flags, see --help]. Uses the GPU(s) if present, else the CPU; CUDA_VISIBLE_DEVICES=
in front of the command forces the CPU. Started again with the same --snapshot_path, a run resumes where it stopped."""
import argparse
import os
import pickle
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def setup(local_rank: int, global_rank: int, world_size: int, local_world_size: int) -> torch.device:
    """The one place that picks the hardware: CUDA when present, else the CPU."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))  # local processes share the cores
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # where pinned memory and the backend's buffers go
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=global_rank, world_size=world_size,
                            timeout=timedelta(minutes=5))  # NCCL between GPUs, gloo between CPUs
    return device


def load_datasets(data_dir: str | None, image_size: int) -> tuple[Dataset, Dataset, int]:
    """(train, val, classes): by default 640 + 80 noisy 3x32x32 images of 10 classes, else DIR/{train,val}/CLASS/*"""
    if data_dir is None:  # a fixed seed: every process and every run builds the same data
        g = torch.Generator().manual_seed(1234)
        labels = torch.randint(10, (640 + 80,), generator=g)
        prototypes = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=32, mode="bilinear")  # one per class
        data = TensorDataset(prototypes[labels] + 1.5 * torch.randn(len(labels), 3, 32, 32, generator=g), labels)
        return Subset(data, range(640)), Subset(data, range(640, len(data))), 10
    from torchvision import datasets, transforms as T  # imported only when used: it adds ~2 s to each process's start
    tensor = [T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]
    try:
        train = datasets.ImageFolder(os.path.join(data_dir, "train"), T.Compose(
            [T.RandomResizedCrop(image_size, scale=(0.6, 1.0)), T.RandomHorizontalFlip()] + tensor))
        val = datasets.ImageFolder(os.path.join(data_dir, "val"), T.Compose(
            [T.Resize(image_size), T.CenterCrop(image_size)] + tensor))
    except OSError as e:  # no such folder, no class folders, no images
        sys.exit(f"error: --data_dir {data_dir}: {e} (expected images in DIR/train/CLASS/ and DIR/val/CLASS/)")
    if train.classes != val.classes:
        sys.exit(f"error: --data_dir {data_dir}: train/ and val/ must hold the same class folders")
    return train, val, len(train.classes)


def build_model(arch: str, num_classes: int) -> nn.Module:
    """The default is a small CNN, smooth (GELU, average pooling), without BatchNorm or dropout: see README."""
    if arch == "convnet":
        return nn.Sequential(  # 2x2 patches (32x32 -> 16x16), 3x3 convolutions at 16x16 and 8x8, global average, linear
            nn.Conv2d(3, 32, 2, stride=2), nn.GELU(), nn.Conv2d(32, 64, 3, padding=1), nn.GELU(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(128, num_classes))
    from torchvision import models  # imported only when used: it adds ~2 s to each process's start
    if arch not in models.list_models(module=models):
        sys.exit(f"error: unknown --arch {arch}: use convnet or a torchvision classification model such as resnet18")
    return models.get_model(arch, num_classes=num_classes)


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_data: DataLoader,
                 val_data: DataLoader, device: torch.device, args: argparse.Namespace) -> None:
        self.model, self.optimizer, self.train_data, self.val_data = model, optimizer, train_data, val_data
        self.device, self.args, self.snapshot_path = device, args, args.snapshot_path
        self.global_rank = dist.get_rank()  # unique across all processes and nodes: rank 0 logs and writes snapshots
        self.epochs_run = self._load_snapshot()
        ends = torch.tensor([self.epochs_run, -self.epochs_run], device=device)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)  # the latest and (minus) the earliest epoch any rank resumes from
        if ends[0] != -ends[1]:  # every rank stops, so none trains from another starting point
            sys.exit(f"error: ranks resume from different snapshots: put {self.snapshot_path} where every rank sees it")
        self.ddp_model = nn.parallel.DistributedDataParallel(model)  # averages gradients across ranks in backward()

    def _load_snapshot(self) -> int:
        if not os.path.exists(self.snapshot_path):
            return 0  # no snapshot yet: start at epoch 0
        try:  # weights_only=True: tensors and plain data only, never code from the file
            snapshot = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)
            self.model.load_state_dict(snapshot["model"])
            self.optimizer.load_state_dict(snapshot["optimizer"])
            return int(snapshot["epoch"])
        except Exception as e:  # garbage, truncated, another model, pickled objects: say which, keep the file as it is
            reason = "not a snapshot of tensors and plain data" if isinstance(e, pickle.UnpicklingError) else str(e)
        sys.exit(f"error: cannot resume from {self.snapshot_path}: {' '.join(reason.split())[:300]}; move it away")

    def _save_snapshot(self, epochs_run: int) -> None:
        snapshot = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "epoch": epochs_run}
        with open(f"{self.snapshot_path}.tmp", "wb") as f:  # same folder, so the rename below is atomic
            torch.save(snapshot, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{self.snapshot_path}.tmp", self.snapshot_path)  # a crash before this keeps the last snapshot

    def _run_epoch(self, epoch: int) -> torch.Tensor:
        """Train one epoch, then evaluate: returns [train loss sum, train samples, val correct, val samples]."""
        torch.manual_seed(self.args.seed + 1000 * epoch + self.global_rank)  # depends on nothing else: resume is exact
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle every epoch
        stats = torch.tensor([0.0, len(self.train_data.sampler), 0.0, len(self.val_data.dataset)], device=self.device)
        self.model.train()
        for source, targets in self.train_data:
            source, targets = source.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.ddp_model(source), targets)
            loss.backward()
            self.optimizer.step()
            stats[0] += loss.detach() * len(targets)  # no .item(): no host sync per step
        self.model.eval()
        with torch.no_grad():
            for source, targets in self.val_data:
                source, targets = source.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
                stats[2] += (self.model(source).argmax(1) == targets).sum()
        return stats

    def train(self, total_epochs: int) -> None:
        for epoch in range(self.epochs_run, total_epochs):
            start = time.perf_counter()
            stats = self._run_epoch(epoch)
            dist.all_reduce(stats)  # sums over all ranks: rank 0 prints global figures
            loss_sum, samples, correct, evaluated = stats.tolist()  # the epoch's one host sync
            if self.global_rank == 0:
                print(f"Epoch {epoch + 1} | loss {loss_sum / samples:.4f} | acc {correct / evaluated:.4f} | "
                      f"{samples / (time.perf_counter() - start):.0f} samples/s", flush=True)
            if self.global_rank == 0 and ((epoch + 1) % self.args.save_every == 0 or epoch + 1 == total_epochs):
                self._save_snapshot(epoch + 1)


def main(local_rank: int, args: argparse.Namespace) -> None:
    world_size = int(os.environ["WORLD_SIZE"])  # torchrun sets it, and LOCAL_RANK, RANK, MASTER_ADDR, MASTER_PORT
    device = setup(local_rank, int(os.environ["RANK"]), world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
    train_set, val_set, num_classes = load_datasets(args.data_dir, args.image_size)
    torch.manual_seed(args.seed)  # the same initial weights in every stage
    model = build_model(args.arch, num_classes).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if device.type == "cuda" else model  # stats over all ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(train_set, seed=args.seed)  # each rank takes its own share of every global batch
    val_set = Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))  # no sample counted twice
    workers = dict(num_workers=4, pin_memory=True, persistent_workers=True) if device.type == "cuda" else {}
    train_data = DataLoader(train_set, args.batch_size, sampler=sampler, **workers)
    val_data = DataLoader(val_set, 2 * args.batch_size, **workers)
    Trainer(model, optimizer, train_data, val_data, device, args).train(args.total_epochs)
    dist.barrier()  # wait for rank 0's last save; no collective is left in flight when the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    def positive_int(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
        return int(text)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, no usage dump
    parser.add_argument("total_epochs", type=positive_int, nargs="?", default=argparse.SUPPRESS, help="--total_epochs")
    parser.add_argument("save_every", type=positive_int, nargs="?", default=argparse.SUPPRESS, help="--save_every")
    parser.add_argument("--total_epochs", type=positive_int, default=5, help="epochs to train in all (default 5)")
    parser.add_argument("--save_every", type=positive_int, default=5, help="snapshot every N epochs and at the end (5)")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="samples per step in each process (32)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (2e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, shuffling and augmentation (0)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="resume from and save to (snapshot.pt)")
    parser.add_argument("--data_dir", help="ImageFolder tree with train/ and val/ (default: built-in synthetic data)")
    parser.add_argument("--image_size", type=positive_int, default=32, help="side of the images fed to the model (32)")
    parser.add_argument("--arch", default="convnet", help="convnet, or a torchvision model: resnet18...")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(f"error: start {os.path.basename(__file__)} with torchrun, as the first lines of the file show")
    main(int(os.environ["LOCAL_RANK"]), args)
