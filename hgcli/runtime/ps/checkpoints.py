"""When a PS shard checkpoints, the thread that writes its files, and the set it resumes from.

A checkpoint is due every ``every`` versions, or at a version every shard was told to take
(``--checkpoint-seconds``: shard 0 picks one far enough ahead that no shard has passed it). The
state is copied on the writer's thread while the shard counts it as a reader (ps/server.py), so a step
waits for the copy but never for the disk. The file format is ps/files.py's.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import files as checkpoint
from ..errors import TrainingError

Trace = Callable[..., None]


class ShardCheckpoints:
    """When a PS shard checkpoints, the thread that writes its files, and which complete set it resumes
    from."""

    def __init__(self, *, shard: int, shards: int, directory: Path | None, every: int, seconds: float,
                 snapshot: Callable[[dict[str, Any]], dict[str, Any]], read_done: Callable[[], None],
                 saved: Callable[[int, Path], None], trace: Trace) -> None:
        """``snapshot``: the state to write from what was taken under the lock; ``read_done``: the
        copy is made (steps may go on); ``saved``: a file is written; ``trace``: the shard's trace."""
        self.shard = shard
        self.shards = shards
        self.directory = directory
        self.every = every
        self.seconds = seconds
        self._snapshot, self._read_done, self._saved, self._trace = snapshot, read_done, saved, trace
        # The clock of --checkpoint-seconds starts with training (the first seed), not with the process:
        # startup and rendezvous are no work to lose, and a restarted job must not spend its first
        # interval on them before its first checkpoint.
        self.last: float | None = None
        self.scheduled: set[int] = set()
        self.writes: "queue.Queue[tuple[int, dict[str, Any]] | None]" = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, daemon=True)
        self.writer.start()

    def start_clock(self) -> None:
        if self.last is None:
            self.last = time.monotonic()

    def due(self, version: int) -> bool:
        """Whether ``version`` is to be written (the caller then counts a reader and calls ``write``)."""
        if self.directory is None:
            return False
        if (self.every and version % self.every == 0) or version in self.scheduled:
            self.scheduled.discard(version)
            self.last = time.monotonic()
            return True
        return False

    def write(self, version: int, taken: dict[str, Any]) -> None:
        self.writes.put((version, taken))

    def ahead(self, version: int, groups: int) -> int | None:
        """Shard 0 under --checkpoint-seconds: a version for every shard to checkpoint at, when due."""
        if (self.directory is None or self.shard != 0 or not self.seconds or self.scheduled
                or self.last is None or time.monotonic() - self.last < self.seconds):
            return None
        # Shards may differ by up to one push per group; this version is ahead of all of them.
        target = version + groups + 1
        self.scheduled.add(target)
        return target

    def schedule(self, version: int, current: int) -> None:
        if version > current:
            self.scheduled.add(version)

    def _write_loop(self) -> None:
        while (item := self.writes.get()) is not None:
            version, taken = item
            assert self.directory is not None
            try:
                state = self._snapshot(taken)
            finally:
                self._read_done()
            self._saved(version, checkpoint.save(self.directory, self.shard, version, state))

    def close(self) -> None:
        self.writes.put(None)
        self.writer.join()

    def find(self, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The checkpoint to resume from and its version; None when there is none.

        ``version``: the one the launcher chose from every node's files (shards on several nodes
        each keep their own files, so no single directory shows a complete set); without it, the
        newest complete set in this shard's own directory (all shards on one node, ``localrun``)."""
        assert self.directory is not None
        checkpoint.remove_temp_files(self.directory, self.shard)
        if version is None:
            data = self._newest_readable()
            return None if data is None else (int(data["version"]), data)
        try:
            return version, checkpoint.load(self.directory, self.shard, version)
        except (OSError, ValueError) as exc:
            raise TrainingError(f"PS shard {self.shard}: cannot load checkpoint version {version}: "
                                f"{exc}") from None

    def _newest_readable(self) -> dict[str, Any] | None:
        """The newest complete set whose files are all readable: every shard sees the same files
        and makes the same choice, so a corrupt file makes them all fall back to the version
        before (said on stdout, naming the file)."""
        assert self.directory is not None
        for version in checkpoint.complete_versions(self.directory, self.shards):
            why = next((w for s in range(self.shards) if s != self.shard
                        for w in [checkpoint.intact(self.directory, s, version)] if w), None)
            if why is None:
                try:
                    return checkpoint.load(self.directory, self.shard, version)
                except (OSError, ValueError) as exc:
                    why = str(exc)
            print(f"PS shard {self.shard}: checkpoint version {version} is not usable ({why}); "
                  f"trying the one before", flush=True)
            self._trace("resume_skipped", version=version, why=why)
        return None
