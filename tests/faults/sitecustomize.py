"""Fault injection and recording for the test suite: every Python process whose PYTHONPATH
names this folder loads it. It does nothing unless one of these variables is set, so the scripts
themselves carry no test hooks:
  FAULT_AT=raise|kill:RANK:EPOCH  that rank raises, or SIGKILLs itself, as it starts that epoch
                                  (0-based)
  FAULT_ONCE=PATH                 ...only if PATH does not exist yet (it is created first), so a
                                  restart runs clean
  SAVE_KILL_AT=N                  the N-th torch.save of a process writes half the snapshot, then
                                  SIGKILLs itself
  KEEP_SNAPSHOTS=1                after each atomic rename, copy the snapshot to PATH.epochN
  RECORD_DIR=DIR                  write the sample indices each rank trains on and evaluates
  EXIT_HOOKS=DIR                  as a user's code would: print a line without flushing it, and
                                  register an atexit handler that writes DIR/atexit-PID
"""

import os

if os.environ.get("EXIT_HOOKS"):
    import atexit

    print(f"unflushed line from {os.getpid()}")  # stdout is a pipe: it waits in the buffer
    _marker = os.path.join(os.environ["EXIT_HOOKS"], f"atexit-{os.getpid()}")
    atexit.register(lambda: open(_marker, "w").close())

if any(os.environ.get(k) for k in ("FAULT_AT", "SAVE_KILL_AT", "KEEP_SNAPSHOTS", "RECORD_DIR")):
    import io
    import json
    import shutil
    import signal

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
        _iter, _loader_init = DistributedSampler.__iter__, DataLoader.__init__

        def sampler_iter(self):
            indices = list(_iter(self))
            with open(
                os.path.join(
                    os.environ["RECORD_DIR"], f"train-rank{_rank()}-epoch{self.epoch}.json"
                ),
                "w",
            ) as f:
                json.dump(indices, f)
            return iter(indices)

        def loader_init(self, dataset, *args, **kwargs):
            if kwargs.get("sampler") is None and isinstance(dataset, Subset):
                with open(
                    os.path.join(os.environ["RECORD_DIR"], f"val-rank{_rank()}.json"), "w"
                ) as f:
                    json.dump(list(dataset.indices), f)
            _loader_init(self, dataset, *args, **kwargs)

        DistributedSampler.__iter__ = sampler_iter
        DataLoader.__init__ = loader_init
