"""Shared helpers: launch a stage as a user would (CPU + gloo), read its log and its snapshots.

Every launch of the default suite is defined in one pool (the `runs` fixture). A session of the
whole suite starts them all as it starts, so that runs share the two cores while the tests read
their results; the floor suite (-m floor) starts only the runs its tests read (FLOOR_RUNS). When
the user picks tests (-k, a file, or FILE::TEST), a run starts only when a selected test reads it.
See tests/README.md.
"""

import contextlib
import functools
import importlib.util
import os
import random
import re
import shutil
import signal
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
STAGES = ["single_gpu", "multigpu", "multigpu_torchrun", "multinode", "fsdp"]
TORCHRUN_STAGES = ("multigpu_torchrun", "multinode", "fsdp")
NODE_STAGES = ("multinode", "fsdp")  # the suite starts them as two "nodes" (torchrun agents)
EPOCHS = 3  # of every reference run, and of the runs compared with them
EPOCH_LINE = re.compile(
    r"^Epoch (\d+) \| loss ([\d.]+) \| acc ([\d.]+) \| lr ([\d.e+-]+) \| batch (\d+) \| "
    r"(\d+) samples/s$",
    re.M,
)
TEST_HOOKS = (
    "FAULT_",
    "SAVE_KILL",
    "KEEP_SNAP",
    "RECORD_DIR",
    "EXIT_HOOKS",
    "EXIT_WORKERS",
    "TORCH_DISABLE_SHARE_RDZV",
    "MASTER_",
    "TAKE_PORT",
    "RECORD_THREADS",
    "RECORD_MEMORY",
)


HELD_PORTS = []


def free_port(hold: bool = False) -> int:
    """A port that no process listens on; hold=True: bound until the session ends, so that no
    other program takes it before torchrun's store listens on it (as `python multigpu.py`)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, hold)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    if hold:
        HELD_PORTS.append(s)
    else:
        s.close()
    return port


def alone_under_torchrun(monkeypatch) -> None:
    """The variables torchrun sets for a job of one process, on a free port of this machine."""
    world = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    world.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in world.items():
        monkeypatch.setenv(name, value)


def stage_env(**extra: str) -> dict:
    """CPU + gloo even on a GPU machine, and the test hooks of tests/faults, idle unless set.
    Output is buffered, as a user's is when it goes to a file or a pipe (a Slurm log)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith((*TEST_HOOKS, "SLURM_"))}
    env.pop("PYTHONUNBUFFERED", None)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(REPO / "tests" / "faults"),
        OMP_WAIT_POLICY="PASSIVE",  # runs share the cores: idle threads sleep instead of spinning
    )
    env.update(extra)
    return env


TORCHRUN_LOG = re.compile(
    r"^([EWI]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ |frame #\d+: |Exception raised from )"
)


def own_output(output: str) -> str:
    """A run's output without torchrun's own log lines (Python's `W1125 12:00:00.5 PID file]`, and
    the C++ frames of an exception it logs); a rank's C++ warnings (`[W1125 12:00:00...`) stay.
    With two nodes, the agent that holds the rendezvous store may leave first, and the other then
    logs a failed exit barrier with a traceback, exit code 0 (pytorch/pytorch#69520)."""
    lines = output.splitlines()
    return "\n".join(
        line
        for line in lines
        if not TORCHRUN_LOG.match(line) and line != "<omitting python frames>"
    )


# NaN weights in the last update before a save, in one process, two nodes and FSDP, as 3 epochs
# of 10 steps run (global batch 64): an epoch's end (after step 20: epoch 1 kept); a save on the
# clock (a minute, 25 s a step: after step 6, or after step 8 where the ranks agree a step late);
# a stop signal (after step 15, saved after step 16 where the ranks agree a step late); and a NaN
# loss far from any save (after step 3, --save_minutes 0: epoch 1 never ends).
DIVERGED = {}
for _stage in ("single_gpu", "multinode", "fsdp"):
    _late = int(_stage != "single_gpu")  # the step the ranks' vote adds
    DIVERGED[_stage, "epoch"] = {"FAULT_STEP_NAN": "20"}
    DIVERGED[_stage, "clock"] = {"FAULT_STEP_NAN": str(6 + 2 * _late), "FAULT_STEP_CLOCK": "25"}
    DIVERGED[_stage, "stop"] = {
        "FAULT_STEP_NAN": str(15 + _late),
        "FAULT_SIGNAL": "SIGTERM:step:15",
    }
    DIVERGED[_stage, "loss"] = {"FAULT_STEP_NAN": "3"}

# The stages whose save on the clock is resumed too; the others save with multinode.py's lines.
RESUMED_ON_THE_CLOCK = ("single_gpu", "multinode", "fsdp")

RESTARTS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # what --max-restarts needs (README)


LEGACY_LAUNCHER = [sys.executable, "-m", "torch.distributed.launch"]


def stage_command(
    stage: str,
    args: list,
    node: int | None,
    endpoint: str,
    torchrun_args=(),
    nproc: int = 2,
    launcher: list | None = None,
) -> list:
    script = str(REPO / f"{stage}.py")
    if stage in ("single_gpu", "multigpu") or nproc == 0:
        return [sys.executable, script, *args]
    if launcher:  # another launcher on one machine: torch.distributed.launch
        torchrun = [*launcher, f"--nproc_per_node={nproc}"]
    elif stage == "multigpu_torchrun":
        torchrun = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    else:
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=test"]
        torchrun = [
            TORCHRUN,
            "--nnodes=2",
            f"--nproc_per_node={nproc // 2}",
            f"--node_rank={node}",
            *rendezvous,
        ]
    return [*torchrun, *torchrun_args, script, *args]


