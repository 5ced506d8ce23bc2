"""The stages' peers, doing the stages' work: the plain loop as the tutorials write it, Lightning's
Trainer, Fabric and Accelerate. Each prints one line per epoch, as the stages do:

    python benchmarks/peers.py plain DIR --epochs 3 --batch_size 256 --precision bf16

The work: a torchvision classifier (ResNet-18, 10 classes) trained with AdamW on DIR/train (an
ImageFolder: Resize, CenterCrop, ToTensor, Normalize), every held-out image of DIR/val evaluated
after each epoch; loader workers with pinned memory on GPUs. samples/s: training samples over the
epoch's wall time, evaluation included. Lightning, Fabric and Accelerate are not requirements of
this project: their runners need them installed.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, models
from torchvision import transforms as T


def datasets_of(opts: argparse.Namespace) -> tuple:
    size = 32
    transform = T.Compose(
        [T.Resize(size), T.CenterCrop(size), T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)]
    )
    train = datasets.ImageFolder(f"{opts.data_dir}/train", transform)
    return train, datasets.ImageFolder(f"{opts.data_dir}/val", transform)


def loaders(opts: argparse.Namespace, gpu: bool) -> tuple[DataLoader, DataLoader]:
    train, val = datasets_of(opts)
    loading = dict(num_workers=opts.workers, pin_memory=gpu, persistent_workers=opts.workers > 0)
    return (
        DataLoader(train, opts.batch_size, shuffle=True, **loading),
        DataLoader(val, 2 * opts.batch_size, **loading),
    )


def report(epoch: int, samples: int, began: float, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = samples / (time.perf_counter() - began)
    print(f"Epoch {epoch + 1} | {rate:.0f} samples/s", flush=True)


def plain(opts: argparse.Namespace, device: torch.device) -> None:
    """The loop of pytorch/examples: to(device), forward, backward, step."""
    train_data, val_data = loaders(opts, device.type == "cuda")
    model = models.get_model(opts.arch, num_classes=10).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16 = opts.precision == "bf16"
    for epoch in range(opts.epochs):
        began = time.perf_counter()
        model.train()
        for source, targets in train_data:
            source, targets = source.to(device), targets.to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(source), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for source, targets in val_data:
                with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                    model(source.to(device)).argmax(1).eq(targets.to(device)).sum()
        report(epoch, len(train_data.dataset), began, device)


def lightning(opts: argparse.Namespace, device: torch.device) -> None:
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = models.get_model(opts.arch, num_classes=10)

        def training_step(self, batch, index):
            return F.cross_entropy(self.model(batch[0]), batch[1])

        def validation_step(self, batch, index):
            return self.model(batch[0]).argmax(1).eq(batch[1]).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(L.Callback):
        def on_train_epoch_start(self, trainer, module) -> None:
            self.began = time.perf_counter()

        def on_train_epoch_end(self, trainer, module) -> None:  # after validation
            report(trainer.current_epoch, len(train_data.dataset), self.began, device)

    train_data, val_data = loaders(opts, device.type == "cuda")
    precision = "bf16-mixed" if opts.precision == "bf16" else "32-true"
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision=precision, max_epochs=opts.epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Timer()],
    )  # fmt: skip
    trainer.fit(Classifier(), train_data, val_data)


def framework_loop(opts, model, optimizer, loaders: tuple, backward, device, samples: int) -> None:
    """The plain loop's steps, with a framework's backward; it placed the model and the batches."""
    train_data, val_data = loaders
    for epoch in range(opts.epochs):
        began = time.perf_counter()
        model.train()
        for source, targets in train_data:
            loss = F.cross_entropy(model(source), targets)
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for source, targets in val_data:
                model(source).argmax(1).eq(targets).sum()
        report(epoch, samples, began, device)


def fabric(opts: argparse.Namespace, device: torch.device) -> None:
    from lightning.fabric import Fabric

    precision = "bf16-mixed" if opts.precision == "bf16" else "32-true"
    fabric = Fabric(accelerator=device.type, devices=1, precision=precision)
    fabric.launch()
    model = models.get_model(opts.arch, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    data = fabric.setup_dataloaders(*loaders(opts, device.type == "cuda"))
    samples = len(datasets_of(opts)[0])
    framework_loop(opts, model, optimizer, data, fabric.backward, device, samples)


def accelerate(opts: argparse.Namespace, device: torch.device) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16" if opts.precision == "bf16" else "no")
    model = models.get_model(opts.arch, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, *data = accelerator.prepare(
        model, optimizer, *loaders(opts, device.type == "cuda")
    )
    samples = len(datasets_of(opts)[0])
    framework_loop(opts, model, optimizer, data, accelerator.backward, device, samples)


RUNNERS = {"plain": plain, "lightning": lightning, "fabric": fabric, "accelerate": accelerate}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runner", choices=RUNNERS)
    parser.add_argument("data_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--workers", type=int, default=8)
    opts = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    RUNNERS[opts.runner](opts, device)
