"""Fault injection and recording for the test suite: every Python process whose PYTHONPATH
names this folder loads it. It does nothing unless one of these variables is set, so the scripts
themselves carry no test hooks:
  FAULT_AT=raise|kill:RANK:EPOCH  that rank raises, or SIGKILLs itself, as it starts that epoch
                                  (0-based)
  FAULT_ONCE=PATH                 ...only if PATH does not exist yet (it is created first), so a
                                  restart runs clean (FAULT_AT, FAULT_HANG_AT, FAULT_SIGNAL)
  SAVE_KILL_AT=N                  the N-th torch.save of a process writes half the snapshot, then
                                  SIGKILLs itself
  KEEP_SNAPSHOTS=1                after each atomic rename, copy the snapshot to PATH.epochN
  RECORD_DIR=DIR                  write the sample indices each rank trains on, an epoch's
                                  order a file (numbered as the process starts them), and
                                  those it evaluates
  EXIT_HOOKS=DIR                  as a user's code would: print a line without flushing it, and
                                  register an atexit handler that writes DIR/atexit-PID
  EXIT_WORKERS=DIR                write DIR/workers-PID: the loader workers alive, and the time,
                                  as the exit functions start
  FAULT_SAVE=slow:SECONDS|full    every torch.save waits SECONDS before it writes, or writes part
                                  of the file and fails as a full disk does...
  FAULT_SAVE_FROM=N               ...from the N-th save of the process on (1)
  FAULT_SIGNAL=NAME:WHEN          rank 0 sends itself signal NAME once: WHEN is step:N (after its
                                  N-th optimizer step) or save (as its first save starts)
  TAKE_PORT=DIR                   as rank 0 starts its process group, another program takes
                                  MASTER_PORT if it can: it writes DIR/port-taken or DIR/port-held
  RECORD_THREADS=DIR              at exit, write DIR/threads-PID: torch's intra-op threads
  RECORD_MEMORY=DIR               at exit, write DIR/memory-RANK: a rank's resident memory
                                  in KiB as main() starts (its first torch.manual_seed, models
                                  imported) and as its process group starts, then its peak
  FAULT_STEP_SLEEP=SECONDS        every optimizer step takes that much longer (a slow GPU), so
                                  that a signal sent during an epoch arrives before its end
  FAULT_STEP_CLOCK=SECONDS        every optimizer step moves the process's time.monotonic() on by
                                  that much (a long epoch, quickly)...
  FAULT_CLOCK_RANK=R              ...in rank R alone (its clock runs ahead of the others')
  FAULT_STEP_RAISE=N              rank 0 raises after its N-th optimizer step (an error in a step)
  FAULT_STEP_NAN=N                after its N-th optimizer step, every process sets its weights
                                  to NaN (a run that diverged); epoch:E: after the first step of
                                  epoch E (0-based), at every start (a run that diverges again)
  FAULT_SIGNAL_RANK=R             FAULT_SIGNAL's rank: R, not 0 (one node's processes signalled)
  FAULT_TIMEOUT_SCALE=F           every process group's timeout, as the stage asks for it, times F
                                  (a hang found in seconds, not minutes)
  FAULT_HANG_AT=RANK:STEP         after its STEP-th optimizer step, that rank stops itself with
                                  SIGSTOP (a read that never returns); with FAULT_ONCE, only once;
                                  STEP "figures": once the first epoch's figures are summed
"""

import os

if os.environ.get("EXIT_HOOKS"):
    import atexit

    print(f"unflushed line from {os.getpid()}")  # stdout is a pipe: it waits in the buffer
    _marker = os.path.join(os.environ["EXIT_HOOKS"], f"atexit-{os.getpid()}")
    atexit.register(lambda: open(_marker, "w").close())

if os.environ.get("EXIT_WORKERS"):
    import atexit

    def _count_workers() -> None:
        """Registered once the first loader has started its workers, so it runs before every
        exit function registered until then: the loader workers still alive as they start."""
        import multiprocessing
        import time

        alive = [p for p in multiprocessing.active_children() if p.daemon]
        with open(os.path.join(os.environ["EXIT_WORKERS"], f"workers-{os.getpid()}"), "w") as f:
            f.write(f"{len(alive)} {time.time()}")

    from torch.utils.data import DataLoader

    _iterate = DataLoader.__iter__

    def _iterate_and_watch(self):
        batches = _iterate(self)
        if self.num_workers and not hasattr(DataLoader, "watched_by_tests"):
            DataLoader.watched_by_tests = True
            atexit.register(_count_workers)
        return batches

    DataLoader.__iter__ = _iterate_and_watch