class Run:
    def __init__(self, returncode: int, output: str, seconds: float) -> None:
        self.returncode = returncode
        self.output = output
        self.seconds = seconds  # from the start to the exit
        self.ended = time.time()

    def epochs(self) -> list[tuple]:
        """(epoch, loss, accuracy, lr, global batch, samples/s) of each logged epoch."""
        return [
            (int(e), float(loss), float(acc), float(lr), int(batch), int(rate))
            for e, loss, acc, lr, batch, rate in EPOCH_LINE.findall(self.output)
        ]


def start(
    stage: str,
    args: list,
    cwd: Path,
    env: dict | None = None,
    torchrun_args=(),
    node_cwds=None,
    nproc: int = 2,
    host: str = "127.0.0.1",
    launcher: list | None = None,
    prefix: tuple = (),
) -> list[subprocess.Popen]:
    """Start a stage as a user does; multinode and fsdp: two torchrun agents ("nodes") here,
    nproc/2 processes each, meeting at `host` ("[::1]": IPv6). nproc=0: python SCRIPT, even for
    the torchrun stages;
    launcher: that command in place of torchrun; prefix: a command before it (taskset -c 0)."""
    env = env or stage_env()
    if "--snapshot_path" not in args:  # one name in every stage's folder: the tests compare them
        args = [*args, "--snapshot_path", "snapshot.pt"]
    endpoint = f"{host}:{free_port(hold=True)}"
    nodes = [0, 1] if stage in NODE_STAGES and nproc else [None]
    cwds = node_cwds or (cwd, cwd)
    return [
        subprocess.Popen(
            [
                *prefix,
                *stage_command(
                    stage, [str(a) for a in args], node, endpoint, torchrun_args, nproc, launcher
                ),
            ],
            cwd=cwds[i],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the test can end exactly what it started
        )
        for i, node in enumerate(nodes)
    ]


def launch(stage: str, args: list, cwd: Path, timeout: float = 300, **start_args) -> Run:
    """Run a stage to its end: a Run with the first non-zero exit code and all output."""
    begin = time.monotonic()
    procs = start(stage, args, cwd, **start_args)
    outputs, codes = [], []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - begin)))
            outputs.append(out)
            codes.append(proc.returncode)
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        end_processes_in(cwd)
        pytest.fail(f"{stage} {args} did not finish within {timeout} s")
    code = next((c for c in codes if c != 0), 0)
    return Run(code, "\n".join(outputs), time.monotonic() - begin)


def launch_timed(stage: str, args: list, cwd: Path, **start_args) -> tuple[int, list]:
    """Run a stage to its end, reading its output as it comes: (exit code, [(seconds from the
    start, line)]). Shows when each line left the processes, not only what they printed."""
    begin = time.monotonic()
    (proc,) = start(stage, args, cwd, **start_args)
    deadline = threading.Timer(300, end_processes_in, [cwd])  # a hang ends the output too
    deadline.start()
    lines = [(time.monotonic() - begin, line.rstrip("\n")) for line in proc.stdout]
    deadline.cancel()
    return proc.wait(), lines


def processes_in(folder: Path) -> list[int]:
    """PIDs of the processes whose working folder is `folder`: each run has its own. A zombie has
    ended (it holds no memory, file or GPU): this machine's PID 1 reaps an orphan's late."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                ended = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            if os.readlink(f"/proc/{pid}/cwd") == str(folder) and not ended:
                found.append(int(pid))
    return found


def processes_left(folder: Path, seconds: float = 5) -> list[int]:
    """processes_in(folder) once they have had `seconds` to end: on a loaded machine a process
    can take a few seconds to exit, such as the resource tracker that spawn's launcher starts."""
    end = time.monotonic() + seconds
    while (found := processes_in(folder)) and time.monotonic() < end:
        time.sleep(0.1)
    return found


