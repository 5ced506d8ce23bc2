"""Each stage's training throughput on one GPU, beside its peers' on the same work, against the two
bounds none can beat.

    python benchmarks/gpu_throughput.py            # ResNet-18, batch 256, bf16: about 5 minutes
    python benchmarks/gpu_throughput.py --full     # batch 32 and 256, fp32 and bf16, every runner
    python benchmarks/gpu_throughput.py --compile  # the stages alone, every run compiled
    python benchmarks/gpu_throughput.py --device cpu --images 256 --batches 16 --seconds 1

It measures, in this order:
  loader     for each batch size, a loader like the stages' alone (same folder and transforms, up to
             8 workers, pinned memory; its workers last from epoch to epoch)
  bare step  for each batch size and precision, ResNet-18's training step on tensors already on the
             GPU, with the stages' optimizer, precision and (with --compile) compiler: no data
Then, in the folder it wrote, it repeats the training images (links) until the fastest row's bound,
min(loader, bare step), needs --seconds for an epoch. Last, for each batch size and precision, the
runners that --runners names take turns:
  peers      the plain loop of the tutorials, Lightning's Trainer, Fabric and Accelerate
             (benchmarks/peers.py; the last three when they are installed)
  stages     each script as a user launches it on one GPU (world size 1)
Runners: samples/s of training over wall time, evaluation of the held-out images included, the
median of epochs 2 and later (the first one pays for start-up); an epoch lasts --seconds (3) or
more. The runners take turns, in one order and then the reverse, --rounds times (2); each cell is
the median of its rounds, its spread (max - min, in % of the median) and its share of min(loader,
bare step). A line of a runner's output with a warning in it is printed as that run ends.
The default fits one 10-minute session on one GPU; --full is the whole table (about an hour).
Goal: every stage at least the plain loop and Lightning, and 0.85 of the bound at batch 256.
"""

