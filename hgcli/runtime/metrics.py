"""Structured metrics from a rank to whoever launched it: one JSON object per line on a pipe fd.

The launcher's agent (or localrun) reads HGTRAIN_METRICS_FD. Without it, metrics are dropped, or echoed
to stderr when asked, so a script run by hand stays quiet. hgtrain's own records go through ``record``
(typed: schema/records.py), a script's through ``emit`` (``ctx.log``), which refuses hgtrain's kinds.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from .errors import TrainingError
from ..schema.records import RuntimeRecord, encode, reserved


class MetricsSink:
    """One rank's end of the metrics pipe: stamps each record with the time and the rank's envelope
    (``base``: rank, role, group) and writes it as one line, whole, whichever thread writes."""

    def __init__(self, fd: int | None, base: dict[str, Any], *, echo: bool = False) -> None:
        self._fd = fd
        self._base = base
        self._echo = echo
        self._lock = threading.Lock()

    def record(self, record: RuntimeRecord) -> None:
        """One of hgtrain's own records."""
        self._write(encode(record))

    def emit(self, **fields: Any) -> None:
        """A script's own record (``ctx.log``): a training step, an evaluation, any figures. Its
        ``event`` may not be one of hgtrain's kinds: the launcher would read it as hgtrain's."""
        refusal = reserved(fields)
        if refusal is not None:
            raise TrainingError(refusal)
        self._write(fields)

    def _write(self, fields: dict[str, Any]) -> None:
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