def end_processes_in(folder: Path) -> None:
    for pid in processes_in(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Runs:
    """Launches that run side by side: one run alone leaves a core idle much of the time
    (imports, rendezvous), and the results do not depend on the load (the arithmetic is
    deterministic). submit() and start() only define a run. runs[name] starts it unless it has
    started, then waits for it; prefetch() starts every run defined, in the order defined, so that
    the runs share the cores while the tests read them. At most `per_core` a core at once, in the
    order started. A run that starts from another's files starts that one first, and runs as soon
    as that one ends, ahead of the queue."""

    def __init__(self, per_core: float = 3) -> None:
        self.pool = ThreadPoolExecutor(max_workers=64)  # a thread per run: most wait for a process
        self.slots = threading.Semaphore(max(1, int(per_core * (os.cpu_count() or 1))))
        self.jobs = {}  # name: (job, after), in the order defined
        self.futures = {}  # name: its future, for the runs started
        self.lock = threading.RLock()  # a test and a run that waits for another may start one

    def submit(self, name: str, job, after: str | None = None) -> None:
        """Define a run: job() will run in the pool, holding a slot unless it waits for the run
        named `after`."""
        assert after is None or after in self.jobs, f"define {after} before {name}"
        self.jobs[name] = job, after

    def start(self, name: str, cwd: Path, after: str | None = None, prepare=None, **launch_args):
        def job() -> tuple:
            if prepare:
                prepare()
            return cwd, launch(cwd=cwd, **launch_args)

        self.submit(name, job, after)

    def started(self, name: str):
        """The run's future; the run (and first the one it starts after) starts unless it has."""
        with self.lock:
            if name not in self.futures:
                job, after = self.jobs[name]
                if after:
                    self.started(after)
                self.futures[name] = self.pool.submit(self.run, job, after)
            return self.futures[name]

    def run(self, job, after: str | None):
        if after:
            self[after]
        with self.slots if after is None else contextlib.nullcontext():
            return job()

    def prefetch(self, names=None) -> None:
        """Start every run defined, or those named, in the order defined."""
        assert names is None or set(names) <= self.jobs.keys(), set(names) - self.jobs.keys()
        for name in self.jobs:
            if names is None or name in names:
                self.started(name)

    def __getitem__(self, name: str):
        return self.started(name).result()

    def wait_all(self) -> None:
        """Wait for every run started; one not started stays so."""
        with self.lock:
            futures = list(self.futures.values())
        for future in futures:
            future.exception()


def narrowed(config) -> bool:
    """Whether the user picked tests (-k, a file, or a node id such as FILE::TEST) rather than
    the whole suite: then only the runs those tests read start, as they read them."""
    whole = {(config.rootpath / path).resolve() for path in config.getini("testpaths")}
    return bool(config.option.keyword) or {Path(a).resolve() for a in config.args} != whole


def global_batch_args(stage: str) -> list:
    """The same global batch (64) in every stage: one process x 64, or two processes x 32."""
    return ["--batch_size", "64" if stage == "single_gpu" else "32"]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_param_diff(a: dict, b: dict) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


def max_moment_diff(a: dict, b: dict) -> float:
    """The largest difference of AdamW's first moments (the mean gradient), relative to the
    largest moment of that parameter in b. Parameters cannot show a wrong gradient scale (AdamW
    divides it out); the moments carry it: a gradient twice too large differs by 1."""
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    return max(
        ((sa[p]["exp_avg"] - sb[p]["exp_avg"]).abs().max() / sb[p]["exp_avg"].abs().max()).item()
        for p in sa
    )


def assert_same_model(a: dict, b: dict, params: float = 1e-4, moments: float = 0.02) -> None:
    """The same parameters to rounding, and the same mean gradients."""
    assert max_param_diff(a, b) <= params, max_param_diff(a, b)
    assert max_moment_diff(a, b) <= moments, max_moment_diff(a, b)


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


DEAD_RANKS = {  # stage, fault, how the output names the rank that failed, the job's exit code
    "multigpu-kill": (
        "multigpu",
        "kill:1:0",
        "error: process 1 terminated with signal SIGKILL",
        75,
    ),
    "torchrun-raise": ("multigpu_torchrun", "raise:1:1", "rank      : 1 (local_rank: 1)", 1),
}  # a SIGKILLed worker under torchrun: test_elastic_restart_resumes_exactly


class Payload:
    """Unpickling this runs a command that creates a file beside the snapshot: it must not run."""

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
        snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}
        torch.save(snapshot, path)
    elif case == "payload":
        torch.save(
            {"model": {}, "optimizer": Payload(path.parent / "payload-ran"), "epoch": 1}, path
        )


@functools.cache
def stage_module(stage: str):
    """A stage script as a module (its __main__ block does not run)."""
    spec = importlib.util.spec_from_file_location(stage, REPO / f"{stage}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_gpu():
    """single_gpu.py as a module, for its build_model() and load_datasets()."""
    return stage_module("single_gpu")


def write_snapshot(path: Path, epoch: int, **more) -> None:
    """A valid snapshot of the default model, as the stages write it."""
    torch.manual_seed(0)
    model = single_gpu().build_model("convnet", 10, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
    snapshot.update(samples=0, loss_sum=0.0, **more)
    torch.save(snapshot, path)


def make_image_tree(root: Path, classes: int = 4, train: int = 24, val: int = 8) -> None:
    """PNG files in the ImageFolder layout; a class is a colour, so a few epochs suffice."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    colours = torch.rand(classes, 3, generator=g) * 200
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True)
            for i in range(count):
                noise = 55 * torch.rand(24, 24, 3, generator=g)
                pixels = (colours[c] + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / f"class{c}" / f"{i}.png")


GLYPHS = "bdpq25SZNL"  # b/d/p/q mirror one another; 2, 5, S, Z, N, L mirror to no character


def make_glyph_tree(root: Path, train: int, val: int, seed: int = 0) -> None:
    """Grey 32x32 PNGs of characters: drawn at random sizes, angles and offsets, blurred and
    noisy. Real structure: a mirror image or a heavy crop can change or erase the class."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    rng = random.Random(seed)
    for split, count in (("train", train), ("val", val)):
        for c, char in enumerate(GLYPHS):
            folder = root / split / f"{c}_{char}"
            folder.mkdir(parents=True)
            for i in range(count):
                image = Image.new("L", (64, 64), 0)
                font = ImageFont.load_default(size=rng.randint(28, 40))
                stroke = {"stroke_width": rng.randint(0, 2), "stroke_fill": 255}
                ImageDraw.Draw(image).text((32, 32), char, 255, font, anchor="mm", **stroke)
                shift = (rng.uniform(-5, 5), rng.uniform(-5, 5))
                image = image.rotate(rng.uniform(-15, 15), Image.BILINEAR, translate=shift)
                image = image.resize((32, 32), Image.BILINEAR)
                image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))
                noise = Image.effect_noise((32, 32), rng.uniform(10, 40))
                Image.blend(image, noise, rng.uniform(0.1, 0.3)).save(folder / f"{i}.png")