import argparse
import importlib.util
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STAGES = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode", "fsdp"]
PEERS = ["plain", "lightning", "fabric", "accelerate"]
FEW = ["plain", "lightning", "single_gpu", "multinode", "fsdp"]  # the default: one device session
RATE = re.compile(r"^Epoch (\d+) \| .*?(\d+) samples/s$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_gpu():
    """single_gpu.py as a module: its setup(), load_datasets() and build_model()."""
    spec = importlib.util.spec_from_file_location("single_gpu", REPO / "single_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_folder(root: Path, images: int, val: int, classes: int = 10) -> None:
    """32x32 RGB PNGs, DIR/{train,val}/CLASS/: a colour per class under noise."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    colours = torch.rand(classes, 3, generator=generator) * 200
    for split, count in (("train", images), ("val", val)):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            noise = 55 * torch.rand(32, 32, 3, generator=generator)
            pixels = (colours[i % classes] + noise).clamp(0, 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / split / f"class{i % classes}" / f"{i}.png")


def repeat_images(root: Path, times: int) -> None:
    """Each training image `times` times over, as links: longer epochs, no more PNGs to write."""
    for image in list((root / "train").glob("*/*.png")):
        for copy in range(1, times):
            image.with_name(f"{image.stem}_{copy}.png").symlink_to(image.name)


def loader_rate(single, data_dir: Path, batch: int, device: torch.device, epochs: int) -> float:
    """Samples/s of the stages' training loader alone, batches copied to the device."""
    train_set, _, _ = single.load_datasets(str(data_dir), 32, "none")
    loading = {}
    if device.type == "cuda":  # as the stages do on GPUs: min(8, cores of the process)
        workers = min(8, os.cpu_count())
        loading = dict(num_workers=workers, pin_memory=True, persistent_workers=True)
    loader = torch.utils.data.DataLoader(train_set, batch, shuffle=True, **loading)
    rates = []
    for _ in range(epochs):
        start = time.perf_counter()
        for source, targets in loader:
            source.to(device, non_blocking=True)
            targets.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(len(train_set) / (time.perf_counter() - start))
    return statistics.median(rates[1:] or rates)  # the first epoch starts the workers


def bare_rate(single, opts: argparse.Namespace, batch: int, precision: str, device) -> float:
    """Samples/s of the training step alone: what the stages do per batch, minus the data."""
    torch.manual_seed(0)
    model = single.build_model("resnet18", 10, 32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    step_model = torch.compile(model, mode="reduce-overhead") if opts.compile else model
    source = torch.randn(batch, 3, 32, 32, device=device)
    targets = torch.randint(10, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(step_model(source), targets, reduction="sum")
        (loss / batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(opts.warmup):  # compiles, records CUDA graphs, picks cuDNN kernels
        step()
    rates = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(opts.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(opts.steps * batch / (time.perf_counter() - start))
    return statistics.median(rates)


def runner_rate(stage: str, opts, data_dir: Path, batch: int, precision: str, env: dict) -> float:
    """Median samples/s over epochs 2.. of one run of a stage, launched as a user does, or of a
    peer (benchmarks/peers.py)."""
    args = [str(opts.epochs), str(opts.epochs), "--data_dir", str(data_dir), "--arch", "resnet18"]
    args += ["--batch_size", str(batch), "--precision", precision]
    args += ["--compile"] if opts.compile else []
    workers = opts.workers if opts.workers is not None else min(8, os.cpu_count()) * gpu(opts)
    args += ["--workers", str(workers)]
    if stage in PEERS:
        peer = [str(REPO / "benchmarks" / "peers.py"), stage, str(data_dir)]
        args = [*peer, "--epochs", str(opts.epochs), *args[4:10], *args[-2:]]
    script = str(REPO / f"{stage}.py")
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    commands = {
        "single_gpu": [sys.executable, script],
        "multigpu": [sys.executable, script, "--world_size", "1"],
        "multigpu_torchrun": [TORCHRUN, "--standalone", "--nproc_per_node=1", script],
        "multinode": [TORCHRUN, "--nnodes=1", "--nproc_per_node=1", *rendezvous, script],
        "fsdp": [TORCHRUN, "--nnodes=1", "--nproc_per_node=1", *rendezvous, script],
    }
    command = commands.get(stage, [sys.executable])
    with tempfile.TemporaryDirectory() as cwd:
        run = subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True)
    output = run.stdout + run.stderr
    rates = [int(rate) for epoch, rate in RATE.findall(output)]
    rates = rates[1:] or rates  # the first epoch pays for start-up, unless it is the only one
    if run.returncode or not rates:
        sys.exit(f"error: {stage} failed:\n{output}")
    warnings = [line for line in output.splitlines() if "Warning" in line or "warn" in line]
    for line in warnings:  # the stages should print none
        print(f"  {stage} printed: {line.strip()}", flush=True)
    return statistics.median(rates)


def gpu(opts: argparse.Namespace) -> bool:
    return opts.device == "cuda"


def available(runner: str, opts: argparse.Namespace) -> bool:
    """Lightning, Fabric and Accelerate when installed; with --compile, the stages alone (the
    peers run as the tutorials write them)."""
    if runner in PEERS and opts.compile:
        return False
    package = {"lightning": "lightning", "fabric": "lightning", "accelerate": "accelerate"}
    return runner not in package or importlib.util.find_spec(package[runner]) is not None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--images", type=int, default=10_000, help="training PNGs (10,000)")
    parser.add_argument("--val", type=int, default=500, help="held-out PNGs (500)")
    parser.add_argument("--data_dir", help="use this folder instead of generating one")
    parser.add_argument("--batches", default="256", help="batch sizes (256)")
    parser.add_argument("--precisions", default="bf16", help="(bf16)")
    parser.add_argument("--compile", action="store_true", help="--compile in every run")
    parser.add_argument("--epochs", type=int, default=3, help="per run; the 1st is left out (3)")
    parser.add_argument("--seconds", type=float, default=3, help="an epoch at least (3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each runner (2)")
    parser.add_argument("--steps", type=int, default=50, help="bare steps per timing (50)")
    parser.add_argument("--warmup", type=int, default=10, help="bare steps before timing (10)")
    parser.add_argument("--workers", type=int, help="loader processes (GPU: 8, CPU: 0)")
    parser.add_argument("--runners", default=",".join(FEW), help="comma-separated")
    parser.add_argument("--full", action="store_true", help="the whole table, as measured before")
    opts = parser.parse_args()
    if opts.full:  # the whole table: flags given after --full still apply
        whole = ["--batches", "32,256", "--precisions", "fp32,bf16", "--epochs", "4"]
        whole += ["--seconds", "5", "--rounds", "3", "--runners", ",".join(PEERS + STAGES)]
        opts = parser.parse_args(whole + sys.argv[1:])
    if opts.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no GPU is visible (--device cpu runs it small, to try it)")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    single = single_gpu()
    device = single.setup()  # the stages' device and TF32 settings
    torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    folder = tempfile.TemporaryDirectory()
    data_dir = Path(opts.data_dir or folder.name)
    if not opts.data_dir:
        make_folder(data_dir, opts.images, opts.val)
    compiled = "on" if opts.compile else "off"
    print(f"{time.strftime('%Y-%m-%d')}; {name}; torch {torch.__version__}; ResNet-18", flush=True)
    print(f"{opts.images} training PNGs of 32x32; --compile {compiled}", flush=True)
    stages = [runner for runner in opts.runners.split(",") if available(runner, opts)]
    bounds = {}  # (batch, precision): (loader, bare step)
    for batch in map(int, opts.batches.split(",")):
        loader = loader_rate(single, data_dir, batch, device, opts.epochs)
        for precision in opts.precisions.split(","):
            bounds[batch, precision] = loader, bare_rate(single, opts, batch, precision, device)
            torch.compiler.reset()  # nothing of the bare runs on the GPU while the stages run:
            if device.type == "cuda":  # neither compiled graphs nor cached memory
                torch.cuda.empty_cache()
    fastest = max(min(rates) for rates in bounds.values())
    times = math.ceil(opts.seconds * fastest / opts.images)
    if not opts.data_dir:
        repeat_images(data_dir, times)
    print(f"each image {times} times an epoch: {opts.seconds:g} s or more at {fastest:.0f}/s")
    header = f"{'batch':>5} {'precision':>9} {'loader':>8} {'bare':>8}"
    print(header + "".join(f" {s[:22]:>22}" for s in stages) + "  (samples/s, spread, share)")
    worst = 1.0
    for (batch, precision), (loader, bare) in bounds.items():
        bound = min(loader, bare)
        rates = {stage: [] for stage in stages}
        for turn in range(opts.rounds):  # in turns, each order as often: drifts cancel out
            for stage in stages if turn % 2 == 0 else stages[::-1]:
                rates[stage].append(runner_rate(stage, opts, data_dir, batch, precision, env))
        cells = []
        for stage in stages:
            rate = statistics.median(rates[stage])
            spread = (max(rates[stage]) - min(rates[stage])) / rate
            if stage in STAGES:
                worst = min(worst, rate / bound)
            cells.append(f" {rate:>9.0f} {spread:>4.0%} ({rate / bound:.2f})")
        print(f"{batch:>5} {precision:>9} {loader:>8.0f} {bare:>8.0f}" + "".join(cells), flush=True)
    print(f"lowest share of min(loader, bare step) of a stage: {worst:.2f} (goal: 0.85)")
    folder.cleanup()


if __name__ == "__main__":
    main()