if os.environ.get("TAKE_PORT"):
    import socket

    import torch.distributed as dist

    _init_process_group = dist.init_process_group
    _taken = []  # the other program's socket, kept open while the run starts

    def init_process_group(*args, **kwargs):
        """As a program that binds the port between the launcher's choice and rank 0's store."""
        if kwargs.get("rank") == 0:
            other = socket.socket()
            try:
                other.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
                other.listen()
                _taken.append(other)
                result = "taken"
            except OSError:
                result = "held"
            open(os.path.join(os.environ["TAKE_PORT"], f"port-{result}"), "w").close()
        return _init_process_group(*args, **kwargs)

    dist.init_process_group = init_process_group

if os.environ.get("RECORD_THREADS"):
    import atexit

    def _record_threads() -> None:
        import torch

        path = os.path.join(os.environ["RECORD_THREADS"], f"threads-{os.getpid()}")
        with open(path, "w") as f:
            f.write(str(torch.get_num_threads()))

    atexit.register(_record_threads)

if os.environ.get("RECORD_MEMORY") and "RANK" in os.environ:  # the ranks, not torchrun itself
    import atexit
    import resource

    import torch
    import torch.distributed
    import torchvision.models  # noqa: F401 (imported before the first figure)

    _manual_seed = torch.manual_seed
    _init_group = torch.distributed.init_process_group
    _figures = []

    def _resident() -> int:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])

    def manual_seed(seed):
        if not _figures:
            _figures.append(_resident())
        return _manual_seed(seed)

    def init_group(*args, **kwargs):
        _figures.append(_resident())
        return _init_group(*args, **kwargs)

    def _record_memory() -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(
            os.path.join(os.environ["RECORD_MEMORY"], f"memory-{os.environ['RANK']}"), "w"
        ) as f:
            f.write(" ".join(map(str, [*_figures, peak])))

    torch.manual_seed = manual_seed
    torch.distributed.init_process_group = init_group
    atexit.register(_record_memory)

if os.environ.get("FAULT_STEP_SLEEP"):
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda *_: time.sleep(float(os.environ["FAULT_STEP_SLEEP"])))

if os.environ.get("FAULT_STEP_CLOCK"):
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _monotonic, _ahead = time.monotonic, [0.0]
    time.monotonic = lambda: _monotonic() + _ahead[0]

    def _advance_clock(*_) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == int(os.environ.get("FAULT_CLOCK_RANK", rank)):
            _ahead[0] += float(os.environ["FAULT_STEP_CLOCK"])

    register_optimizer_step_post_hook(_advance_clock)

