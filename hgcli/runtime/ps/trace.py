"""A PS shard's trace file (``python -m hgcli.runtime.ps --trace FILE``): one JSON line per event
(seed, push, release, checkpoint, end), for debugging a job's staleness by hand."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class Trace:
    """Appends a shard's events to its trace file; does nothing without one. Callable as
    ``trace(event, **fields)``. Its own lock, since the checkpoint writer's thread and the RPC
    threads both write, not all under the shard's condition."""

    def __init__(self, shard: int, path: Path | None) -> None:
        self.shard = shard
        self._fh = open(path, "a", encoding="utf-8") if path else None
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        """Whether events are written (a trace file was asked for)."""
        return self._fh is not None

    def __call__(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        line = json.dumps({"event": event, "shard": self.shard, "t": time.time(), **fields}) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
