"""Shared helpers: launch a stage exactly as a user would (on CPU + gloo), read its log and its snapshots."""
import contextlib
import functools
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STAGES = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode"]
EPOCHS = 3  # of every reference run, and of the runs compared with them
EPOCH_LINE = re.compile(r"^Epoch (\d+) \| loss ([\d.]+) \| acc ([\d.]+) \| (\d+) samples/s$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_env(**extra: str) -> dict:
    """CPU + gloo even on a GPU machine; test hooks in tests/faults (inactive unless their variables are set)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "SAVE_KILL", "KEEP_SNAP", "RECORD_DIR"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(REPO / "tests" / "faults"),
               OMP_WAIT_POLICY="PASSIVE")  # runs share the cores: idle threads sleep instead of spinning
    env.update(extra)
    return env


def stage_command(stage: str, args: list, nnodes_rank: int | None = None, endpoint: str = "",
                  torchrun_args: tuple = (), plain_python: bool = False) -> list:
    script = str(REPO / f"{stage}.py")
    if stage in ("single_gpu", "multigpu") or plain_python:
        return [sys.executable, script, *args]
    if stage == "multigpu_torchrun":
        return [TORCHRUN, "--standalone", "--nproc_per_node=2", *torchrun_args, script, *args]
    return [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={nnodes_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id=test", *torchrun_args, script, *args]


class Run:
    def __init__(self, returncode: int, output: str, ended: float) -> None:
        self.returncode, self.output, self.ended = returncode, output, ended  # ended: time.time() at exit

    def epochs(self) -> list[tuple[int, float, float, int]]:
        return [(int(e), float(loss), float(acc), int(rate)) for e, loss, acc, rate in EPOCH_LINE.findall(self.output)]


def launch(stage: str, args: list, cwd: Path, env: dict | None = None, timeout: float = 180,
           torchrun_args: tuple = (), node_cwds: tuple | None = None, plain_python: bool = False) -> Run:
    """Run one stage to its end, as a user launches it; multinode runs as two torchrun agents ("nodes") on this
    machine. plain_python: python SCRIPT, even for the torchrun stages."""
    env = env or stage_env()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [0, 1] if stage == "multinode" and not plain_python else [None]
    cwds = node_cwds or (cwd, cwd)
    start = time.monotonic()
    procs = [subprocess.Popen(stage_command(stage, [str(a) for a in args], node, endpoint, torchrun_args, plain_python),
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
    return Run(code, "\n".join(outputs), time.time())


class Runs:
    """Launches that run side by side: each run alone leaves a core idle much of the time (imports, rendezvous), and
    the results do not depend on the load (the arithmetic is deterministic). At most 3 per core at once, in the order
    started: more only make the runs thrash the cores. A run that starts from another's files starts as soon as that
    one ends, ahead of the queue. runs[name] waits for the run: (folder, Run)."""
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=64)  # a thread per run; most of them wait for a process
        self.slots = threading.Semaphore(3 * (os.cpu_count() or 1))
        self.futures = {}

    def start(self, name: str, after: str | None = None, prepare=None, **launch_args) -> None:
        assert after is None or after in self.futures, f"start {after} before {name}"

        def run() -> tuple:
            if after:
                self[after]  # wait for it
            if prepare:
                prepare()
            with self.slots if after is None else contextlib.nullcontext():  # the longest paths go first
                return launch_args["cwd"], launch(**launch_args)
        self.futures[name] = self.pool.submit(run)

    def __getitem__(self, name: str) -> tuple:
        return self.futures[name].result()


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


DEAD_RANKS = {  # stage, fault, and how the output names the rank that failed
    "multigpu-raise": ("multigpu", "raise:1:0", "Process 1 terminated"),
    "multigpu-kill": ("multigpu", "kill:1:0", "error: rank 1 stopped (SIGKILL)"),
    "torchrun-raise": ("multigpu_torchrun", "raise:1:0", "rank      : 1 (local_rank: 1)"),
}  # a SIGKILLed worker under torchrun: test_elastic_restart_resumes_exactly


class Payload:
    """Unpickling this runs a command that creates a file beside the snapshot: it must never happen."""
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_bad_snapshot(path: Path, case: str) -> None:
    if case == "garbage":
        path.write_bytes(b"this is not a snapshot\n" * 10)
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        write_snapshot(path, epoch=1)
        path.write_bytes(path.read_bytes()[:200])
    elif case == "other_model":
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4))
        optimizer = torch.optim.AdamW(model.parameters())
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, path)
    elif case == "payload":
        torch.save({"model": {}, "optimizer": Payload(path.parent / "payload-ran"), "epoch": 1}, path)


@functools.cache
def single_gpu():
    """single_gpu.py as a module, for its build_model() and load_datasets()."""
    spec = importlib.util.spec_from_file_location("single_gpu", REPO / "single_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_snapshot(path: Path, epoch: int) -> None:
    """A valid snapshot of the default model, as the stages write it."""
    model = single_gpu().build_model("convnet", 10)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)


def make_image_tree(root, classes=4, train=24, val=8, size=24):
    """PNG files in the ImageFolder layout; a class is a colour, so a few epochs suffice."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    colours = torch.rand(classes, 3, generator=g) * 200
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True)
            for i in range(count):
                pixels = (colours[c] + 55 * torch.rand(size, size, 3, generator=g)).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / f"class{c}" / f"{i}.png")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Every launch of the session, queued as it starts: {name: (folder, Run)} (see Runs).

    reference-STAGE: each stage trains EPOCHS epochs at global batch 64, seed 0, keeping its snapshot after every epoch
    (shared by the learning, same-model, resume, elastic and shard tests, so each stage starts here only once).
    Other runs inject faults (test_faults.py), give bad input (test_errors.py), or start from a reference's files."""
    runs, references = Runs(), {}
    folder = tmp_path_factory.mktemp
    for stage in STAGES:
        cwd = references[stage] = folder(stage)
        (cwd / "record").mkdir()
        runs.start(f"reference-{stage}", stage=stage, args=[EPOCHS, 1, *global_batch_args(stage)], cwd=cwd,
                   env=stage_env(KEEP_SNAPSHOTS="1", RECORD_DIR=str(cwd / "record")))
    # Stopped after epoch 2 and started again to the end; "cross": a snapshot of multinode.py resumed by single_gpu.py.
    for name, stage, source in (("resume-multigpu", "multigpu", "multigpu"), ("cross", "single_gpu", "multinode")):
        cwd = folder(name)
        copy = functools.partial(shutil.copyfile, references[source] / "snapshot.pt.epoch2", cwd / "snapshot.pt")
        runs.start(name, after=f"reference-{source}", prepare=copy, stage=stage,
                   args=[EPOCHS, 1, *global_batch_args(stage)], cwd=cwd)
    for stage, rank in (("multigpu_torchrun", 0), ("multinode", 1)):  # SIGKILL a worker in epoch 3 (test_stages.py)
        cwd = folder(f"elastic-{stage}")
        runs.start(f"elastic-{stage}", stage=stage, args=[EPOCHS, 1, *global_batch_args(stage)], cwd=cwd,
                   env=stage_env(FAULT_AT=f"kill:{rank}:2", FAULT_ONCE=str(cwd / "killed")),
                   torchrun_args=("--max-restarts=1",))
    # The second save writes half a file, then the process is SIGKILLed; then the same folder, copied, starts again.
    save, save_resume = folder("save"), folder("save-resume")
    runs.start("save", stage="single_gpu", args=[EPOCHS, 1, "--batch_size", 64], cwd=save,
               env=stage_env(SAVE_KILL_AT="2"))
    runs.start("save-resume", after="save", prepare=lambda: shutil.copytree(save, save_resume, dirs_exist_ok=True),
               stage="single_gpu", args=[EPOCHS, 1, "--batch_size", 64], cwd=save_resume)
    for name, (stage, fault, _) in DEAD_RANKS.items():  # FAULT_ONCE's file tells when the rank died
        cwd = folder(name)
        runs.start(name, stage=stage, args=[2, 1], cwd=cwd, env=stage_env(FAULT_AT=fault, FAULT_ONCE=str(cwd / "died")))
    # Two nodes without shared storage: node 0 has a snapshot, node 1 has none.
    nodes = folder("node0"), folder("node1")
    write_snapshot(nodes[0] / "snapshot.pt", epoch=2)
    runs.start("apart", stage="multinode", args=[4, 1, "--batch_size", 32], cwd=nodes[0], node_cwds=nodes)
    cwd = folder("images")
    make_image_tree(cwd / "data")
    runs.start("images", stage="multigpu", args=[4, 4, "--data_dir", cwd / "data", "--batch_size", 8, "--lr", "3e-3"],
               cwd=cwd)
    # Bad input, as a user sees it (test_errors.py).
    runs.start("no-torchrun", stage="multinode", args=[2, 1], cwd=folder("no-torchrun"), plain_python=True)
    cwd = folder("bad-snapshot")
    write_bad_snapshot(cwd / "snapshot.pt", "payload")
    runs.start("bad-snapshot", stage="multigpu", args=[2, 1], cwd=cwd)
    yield runs
    runs.pool.shutdown()