def kill_launcher_after(stage: str, epoch: int, cwd: Path, timeout: float = 300) -> dict:
    """Start a long run, SIGKILL its launcher (python multigpu.py, or torchrun) once `epoch`
    is logged (0: once its 2 workers exist, before they can reach torchrun's store), then watch
    its workers: {"killed": seconds after start, "gone": seconds from the kill until no process
    works in cwd (None: some still did after 120 s), "output": ...}."""
    (proc,) = start(stage, [400, 1], cwd)
    begin = time.monotonic()
    deadline = threading.Timer(timeout, end_processes_in, [cwd])  # a silent hang ends too
    deadline.start()
    lines = []
    if epoch:
        for line in proc.stdout:  # the launcher's own output, workers' included, until the kill
            lines.append(line)
            if line.startswith(f"Epoch {epoch} "):
                break
    else:  # the launcher and its 2 workers, as soon as the workers exist
        while len(processes_in(cwd)) < 3 and time.monotonic() - begin < timeout:
            time.sleep(0.01)
    deadline.cancel()
    killed = time.monotonic()
    proc.kill()
    proc.wait()
    gone = None
    while time.monotonic() - killed < 120:  # workers that start must first import torch
        if not processes_in(cwd):
            gone = time.monotonic() - killed
            break
        time.sleep(0.2)
    end_processes_in(cwd)  # whatever is left, so that nothing outlives the test
    proc.stdout.close()
    return {"cwd": cwd, "killed": killed - begin, "gone": gone, "output": "".join(lines)}


