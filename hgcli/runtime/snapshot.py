"""Training-state snapshots of an all-reduce job, so a restart (``launch --restarts``, ``--nnodes``)
resumes where the job was instead of at step 0, without code in the script.

Under a plan without parameter servers every worker holds the whole state, so the first worker of
each node writes one: a lost node takes only its own copy with it, and every node left can resume
from its local file. A snapshot holds the model's state dict, the optimizer's, the scheduler's
(``ctx.wrap(..., scheduler=)``), the data position of ``ctx.sampler``/``ctx.loader``, the group's
step and the samples it had trained. It is taken after ``opt.step()`` at the end of an accumulation
window, every ``every`` steps or ``seconds`` seconds (``launch --checkpoint-every/--checkpoint-seconds``).

Asynchronous: the step only waits for a copy of the tensors to host memory; a thread writes the file
(``state.atomic_write``: a kill leaves the old file or the new one). A snapshot due while the last one
is still being written is skipped rather than waited for. File ``snapshot-s{step:010d}.pt``; the newest
``KEEP`` are kept. The launcher lists the steps on each node (``steps_in``, no torch) and names the step
to resume, the newest on any node (``HGTRAIN_RESUME_STEP``); a rank on a node without that file (one
that joined at this restart) gets it from the first rank that has it.

An fsdp group's snapshot is a directory ``snapshot-s{step:010d}.dcp`` of torch's distributed
checkpoint, every rank writing its own shards (sharded_snapshots.py); ``steps_in`` lists both kinds.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

FORMAT = "hgtrain-snapshot/1"
KEEP = 2
_NAME = re.compile(r"^snapshot-s(\d{10})\.(?:pt|dcp)$")


def snapshot_path(directory: Path, step: int) -> Path:
    return directory / f"snapshot-s{step:010d}.pt"


def dcp_path(directory: Path, step: int) -> Path:
    """An fsdp group's snapshot of ``step``: a distributed checkpoint's directory."""
    return directory / f"snapshot-s{step:010d}.dcp"


def steps_in(directory: Path) -> list[int]:
    """The steps of the complete (renamed) snapshots in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for e in directory.iterdir() if (m := _NAME.match(e.name)))


def load(directory: Path, step: int) -> dict[str, Any]:
    """The snapshot of ``step``; ValueError naming the file when it is not one."""
    import pickle
    import zipfile

    import torch

    path = snapshot_path(directory, step)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, pickle.UnpicklingError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable snapshot ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("step") != step:
        raise ValueError(f"{path}: not a {FORMAT} file of step {step}")
    return data


def _to_host(value: Any) -> Any:
    """A copy of ``value`` whose tensors are on the CPU and detached (dicts, lists, tuples walked)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class Snapshotter:
    """Takes the snapshots of one rank (the first worker of its node) on the step's clock."""

    def __init__(self, directory: Path, *, every: int = 0, seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.every = max(0, every)
        self.seconds = max(0.0, seconds)
        self.clock = clock
        self._last_at = clock()
        self._last_step = 0
        self._writer: threading.Thread | None = None
        self.error: str | None = None      # the last write's failure, said once at the end
        self.taken = 0
        self.skipped = 0                   # due while the previous one was still being written
        self._written: list[int] = []      # steps whose file is complete, not yet reported

    @property
    def enabled(self) -> bool:
        return bool(self.every or self.seconds)

    def start_at(self, step: int) -> None:
        """A resumed job counts its clock from the step it resumed at."""
        self._last_step = step
        self._last_at = self.clock()

    def due(self, step: int) -> bool:
        if self.every and step - self._last_step >= self.every:
            return True
        return bool(self.seconds) and self.clock() - self._last_at >= self.seconds

    def take(self, step: int, state: dict[str, Any]) -> bool:
        """Copy ``state`` to host memory now and write it in the background; False when skipped."""
        self._last_step, self._last_at = step, self.clock()
        if self._writer is not None and self._writer.is_alive():
            self.skipped += 1
            return False
        copied = {"format": FORMAT, "step": step, **_to_host(state)}
        self._writer = threading.Thread(target=self._write, args=(step, copied), name="hgtrain-snapshot",
                                        daemon=True)
        self._writer.start()
        self.taken += 1
        return True

    def _write(self, step: int, data: dict[str, Any]) -> None:
        import torch

        from ..state import atomic_write, make_private_dirs

        def write(fh: BinaryIO) -> None:
            torch.save(data, fh)

        try:
            make_private_dirs(self.directory)     # 0700 whatever the umask
            atomic_write(snapshot_path(self.directory, step), write, mode=0o600)
            for old in steps_in(self.directory)[:-KEEP]:
                snapshot_path(self.directory, old).unlink(missing_ok=True)
            self._written.append(step)     # one append from this thread: the step's reader takes it
        except OSError as exc:
            self.error = f"snapshot of step {step} not written to {self.directory}: {exc.strerror or exc}"

    def written(self) -> list[int]:
        """The steps whose file was completed since the last call: only a complete file is worth
        telling the launcher of (a re-grouping stops the ranks and resumes what it was told of)."""
        done, self._written = self._written, []
        return done

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for the write in flight (a snapshot half-taken at the end is worth finishing)."""
        if self._writer is not None:
            self._writer.join(timeout_s)