@pytest.fixture(scope="session")
def reference_runs(runs) -> dict:
    """{stage: (folder, Run)} of the four reference runs."""
    for stage in STAGES:
        assert runs[f"reference-{stage}"][1].returncode == 0, runs[f"reference-{stage}"][1].output
    return {stage: runs[f"reference-{stage}"] for stage in STAGES}


@pytest.fixture(scope="session", autouse=True)
def _slurm_in_background(request):
    """Bring up the Slurm cluster and submit the batch files as the session starts, so the jobs share the machine
    with the other tests instead of running after them. Only when a Slurm test was collected."""
    if not any(item.nodeid.startswith("tests/test_slurm.py") for item in request.session.items):
        yield None
        return
    import slurm_cluster
    reason = slurm_cluster.missing_requirement()
    if reason:
        yield reason
        return
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))  # not under pytest's 0700 folder: munged wants o+x on the path
    pool = ThreadPoolExecutor(max_workers=1)
    jobs = pool.submit(lambda: slurm_cluster.submit_all(slurm_cluster.start(root), root))
    try:
        yield jobs
    finally:
        jobs.exception()  # wait for the jobs, then stop the daemons even when a test failed
        pool.shutdown()
        slurm_cluster.stop(root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_jobs(_slurm_in_background) -> dict:
    """{stage: (folder, sbatch result, job log)}; skipped (a failure in CI) where Slurm or root is missing."""
    if isinstance(_slurm_in_background, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {_slurm_in_background}")
        pytest.skip(_slurm_in_background)
    return _slurm_in_background.result()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skipped test is a failed one: nothing may silently not run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI: {report.longrepr}"
