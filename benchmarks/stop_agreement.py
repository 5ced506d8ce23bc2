"""The stop agreement's cost per optimizer step: blocking, against in the background (CPU, gloo).

    python benchmarks/stop_agreement.py                 # 2 processes, 5 rounds of 1,000 steps
    python benchmarks/stop_agreement.py --sleep 2.8     # a host that waits 2.8 ms per step

Each process does the same work per "step", then checks whether to stop in one of three ways:
  none       no check: the floor
  blocking   a MAX all-reduce of three integers, as the stages' vote (a stop signal, a save due,
             a loss that is not finite), that the step waits for (the stages before)
  overlap    the all-reduce started after the step and read after the next one (the stages now)
The step's work is a matrix product (--size: every core busy, as on a CPU-only node), or with
--sleep MS a wait, as a GPU node's host waits for its GPU with cores to spare. Rounds take the
three in turn, so that each sees the same machine; printed: the median ms per step of each, and
what each check adds to a step.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("none", "blocking", "overlap")


def timed_steps(mode: str, opts: argparse.Namespace, work: torch.Tensor) -> float:
    """ms per step of opts.steps steps with the given stop check."""
    dist.barrier()
    start = time.perf_counter()
    pending = None
    for _ in range(opts.steps):
        if opts.sleep:
            time.sleep(opts.sleep / 1000)
        else:
            work @ work
        flag = torch.tensor([0, 0, 0])  # as the stages vote: a stop, a save due, a NaN loss
        if mode == "blocking":
            dist.all_reduce(flag, dist.ReduceOp.MAX)
        elif mode == "overlap":
            if pending is not None:
                pending.wait()
            pending = dist.all_reduce(flag, dist.ReduceOp.MAX, async_op=True)
    if pending is not None:
        pending.wait()
    dist.barrier()
    return (time.perf_counter() - start) / opts.steps * 1e3


def worker(rank: int, opts: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=opts.processes)
    torch.set_num_threads(1)
    work = torch.randn(opts.size, opts.size)
    times = {mode: [] for mode in MODES}
    for _ in range(opts.rounds):
        for mode in MODES:
            times[mode].append(timed_steps(mode, opts, work))
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="steps per round and check")
    parser.add_argument("--size", type=int, default=384, help="side of the step's matrix (384)")
    parser.add_argument("--sleep", type=float, default=0, help="ms: a wait instead of a product")
    opts = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(opts, port, results), nprocs=opts.processes)
    times = results.get()
    floor = statistics.median(times["none"])
    print(f"{opts.processes} processes, {opts.rounds} rounds of {opts.steps} steps; ms per step:")
    for mode in MODES:
        per_step = statistics.median(times[mode])
        spread = f"{min(times[mode]):.3f}-{max(times[mode]):.3f}"
        print(f"  {mode:>8}: {per_step:.3f} ({spread}), {per_step - floor:+.3f} for the check")


if __name__ == "__main__":
    main()
