"""Where the console's backlog goes past its memory bound: an unlinked file on the controller's disk.

A reader of ``launch``'s stdout (a pipe, ``--json``) gets every line, however slowly it reads. Held
in memory, a flood into a slow reader would grow the controller without bound. Past
``Dispatcher.MAX_BACKLOG_BYTES`` the events the console has not shown yet (rank lines and metrics;
a run of them at a time) are appended here instead, and the console
catches up from the file, one record at a time, in order. The controller itself never waits: it
keeps draining the agents at full speed, so heartbeats, exits and the job's own files are never held
back by the reader (and the agents never stall on a full connection).

The file is created unlinked (``tempfile.TemporaryFile``: 0600, gone when closed or when hgtrain
dies) in the state directory, not ``/tmp``, which may be memory (tmpfs). It is emptied whenever the
console has caught up. A record: two little-endian uint32 lengths, a JSON header, a payload (a
``LogLines`` batch's bytes; nothing for a metric).
"""
from __future__ import annotations

import json
import os
import struct
import tempfile

from .events import LogLines, Metric

LENGTHS = struct.Struct("<II")


class SpillFile:
    """One writer (the controller's thread) appends, one reader (the console's thread) reads by
    position; the Dispatcher's lock orders ``reset`` against both."""

    def __init__(self, directory: str | None = None) -> None:
        self._file = tempfile.TemporaryFile(dir=directory)
        self._fd = self._file.fileno()
        self.end = 0   # bytes written

    def append(self, event: LogLines | Metric) -> None:
        if isinstance(event, LogLines):
            header = {"k": "log", "job_id": event.job_id, "rank": event.rank, "node": event.node,
                      "role": event.role, "stream": event.stream, "partial": event.partial}
            payload = event.data
        else:
            header = {"k": "metric", "job_id": event.job_id, "rank": event.rank, "node": event.node,
                      "role": event.role, "data": event.data}
            payload = b""
        head = json.dumps(header, default=str).encode()
        self._write(LENGTHS.pack(len(head), len(payload)) + head)
        self._write(payload)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, self.end)
            self.end += n
            view = view[n:]

    def read(self, pos: int) -> tuple[LogLines | Metric, int]:
        """The record at ``pos`` and the position after it."""
        head_len, payload_len = LENGTHS.unpack(self._read(pos, LENGTHS.size))
        pos += LENGTHS.size
        header = json.loads(self._read(pos, head_len))
        pos += head_len
        if header["k"] == "metric":
            return Metric(header["job_id"], header["rank"], header["node"], header["role"], header["data"]), pos
        payload = self._read(pos, payload_len)
        return (LogLines(header["job_id"], header["rank"], header["node"], header["role"], header["stream"],
                         payload, header["partial"]), pos + payload_len)

    def _read(self, pos: int, size: int) -> bytes:
        parts = []
        while size:
            data = os.pread(self._fd, size, pos)
            if not data:
                raise EOFError(f"the console's spill file ends at {pos}")
            parts.append(data)
            pos += len(data)
            size -= len(data)
        return b"".join(parts)

    def reset(self) -> None:
        """Everything was read: start again at 0 (the disk space is given back)."""
        os.ftruncate(self._fd, 0)
        self.end = 0

    def close(self) -> None:
        self._file.close()
