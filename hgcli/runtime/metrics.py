"""Structured metrics from a rank to whoever launched it: one JSON object per line on a pipe fd.

The launcher's agent (or localrun) reads HGTRAIN_METRICS_FD. Without it, metrics are dropped, or echoed
to stderr when asked, so a script run by hand stays quiet.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


class MetricsSink:
    def __init__(self, fd: int | None, base: dict[str, Any], *, echo: bool = False) -> None:
        self._fd = fd
        self._base = base
        self._echo = echo
        self._lock = threading.Lock()

    def emit(self, **fields: Any) -> None:
        record = {"time": time.time(), **self._base, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._fd is not None:
                try:
                    os.write(self._fd, line.encode())
                except OSError:
                    # The reader went away (agent stopped): metrics are advisory, training goes on.
                    self._fd = None
            elif self._echo:
                sys.stderr.write(line)
                sys.stderr.flush()
