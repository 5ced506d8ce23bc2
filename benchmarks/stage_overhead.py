"""On the CPU: each stage's epoch time against the plain loop's, on the same images with loader
workers on, in paired runs (plain loop, stage, plain loop, stage...) so that the machine's drift
hits both alike.

    python benchmarks/stage_overhead.py                     # 5 pairs per stage
    python benchmarks/stage_overhead.py --pairs 3 --runners single_gpu

The work is gpu_throughput.py's (ResNet-18 on 32x32 PNGs, evaluation after each epoch), smaller,
at world size 1: what a stage's own host work per step and per epoch costs shows as a ratio
below 1. Each figure: the median samples/s of epochs 2 and later of one run.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput as bench  # noqa: E402


def paired_ratios(stage: str, opts: argparse.Namespace, data_dir: Path, env: dict) -> list:
    """The stage's samples/s over the plain loop's, pair by pair."""
    ratios = []
    for _ in range(opts.pairs):
        plain = bench.runner_rate("plain", opts, data_dir, opts.batch_size, "fp32", env)
        rate = bench.runner_rate(stage, opts, data_dir, opts.batch_size, "fp32", env)
        ratios.append(rate / plain)
    return ratios


def options(argv: list | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--images", type=int, default=512, help="training PNGs (512)")
    parser.add_argument("--val", type=int, default=128, help="held-out PNGs (128)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3, help="per run; the 1st is left out")
    parser.add_argument("--workers", type=int, default=2, help="loader processes (2)")
    parser.add_argument("--runners", default=",".join(bench.STAGES), help="comma-separated")
    opts = parser.parse_args(argv)
    opts.device, opts.compile = "cpu", False
    return opts


def main() -> None:
    opts = options()
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as folder:
        bench.make_folder(Path(folder), opts.images, opts.val)
        print(f"CPU, {os.cpu_count()} cores; torch {torch.__version__}; ResNet-18; batch "
              f"{opts.batch_size}; --workers {opts.workers}; {opts.pairs} pairs")  # fmt: skip
        for stage in opts.runners.split(","):
            ratios = paired_ratios(stage, opts, Path(folder), env)
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(f"{stage:<20} {statistics.median(ratios):.2f} of the plain loop ({spread})")


if __name__ == "__main__":
    main()
