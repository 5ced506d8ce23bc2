"""Shared helpers: launch a stage exactly as a user would (on CPU + gloo), read its log and its snapshots."""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STAGES = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode"]
EPOCH_LINE = re.compile(r"^Epoch (\d+) \| loss ([\d.]+) \| acc ([\d.]+) \| (\d+) samples/s$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_env(**extra: str) -> dict:
    """CPU + gloo even on a GPU machine; test hooks in tests/faults (inactive unless their variables are set)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "SAVE_KILL", "KEEP_SNAP", "RECORD_DIR"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(REPO / "tests" / "faults"))
    env.update(extra)
    return env


def stage_command(stage: str, args: list, nnodes_rank: int | None = None, endpoint: str = "",
                  torchrun_args: tuple = ()) -> list:
    script = str(REPO / f"{stage}.py")
    if stage in ("single_gpu", "multigpu"):
        return [sys.executable, script, *args]
    if stage == "multigpu_torchrun":
        return [TORCHRUN, "--standalone", "--nproc_per_node=2", *torchrun_args, script, *args]
    return [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={nnodes_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id=test", *torchrun_args, script, *args]


class Run:
    def __init__(self, returncode: int, output: str, seconds: float) -> None:
        self.returncode, self.output, self.seconds = returncode, output, seconds

    def epochs(self) -> list[tuple[int, float, float, int]]:
        return [(int(e), float(loss), float(acc), int(rate)) for e, loss, acc, rate in EPOCH_LINE.findall(self.output)]


def launch(stage: str, args: list, cwd: Path, env: dict | None = None, timeout: float = 90,
           torchrun_args: tuple = (), node_cwds: tuple | None = None) -> Run:
    """Run one stage to its end; multinode runs as two torchrun agents ("nodes") on this machine."""
    env = env or stage_env()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [0, 1] if stage == "multinode" else [None]
    cwds = node_cwds or (cwd, cwd)
    start = time.monotonic()
    procs = [subprocess.Popen(stage_command(stage, [str(a) for a in args], node, endpoint, torchrun_args),
                              cwd=cwds[i], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for i, node in enumerate(nodes)]
    outputs, codes = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            outputs.append(out)
            codes.append(proc.returncode)
    except subprocess.TimeoutExpired:
        for proc in procs:  # the whole session each agent or script started, workers included
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.communicate()
        pytest.fail(f"{stage} {args} did not finish within {timeout} s")
    code = next((c for c in codes if c != 0), 0)
    return Run(code, "\n".join(outputs), time.monotonic() - start)


def global_batch_args(stage: str) -> list:
    """The same global batch (64) in every stage: one process x 64, or two processes x 32."""
    return ["--batch_size", "64" if stage == "single_gpu" else "32"]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_param_diff(a: dict, b: dict) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Same model, same optimizer state, same epoch: to the last bit."""
    assert a["epoch"] == b["epoch"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for k in sa[p]:
            assert torch.equal(torch.as_tensor(sa[p][k]), torch.as_tensor(sb[p][k])), (p, k)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> dict:
    """Each stage trains 3 epochs at global batch 64, seed 0, keeping its snapshot after every epoch.

    Shared by the learning, same-model, resume, elastic and shard tests, so each stage starts here only once."""
    runs = {}
    for stage in STAGES:
        cwd = tmp_path_factory.mktemp(stage)
        (cwd / "record").mkdir()
        env = stage_env(KEEP_SNAPSHOTS="1", RECORD_DIR=str(cwd / "record"))
        run = launch(stage, [3, 1, *global_batch_args(stage)], cwd, env)
        assert run.returncode == 0, run.output
        runs[stage] = (cwd, run)
    return runs