def readme_commands() -> list[str]:
    """The commands of the README's code blocks that run on one CPU machine, in order, with
    `50 10` as `2 1` (the same commands, fewer epochs) and torchrun's `gpu` as 2 processes."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    wanted = [
        line
        for line in lines
        if line.startswith(("python single", "python multi", "torchrun --standalone"))
    ]
    return [line.replace(" 50 10", " 2 1").replace("=gpu", "=2") for line in wanted]


def run_readme_commands(cwd: Path) -> list[tuple[str, Run]]:
    """Each command where the one before it ran: [(command, Run)]."""
    done = []
    for command in readme_commands():
        words = [str(REPO / w) if w.endswith(".py") else w for w in command.split()]
        words[0] = sys.executable if words[0] == "python" else TORCHRUN
        begin = time.monotonic()
        proc = subprocess.run(words, cwd=cwd, env=stage_env(), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        done.append(
            (command, Run(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - begin))
        )
    return done


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory):
    """Every launch of the default suite, defined here: {name: (folder, Run)} (see Runs). They start
    as the session starts, in this order (the floor suite: FLOOR_RUNS alone), unless the user
    picked tests by name (`narrowed`).

    reference-STAGE: each stage trains EPOCHS epochs at global batch 64, seed 0, keeping its
    snapshot after every epoch; the learning, same-model, resume, elastic and shard tests share
    them. Other runs inject faults, give bad input, or start from a reference's files."""
    runs, references = Runs(), {}
    folder = tmp_path_factory.mktemp
    for stage in STAGES:
        cwd = references[stage] = folder(stage)
        (cwd / "record").mkdir()
        env = stage_env(KEEP_SNAPSHOTS="1", RECORD_DIR=str(cwd / "record"))
        args = [EPOCHS, 1, *global_batch_args(stage)]
        runs.start(f"reference-{stage}", cwd, stage=stage, args=args, env=env)
    # Early, so that the timed runs at the end of the queue share the cores as before: a save
    # every minute on a clock that runs 25 s a step (at two ranks, rank 1's clock alone: rank 0
    # must save too), until the weights turn NaN after step 5; then, in one process, a node and
    # FSDP, the same command again on the snapshot the first left (kept.pt): test_faults.py.
    for stage in STAGES:
        cwd = folder(f"periodic-{stage}")
        faults = {"FAULT_STEP_CLOCK": "25", "FAULT_STEP_NAN": "5"}
        if stage != "single_gpu":
            faults["FAULT_CLOCK_RANK"] = "1"
        args = [EPOCHS, EPOCHS, *global_batch_args(stage), "--save_minutes", 1]
        runs.start(f"periodic-{stage}", cwd, stage=stage, args=args, env=stage_env(**faults))
        keep = functools.partial(shutil.copyfile, cwd / "snapshot.pt", cwd / "kept.pt")
        if stage in RESUMED_ON_THE_CLOCK:
            runs.start(
                f"periodic-resume-{stage}",
                cwd,
                after=f"periodic-{stage}",
                prepare=keep,
                stage=stage,
                args=args,
            )
        else:
            runs.submit(f"periodic-resume-{stage}", keep, after=f"periodic-{stage}")
    # One epoch with the whole step's gradient clipped to norm 1 (most steps are over it), in
    # every stage at global batch 64; under DDP and FSDP from micro-batches (2 x 8 x 4).
    for stage in STAGES:
        args = [1, 1, *global_batch_args(stage), "--grad_clip", 1]
        if stage in ("multigpu_torchrun", "fsdp"):
            args = [1, 1, "--batch_size", 8, "--grad_accum", 4, "--grad_clip", 1]
        runs.start(f"clip-{stage}", folder(f"clip-{stage}"), stage=stage, args=args)
    # The longest runs next, so that none is left alone at the end. The README's commands, run in
    # order in one folder, as a user does (test_repository.py).
    runs.submit("readme", functools.partial(run_readme_commands, folder("readme")))
    # Drawn characters with default flags (about 230 optimizer steps): test_stages.py.
    cwd = folder("glyphs")
    glyphs = functools.partial(make_glyph_tree, cwd / "data", train=120, val=30)
    args = [6, 6, "--data_dir", cwd / "data"]
    runs.start("glyphs", cwd, prepare=glyphs, stage="single_gpu", args=args)
    # A worker SIGKILLed in epoch 3 (test_stages.py); the same, started as most tutorials show it
    # (test_faults.py; multinode.py checks the variable as multigpu_torchrun.py does).
    elastic = [("elastic-multigpu_torchrun", 0, RESTARTS_ENV), ("plain-multigpu_torchrun", 0, {})]
    for name, rank, extra in [*elastic, ("elastic-multinode", 1, RESTARTS_ENV)]:
        stage = name.split("-")[1]
        args = [EPOCHS, 1, *global_batch_args(stage)]
        cwd = folder(name)
        fault = {"FAULT_AT": f"kill:{rank}:2", "FAULT_ONCE": str(cwd / "killed")}
        env = stage_env(**fault, **extra)
        restarts = ("--max-restarts=1",)
        runs.start(name, cwd, stage=stage, args=args, env=env, torchrun_args=restarts)
    # The same global batch (64) from micro-batches, started by the legacy launcher where this
    # torch still has it (deprecated since torch 1.9): test_stages.py.
    args = [EPOCHS, EPOCHS, "--batch_size", 8, "--grad_accum", 4]  # 2 processes x 8 x 4
    launcher = LEGACY_LAUNCHER if importlib.util.find_spec("torch.distributed.launch") else None
    cwd = folder("accumulate")  # without the launcher: torchrun, and its test is skipped
    runs.start("accumulate", cwd, stage="multigpu_torchrun", args=args, launcher=launcher)
    # The same from one process under torchrun, which trains without DDP (test_stages.py), in a
    # CPU set of one core, as Slurm gives a job (taskset -c 0): each process's threads recorded.
    args = [EPOCHS, EPOCHS, "--batch_size", 16, "--grad_accum", 4]  # 1 process x 16 x 4
    cwd = folder("one-process")
    env = stage_env(RECORD_THREADS=str(cwd))
    one_core = ("taskset", "-c", "0")
    runs.start(
        "one-process", cwd, stage="multigpu_torchrun", args=args, nproc=1, env=env, prefix=one_core
    )
    # Two processes in a CPU set of two cores, a step moving the stage's clock on by 10 s (40 micro-
    # batches an epoch, 10 steps, each 0.5 s longer): threads recorded, output read as it comes.
    cwd = folder("two-cores")
    env = stage_env(RECORD_THREADS=str(cwd), FAULT_STEP_CLOCK="10", FAULT_STEP_SLEEP="0.5")
    args = [1, 1, "--batch_size", 8, "--grad_accum", 4, "--world_size", 2]
    job = functools.partial(
        launch_timed, "multigpu", args, cwd, env=env, prefix=("taskset", "-c", "0,1")
    )
    runs.submit("two-cores", lambda cwd=cwd, job=job: (cwd, job()))
    # A snapshot of epoch 2 resumed in another stage: fsdp.py's in single_gpu.py, and the reverse.
    for name, written, resumed in [
        ("cross", "fsdp", "single_gpu"),
        ("cross-fsdp", "single_gpu", "fsdp"),
    ]:
        cwd = folder(name)
        copy = functools.partial(
            shutil.copyfile, references[written] / "snapshot.pt.epoch2", cwd / "snapshot.pt"
        )
        args = [EPOCHS, 1, *global_batch_args(resumed)]
        runs.start(name, cwd, after=f"reference-{written}", prepare=copy, stage=resumed, args=args)
    # fsdp.py: the global batch (64) from micro-batches (2 processes x 8 x 4), and in bf16.
    args = [EPOCHS, EPOCHS, "--batch_size", 8, "--grad_accum", 4]
    runs.start("accumulate-fsdp", folder("accumulate-fsdp"), stage="fsdp", args=args)
    # An error in a step, with 2 loader workers a process: they must have ended before the exit
    # functions start (test_faults.py; the distributed stages: torchrun-raise, below).
    cwd = folder("error-single_gpu")
    env = stage_env(FAULT_STEP_RAISE="2", EXIT_WORKERS=str(cwd))
    runs.start("error-single_gpu", cwd, stage="single_gpu", args=[2, 1, "--workers", 2], env=env)
    # The second save writes half a file, then the process is SIGKILLed; then the same folder,
    # copied, starts again. --deterministic: it changes nothing on the CPU, and resumes exactly.
    save, save_resume = folder("save"), folder("save-resume")
    args = [EPOCHS, 1, "--batch_size", 64, "--deterministic"]
    runs.start("save", save, stage="single_gpu", args=args, env=stage_env(SAVE_KILL_AT="2"))
    copy = functools.partial(shutil.copytree, save, save_resume, dirs_exist_ok=True)
    runs.start(
        "save-resume", save_resume, after="save", prepare=copy, stage="single_gpu", args=args
    )
    for name, (stage, fault, *_) in DEAD_RANKS.items():  # FAULT_ONCE's file: when the rank died
        cwd = folder(name)
        env = stage_env(FAULT_AT=fault, FAULT_ONCE=str(cwd / "died"), EXIT_WORKERS=str(cwd))
        workers = ["--workers", 2] if stage == "multigpu_torchrun" else []  # test_faults.py
        runs.start(name, cwd, stage=stage, args=[2, 1, *workers], env=env)
    for stage in ("multigpu", "multigpu_torchrun"):  # the launcher SIGKILLed (test_faults.py)
        cwd = folder(f"orphans-{stage}")
        runs.submit(f"orphans-{stage}", functools.partial(kill_launcher_after, stage, 2, cwd))
    cwd = folder("orphans-at-start")  # torchrun SIGKILLed as its workers start
    runs.submit(
        "orphans-at-start", functools.partial(kill_launcher_after, "multigpu_torchrun", 0, cwd)
    )
    # Two nodes without shared storage: node 0 has a snapshot, node 1 an unreadable one.
    nodes = folder("node0"), folder("node1")
    write_snapshot(nodes[0] / "snapshot.pt", epoch=2)
    write_bad_snapshot(nodes[1] / "snapshot.pt", "garbage")
    args = [4, 1, "--batch_size", 32]
    runs.start("apart", nodes[0], stage="multinode", args=args, node_cwds=nodes)
    # The same where node 0 has no snapshot: a new run there, and a file node 1 cannot read.
    nodes = folder("fresh0"), folder("fresh1")
    write_bad_snapshot(nodes[1] / "snapshot.pt", "garbage")
    runs.start("apart-fresh", nodes[0], stage="multinode", args=args, node_cwds=nodes)
    # Flags as the walkthroughs write them, 2 loader workers, and at exit (test_faults.py; the
    # torchrun stages end alike): a user's atexit handler and unflushed print in every process,
    # output not a terminal; the loader workers must have ended before the exit functions start.
    # single_gpu.py in bf16; multigpu.py on a folder of PNGs; multinode.py's nodes meet at [::1].
    cwd = folder("images")
    make_image_tree(cwd / "data")
    exit_runs = {
        "single_gpu": [EPOCHS, "--precision", "bf16"],
        "multigpu": [4, "--data_dir", cwd / "data", "--batch_size", 8],
        "multinode": [1],
    }
    for stage, (epochs, *more) in exit_runs.items():
        cwd = folder(f"exit-{stage}")
        env = stage_env(EXIT_HOOKS=str(cwd), EXIT_WORKERS=str(cwd))
        if stage == "multigpu":  # another program tries to take the launcher's port
            env["TAKE_PORT"] = str(cwd)
        host = "[::1]" if stage == "multinode" else "127.0.0.1"
        args = ["--total_epochs", epochs, "--save_every", epochs, "--workers", 2, *more]
        runs.start(f"exit-{stage}", cwd, stage=stage, args=args, env=env, host=host)
    # The CIFAR-10 flags on coloured squares; 96 = 5 x 19 + 1: the last batch, of one sample, is
    # left out (ResNet-18's BatchNorm cannot train on it).
    cwd = folder("cifar-flags")
    make_image_tree(cwd / "data")
    cifar = ["--arch", "resnet18", "--augment", "crop+flip", "--batch_size", 19]
    args = [2, 2, "--data_dir", cwd / "data", *cifar]
    runs.start("cifar-flags", cwd, stage="single_gpu", args=args)
    # RegNet, which the meta device cannot build, under fsdp.py on two nodes (test_stages.py).
    args = [1, 1, "--arch", "regnet_x_400mf"]
    runs.start("regnet-fsdp", folder("regnet-fsdp"), stage="fsdp", args=args)
    # The second snapshot cannot be written: a full disk (test_faults.py; the other distributed
    # stages share multinode.py's lines).
    for stage in ("single_gpu", "multinode"):
        env = stage_env(FAULT_SAVE="full", FAULT_SAVE_FROM="2")
        runs.start(
            f"disk-full-{stage}", folder(f"disk-full-{stage}"), stage=stage, args=[2, 1], env=env
        )
    # Bad input, as a user sees it (test_errors.py).
    runs.start("no-torchrun", folder("no-torchrun"), stage="multinode", args=[2, 1], nproc=0)
    cwd = folder("bad-snapshot")
    write_bad_snapshot(cwd / "snapshot.pt", "payload")
    runs.start("bad-snapshot", cwd, stage="multigpu", args=[2, 1])
    args = [2, 1, "--data_dir", "missing"]
    runs.start("bad-data_dir", folder("bad-data_dir"), stage="multigpu", args=args)
    # A bad flag under torchrun, on two nodes: rank 0 alone says so.
    args = [2, 1, "--lr", "-1"]
    runs.start("bad-flag", folder("bad-flag"), stage="multinode", args=args)
    # The weights turn NaN in the last update before a save: at an epoch's end, on the clock, at a
    # stop; and a NaN loss far from any save (test_faults.py, DIVERGED).
    restart = ("--max-restarts=1",)
    for (stage, case), faults in DIVERGED.items():
        args = [3, 1, *global_batch_args(stage), "--save_minutes", 1 if case == "clock" else 0]
        name = f"nan-{case}-{stage}"
        runs.start(name, folder(name), stage=stage, args=args, env=stage_env(**faults))
    # Two nodes whose snapshots have the same size, epoch and samples, and another content: node
    # 1's is a stale copy, another save of the same epoch (each save draws its own id).
    nodes = folder("stale0"), folder("stale1")
    write_snapshot(nodes[0] / "snapshot.pt", epoch=2, id=bytes(8))
    write_snapshot(nodes[1] / "snapshot.pt", epoch=2, id=bytes([1] * 8))
    stale = bytearray((nodes[1] / "snapshot.pt").read_bytes())
    stale[len(stale) // 2] ^= 1  # and a bit of a weight
    (nodes[1] / "snapshot.pt").write_bytes(stale)
    runs.start("stale", nodes[0], stage="multinode", args=[4, 1], node_cwds=nodes)
    # Rank 1 stops answering after step 15 (SIGSTOP), once; every timeout a tenth (30 s, and
    # 3 minutes for a save): torchrun --max-restarts=1 restarts the job (test_faults.py).
    cwd = folder("hung")
    hang = {"FAULT_HANG_AT": "1:15", "FAULT_ONCE": str(cwd / "hung"), "FAULT_TIMEOUT_SCALE": "0.1"}
    args = [EPOCHS, 1, *global_batch_args("multigpu_torchrun")]
    env = stage_env(**hang, **RESTARTS_ENV)
    runs.start("hung", cwd, stage="multigpu_torchrun", args=args, env=env, torchrun_args=restart)
    # The same at an epoch's end: rank 1 stops once the figures of epoch 1 are summed, before the
    # save, and the output is read as it comes (the seconds from the epoch's line to the timeout).
    cwd = folder("hung-save")
    hang = {"FAULT_HANG_AT": "1:figures", "FAULT_ONCE": str(cwd / "hung")}
    env = stage_env(**hang, FAULT_TIMEOUT_SCALE="0.1", **RESTARTS_ENV)
    job = functools.partial(launch_timed, "multigpu_torchrun", args, cwd, env=env,
                            torchrun_args=restart)  # fmt: skip
    runs.submit("hung-save", lambda cwd=cwd, job=job: (cwd, job()))
    # A save that takes 45 s, longer than a training collective may wait (the same tenth: 30 s).
    env = stage_env(FAULT_SAVE="slow:45", FAULT_TIMEOUT_SCALE="0.1")
    runs.start("slow-save", folder("slow-save"), stage="multigpu", args=[1, 1], env=env)
    # A stop signal to rank 1 alone under --max-restarts: every rank stops and saves, and torchrun
    # restarts the job, which resumes there and ends on the uninterrupted model.
    cwd = folder("stop-restarts")
    once = str(cwd / "signalled")
    env = stage_env(FAULT_SIGNAL="SIGTERM:step:13", FAULT_SIGNAL_RANK="1", FAULT_ONCE=once)
    env.update(RESTARTS_ENV)
    args = [EPOCHS, 1, *global_batch_args("multigpu_torchrun")]
    runs.start("stop-restarts", cwd, stage="multigpu_torchrun", args=args, env=env,
               torchrun_args=restart)  # fmt: skip
    # Stopped after step 13 on one number of processes and resumed on another, with the global
    # batch kept (64): 2 processes x 32, then 1 x 32 x 2 micro-batches, and the reverse.
    two, one = ["--batch_size", 32], ["--batch_size", 32, "--grad_accum", 2]
    for name, (first, then) in {"2to1": ((2, two), (1, one)), "1to2": ((1, one), (2, two))}.items():
        cwd = folder(f"ranks-{name}")
        env = stage_env(FAULT_SIGNAL="SIGTERM:step:13")
        runs.start(f"ranks-{name}", cwd, stage="multigpu_torchrun", args=[EPOCHS, 1, *first[1]],
                   nproc=first[0], env=env)  # fmt: skip
        runs.start(f"ranks-{name}-resumed", cwd, after=f"ranks-{name}", stage="multigpu_torchrun",
                   args=[EPOCHS, 1, *then[1]], nproc=then[0])  # fmt: skip
    if not narrowed(request.config):  # the floor's tests read only FLOOR_RUNS
        floor = all(item.get_closest_marker("floor") for item in request.session.items)
        runs.prefetch(FLOOR_RUNS if floor else None)
    yield runs
    runs.pool.shutdown()


@pytest.fixture(scope="session", autouse=True)
def slow_runs(request, tmp_path_factory):
    """The slow suite's launches: each module with a selected slow test defines its own
    (`queue_slow_runs`), and they start as the session starts, so that they share the cores with
    the Slurm jobs, unless the user picked tests by name (`narrowed`). 1.5 a core: the stops they
    time must not wait long for a core. {name: result} (see Runs)."""
    runs = Runs(per_core=1.5)
    modules = {item.module for item in request.session.items if item.get_closest_marker("slow")}
    for module in sorted(modules, key=lambda m: (m.__name__ != "test_slurm", m.__name__)):
        if hasattr(module, "queue_slow_runs"):
            module.queue_slow_runs(runs, tmp_path_factory.mktemp(module.__name__))
    if not narrowed(request.config):
        runs.prefetch()
    yield runs
    runs.pool.shutdown(cancel_futures=True)


# The floor suite (tests/floor.sh: -m floor, on the oldest torch that requirements.txt allows):
# the tests whose outcome depends on torch's version, as they run the stages' distributed
# machinery (DDP and its accumulation, FSDP, torchrun's restarts, a resume in another stage, the
# exit path). A test named alone is marked in all its cases. FLOOR_RUNS: the runs they read, which
# start side by side as such a session starts; a run they read that is not listed would start
# only when read, alone.
FLOOR_TESTS = {
    # test_stages.py
    "test_learns_and_logs_global_figures",
    "test_learning_rate_decays_to_zero_alike_in_every_stage",
    "test_same_model_at_every_scale",
    "test_gradient_accumulation_gives_the_same_model[accumulate]",
    "test_gradient_accumulation_gives_the_same_model[accumulate-fsdp]",
    "test_bf16_learns",
    "test_snapshot_is_plain_and_loads_safely",
    "test_each_epoch_trains_in_a_new_order",
    "test_ranks_see_disjoint_shards",
    "test_elastic_restart_resumes_exactly",
    "test_snapshot_resumes_in_another_stage",
    "test_distributed_stage_trains_on_an_image_folder",
    "test_a_long_epoch_says_how_far_it_is",
    "test_speed_counts_what_this_start_trained",
    "test_saves_on_the_clock_every_save_minutes",
    "test_snapshots_are_saved_every_save_every_epochs",
    "test_a_rank_whose_launcher_died_stops_and_saves",
    "test_a_moment_or_loss_not_finite_is_never_saved",
    "test_the_optimizer_implementation_comes_from_the_machine",
    "test_a_process_on_a_gpu_node_takes_its_own_gpu_and_nccl",
    "test_each_step_takes_the_scheduled_learning_rate",
    "test_bf16_evaluates_as_it_trains",
    "test_ddp_averages_the_gradients_once_a_step",
    "test_deterministic_asks_for_deterministic_kernels",
    "test_each_rank_and_step_draws_its_own_dropout",
    "test_flags_as_the_walkthroughs_write_them",
    "test_the_legacy_launcher_trains",
    "test_nodes_meet_at_an_ipv6_endpoint",
    "test_fsdp_says_its_units",
    "test_fsdp_groups_the_repeated_blocks_into_a_few_units",
    "test_fsdp_keeps_every_buffer",
    "test_fsdp_accumulates_gradients_at_a_ranks_share",
    "test_fsdp_trains_a_batchnorm_model_in_bf16",
    "test_fsdp_cuts_a_block_into_parts_it_calls",
    "test_fsdp_evaluates_every_held_out_image_once",
    # test_faults.py
    "test_a_dead_rank_ends_the_job[torchrun-raise]",
    "test_the_launchers_port_stays_its_own",
    "test_user_exit_code_runs_in_every_process",
    "test_loader_workers_end_before_the_exit_functions",
    "test_an_error_in_a_step_ends_the_loader_workers_at_once",
    "test_a_crash_without_a_signal_costs_minutes_and_a_diverged_run_is_never_saved[fsdp]",
    "test_gradients_are_clipped_by_the_global_norm_of_the_step[multigpu_torchrun]",
    "test_gradients_are_clipped_by_the_global_norm_of_the_step[fsdp]",
    "test_nothing_non_finite_is_saved[fsdp-stop]",
    "test_nothing_non_finite_is_saved[multinode-loss]",
    "test_a_rank_that_stops_answering_ends_the_job_and_torchrun_restarts_it",
    "test_a_stop_to_one_worker_under_restarts_is_restarted_and_ends_exactly",
    "test_a_rank_that_stops_answering_at_a_save_ends_the_job_in_minutes",
    "test_fsdp_saves_and_loads_adamws_state_for_any_grouping",
    # test_errors.py
    "test_a_bad_flag_under_torchrun_is_said_once",
    "test_a_rank_that_refuses_a_snapshot_leaves_the_process_group",
}
FLOOR_RUNS = {
    *(f"reference-{stage}" for stage in STAGES),
    *("accumulate", "accumulate-fsdp", "elastic-multigpu_torchrun", "elastic-multinode"),
    *("cross", "cross-fsdp", "exit-single_gpu", "exit-multigpu", "exit-multinode"),
    *("error-single_gpu", "torchrun-raise", "periodic-fsdp", "periodic-resume-fsdp"),
    *("clip-single_gpu", "clip-multigpu_torchrun", "clip-fsdp"),
    *("nan-stop-fsdp", "nan-loss-multinode", "hung", "hung-save", "stop-restarts"),
    "bad-flag",
}


def pytest_collection_modifyitems(items):
    """The floor tests marked `floor`. The Slurm tests first (their jobs run one after another:
    the longest chain); last, once every other launch has ended, the time-limit jobs and then the
    speed measures."""
    for item in items:
        if item.name in FLOOR_TESTS or item.originalname in FLOOR_TESTS:
            item.add_marker("floor")
    items.sort(key=lambda item: (item.get_closest_marker("quiet") is not None,
                                 item.module.__name__ != "test_slurm"))  # fmt: skip


@pytest.fixture(scope="session")
def reference_runs(runs) -> dict:
    """{stage: (folder, Run)} of the five reference runs."""
    for stage in STAGES:  # side by side, also where runs start only as the tests read them
        runs.started(f"reference-{stage}")
    for stage in STAGES:
        assert runs[f"reference-{stage}"][1].returncode == 0, runs[f"reference-{stage}"][1].output
    return {stage: runs[f"reference-{stage}"] for stage in STAGES}


@pytest.fixture(scope="session", autouse=True)
def _slurm_in_background(request):
    """Bring up the Slurm cluster and submit the batch files as the session starts, so that the
    jobs share the machine with the other tests. Only when a Slurm test was collected; the four
    batch files only when their test was. Yields (cluster environment, jobs) futures."""
    items = [item.nodeid for item in request.session.items]
    if not any(nodeid.startswith("tests/test_slurm.py") for nodeid in items):
        yield None
        return
    import slurm_cluster

    reason = slurm_cluster.missing_requirement()
    if reason:
        yield reason
        return
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))  # munged wants o+x on every parent
    pool = ThreadPoolExecutor(max_workers=1)
    cluster = pool.submit(slurm_cluster.start, root)
    wanted = any("test_sbatch_file_runs" in nodeid for nodeid in items)
    jobs = pool.submit(lambda: slurm_cluster.submit_all(cluster.result(), root) if wanted else {})
    try:
        yield cluster, jobs
    finally:
        jobs.exception()  # wait for the jobs, then stop the daemons even when a test failed
        pool.shutdown()
        slurm_cluster.stop(root)
        shutil.rmtree(root, ignore_errors=True)


def slurm_futures(background) -> tuple:
    """(cluster, jobs) futures; skipped (in CI: failed) without Slurm or root."""
    if isinstance(background, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {background}")
        pytest.skip(background)
    return background


@pytest.fixture
def slurm_jobs(_slurm_in_background) -> dict:
    """{stage: (folder, sbatch result, job log)} of the four batch files, run with 1 1."""
    return slurm_futures(_slurm_in_background)[1].result()


@pytest.fixture
def slurm_env(_slurm_in_background) -> dict:
    """The environment in which Slurm's commands reach the test cluster."""
    return slurm_futures(_slurm_in_background)[0].result()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skipped test is a failed one: nothing may silently not run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI: {report.longrepr}"
