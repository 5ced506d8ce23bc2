"""What distribution costs on the CPU: each stage trains the same samples at the same global
batch, and their steady-state speeds are compared.

    python benchmarks/stage_overhead.py                   # 2 processes per distributed stage

Each stage runs as a user launches it. Start-up is left out: the figures are the median over
epochs 2..N of the per-epoch rates the stage logs (training and held-out evaluation, all-reduces
included). The bare loop is single_gpu.py's model, optimizer and batches on pre-built tensors: no
data loader, no evaluation, no logging. multinode.py runs as two torchrun agents on this one
machine, so both "nodes" share its cores. On GPUs, use gpu_throughput.py.
"""

import argparse
import importlib.util
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
RATE = re.compile(r"^Epoch (\d+) \| .* \| (\d+) samples/s$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(stage: str, world: int, args: list) -> list:
    script = str(REPO / f"{stage}.py")
    if stage == "single_gpu":
        return [[sys.executable, script, *args]]
    if stage == "multigpu":
        return [[sys.executable, script, *args, "--world_size", str(world)]]
    if stage == "multigpu_torchrun":
        return [[TORCHRUN, "--standalone", f"--nproc_per_node={world}", script, *args]]
    endpoint = f"127.0.0.1:{free_port()}"
    return [
        [
            TORCHRUN,
            "--nnodes=2",
            f"--nproc_per_node={max(1, world // 2)}",
            f"--node_rank={n}",
            "--rdzv-id=bench",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            script,
            *args,
        ]
        for n in (0, 1)
    ]


def run_stage(stage: str, world: int, opts: argparse.Namespace, env: dict) -> float:
    """Median steady-state samples/s of one run of a stage."""
    processes = 1 if stage == "single_gpu" else world
    args = [
        str(opts.epochs),
        str(opts.epochs),
        "--batch_size",
        str(opts.batch // processes),
        "--arch",
        opts.arch,
    ]
    with tempfile.TemporaryDirectory() as cwd:
        procs = [
            subprocess.Popen(
                c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for c in commands(stage, world, args)
        ]
        outputs = [p.communicate()[0] for p in procs]
    rates = [int(rate) for epoch, rate in RATE.findall("\n".join(outputs)) if int(epoch) > 1]
    codes = [p.returncode for p in procs]
    if any(codes) and len(rates) < opts.epochs - 1:
        sys.exit(f"error: {stage} failed:\n" + "\n".join(outputs))
    if any(codes):  # every epoch ran: the figures stand, the failure is reported
        print(
            f"warning: {stage} failed after its last epoch (exit codes {codes})",
            file=sys.stderr,
            flush=True,
        )
    return statistics.median(rates)


def single_gpu():
    """single_gpu.py as a module: its load_datasets() and build_model()."""
    spec = importlib.util.spec_from_file_location("single_gpu", REPO / "single_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_loop(single, opts: argparse.Namespace, device: torch.device) -> float:
    """single_gpu.py's training arithmetic alone: samples/s, median over epochs 2..N."""
    train_set, _, classes = single.load_datasets(None, 32, "none")
    images = torch.stack([train_set[i][0] for i in range(len(train_set))]).to(device)
    labels = torch.stack([train_set[i][1] for i in range(len(train_set))]).to(device)
    torch.manual_seed(0)
    model = single.build_model(opts.arch, classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rates = []
    for epoch in range(opts.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch)).to(
            device
        )
        start = time.perf_counter()
        for i in range(0, len(images), opts.batch):
            batch = order[i : i + opts.batch]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images[batch]), labels[batch]).backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if epoch > 0:
            rates.append(len(images) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cpu forces CUDA_VISIBLE_DEVICES="
    )
    parser.add_argument(
        "--world_size",
        type=int,
        help="processes per distributed stage (default: GPUs, or 2 on CPU)",
    )
    parser.add_argument(
        "--epochs", type=int, default=10, help="epochs per run; the first is left out (default 10)"
    )
    parser.add_argument(
        "--batch", type=int, default=64, help="global batch, split over the processes (default 64)"
    )
    parser.add_argument(
        "--arch", default="convnet", help="model, as the stages' --arch (default convnet)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of each stage; the table shows medians (default 5)",
    )
    parser.add_argument(
        "--stages",
        default="single_gpu,multigpu,multigpu_torchrun,multinode",
        help="comma-separated",
    )
    opts = parser.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        sys.exit("error: --device cuda, but no GPU is visible")
    world = opts.world_size or (torch.cuda.device_count() if opts.device == "cuda" else 2)
    stages, device = (
        opts.stages.split(","),
        torch.device("cuda" if opts.device == "cuda" else "cpu"),
    )
    single = single_gpu()
    samples = len(single.load_datasets(None, 32, "none")[0])  # training samples per epoch
    runs = {stage: [] for stage in stages + ["bare loop"]}
    for _ in range(
        opts.repeats
    ):  # round after round, so that a slow spell of the machine hits every stage alike
        for stage in stages:
            runs[stage].append(run_stage(stage, world, opts, env))
        runs["bare loop"].append(bare_loop(single, opts, device))
    rates = {stage: statistics.median(values) for stage, values in runs.items()}
    bare = rates.pop("bare loop")
    name = torch.cuda.get_device_name() if opts.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(
        f"{name}; torch {torch.__version__}; --arch {opts.arch}; global batch {opts.batch}; "
        f"median of {opts.repeats} runs, epochs 2-{opts.epochs}"
    )
    columns = f"{'processes':>9} {'samples/s':>10} {'s/epoch':>8} {'time vs single_gpu':>19}"
    print(f"{'stage':<20} {columns}")
    base = rates.get("single_gpu")
    for stage in stages:
        processes = 1 if stage == "single_gpu" else world
        ratio = f"{base / rates[stage]:.2f}x" if base else "-"
        seconds = samples / rates[stage]
        print(f"{stage:<20} {processes:>9} {rates[stage]:>10.0f} {seconds:>8.3f} {ratio:>19}")
    print(f"{'bare loop':<20} {1:>9} {bare:>10.0f} {samples / bare:>8.3f} {'':>19}")
    if base:
        print(f"single_gpu.py reaches {base / bare:.2f}x the bare loop's throughput")


if __name__ == "__main__":
    main()