if os.environ.get("FAULT_STEP_RAISE"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _raise_steps = [0]

    def _raise_after_step(*_) -> None:
        import torch.distributed as dist

        _raise_steps[0] += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and _raise_steps[0] == int(os.environ["FAULT_STEP_RAISE"]):
            raise RuntimeError("injected failure in a step")

    register_optimizer_step_post_hook(_raise_after_step)

if os.environ.get("FAULT_STEP_NAN"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _nan_steps = [0]
    _nan_epoch = [None]  # FAULT_STEP_NAN=epoch:E: the epoch that runs now
    if os.environ["FAULT_STEP_NAN"].startswith("epoch:"):
        from torch.utils.data.distributed import DistributedSampler

        _set_epoch_for_nan = DistributedSampler.set_epoch

        def _note_epoch(self, epoch):
            _nan_epoch[0] = epoch
            return _set_epoch_for_nan(self, epoch)

        DistributedSampler.set_epoch = _note_epoch

    def _nan_after_step(optimizer, *_) -> None:
        import torch

        _nan_steps[0] += 1
        when = os.environ["FAULT_STEP_NAN"]
        first_of_epoch = when == f"epoch:{_nan_epoch[0]}"
        if first_of_epoch:
            _nan_epoch[0] = None  # once in that epoch
        if first_of_epoch or str(_nan_steps[0]) == when:
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.fill_(float("nan"))

    register_optimizer_step_post_hook(_nan_after_step)

if os.environ.get("FAULT_TIMEOUT_SCALE"):
    from datetime import timedelta

    import torch.distributed as dist

    def _scaled(function):
        def scaled(*args, timeout: timedelta, **kwargs):
            return function(
                *args, timeout=timeout * float(os.environ["FAULT_TIMEOUT_SCALE"]), **kwargs
            )

        return scaled

    dist.init_process_group = _scaled(dist.init_process_group)
    dist.new_group = _scaled(dist.new_group)

if os.environ.get("FAULT_HANG_AT"):
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _hang_rank, _hang_when = os.environ["FAULT_HANG_AT"].split(":")
    _hang_steps = [0]

    def _hang(rank: int) -> None:
        marker = os.environ.get("FAULT_ONCE", "")
        if rank == int(_hang_rank) and not (marker and os.path.exists(marker)):
            if marker:
                open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)

    if _hang_when == "figures":  # after the first epoch's figures (4 float64 numbers) are summed
        import torch
        import torch.distributed as dist

        _all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            work = _all_reduce(tensor, *args, **kwargs)
            if tensor.dtype == torch.float64 and tensor.numel() == 4:
                _hang(dist.get_rank())
            return work

        dist.all_reduce = all_reduce

    def _hang_after_step(*_) -> None:
        import torch.distributed as dist

        _hang_steps[0] += 1
        if str(_hang_steps[0]) == _hang_when:
            _hang(dist.get_rank())

    register_optimizer_step_post_hook(_hang_after_step)

HOOKS = ("FAULT_AT", "SAVE_KILL_AT", "KEEP_SNAPSHOTS", "RECORD_DIR", "FAULT_SAVE")
if any(key.startswith(HOOKS) for key in os.environ) or os.environ.get("FAULT_SIGNAL"):
    import io
    import json
    import shutil
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Subset
    from torch.utils.data.distributed import DistributedSampler

    def _rank() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    if os.environ.get("FAULT_AT"):
        _action, _rank_at, _epoch_at = os.environ["FAULT_AT"].split(":")
        _set_epoch = DistributedSampler.set_epoch

        def set_epoch(self, epoch):
            marker = os.environ.get("FAULT_ONCE", "")
            if (
                _rank() == int(_rank_at)
                and epoch == int(_epoch_at)
                and not (marker and os.path.exists(marker))
            ):
                if marker:
                    open(marker, "w").close()
                if _action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure on rank {_rank()}")
            return _set_epoch(self, epoch)

        DistributedSampler.set_epoch = set_epoch

    if os.environ.get("SAVE_KILL_AT"):
        _save, _saves = torch.save, [0]

        def save(obj, f, *args, **kwargs):
            _saves[0] += 1
            if _saves[0] < int(os.environ["SAVE_KILL_AT"]):
                return _save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            _save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = save

    if os.environ.get("KEEP_SNAPSHOTS"):
        _replace = os.replace

        def replace(src, dst, *args, **kwargs):
            _replace(src, dst, *args, **kwargs)
            if str(src).endswith(".tmp"):
                epoch = torch.load(dst, weights_only=True)["epoch"]
                shutil.copyfile(dst, f"{dst}.epoch{epoch}")

        os.replace = replace

    if os.environ.get("RECORD_DIR"):
        from torch.utils.data import RandomSampler

        _loader_init, _epochs = DataLoader.__init__, [0]

        def recording(sampler_iter):
            """A sampler's __iter__ that also writes the order it gives (single_gpu.py's
            RandomSampler, or a rank's DistributedSampler), numbered as the epochs start."""

            def sampler_iter_and_record(self):
                indices = list(sampler_iter(self))
                name = f"train-rank{_rank()}-epoch{_epochs[0]}.json"
                with open(os.path.join(os.environ["RECORD_DIR"], name), "w") as f:
                    json.dump(indices, f)
                _epochs[0] += 1
                return iter(indices)

            return sampler_iter_and_record

        def loader_init(self, dataset, *args, **kwargs):
            if kwargs.get("sampler") is None and isinstance(dataset, Subset):
                with open(
                    os.path.join(os.environ["RECORD_DIR"], f"val-rank{_rank()}.json"), "w"
                ) as f:
                    json.dump(list(dataset.indices), f)
            _loader_init(self, dataset, *args, **kwargs)

        DistributedSampler.__iter__ = recording(DistributedSampler.__iter__)
        RandomSampler.__iter__ = recording(RandomSampler.__iter__)
        DataLoader.__init__ = loader_init

    if os.environ.get("FAULT_SIGNAL"):
        _name, _when, *_at_step = os.environ["FAULT_SIGNAL"].split(":")
        _sent = []

        def send(when: str) -> None:
            marker = os.environ.get("FAULT_ONCE", "")
            if (
                when == _when
                and _rank() == int(os.environ.get("FAULT_SIGNAL_RANK", 0))
                and not _sent
                and not (marker and os.path.exists(marker))
            ):
                if marker:
                    open(marker, "w").close()
                _sent.append(time.time())
                os.kill(os.getpid(), signal.Signals[_name])

        _steps = [0]

        def after_step(optimizer, args, kwargs) -> None:
            _steps[0] += 1
            if _at_step and _steps[0] == int(_at_step[0]):
                send("step")

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(after_step)
    else:

        def send(when: str) -> None:
            pass

    if os.environ.get("FAULT_SAVE") or os.environ.get("FAULT_SIGNAL"):
        import errno

        _save_slowly, _saves_begun = torch.save, [0]

        def save_slowly(obj, f, *args, **kwargs):
            send("save")
            _saves_begun[0] += 1
            how, _, seconds = os.environ.get("FAULT_SAVE", "").partition(":")
            if _saves_begun[0] < int(os.environ.get("FAULT_SAVE_FROM", 1)):
                how = ""
            if how == "slow":
                time.sleep(float(seconds))
            if how != "full":
                return _save_slowly(obj, f, *args, **kwargs)
            f.write(b"part of a snapshot")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        torch.save = save_slowly
