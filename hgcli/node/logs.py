"""Rank output: pipe -> node-local file (Capture), then file -> frames (Follower).

The two halves are decoupled on purpose. A Capture thread only ever reads its pipe and appends to
disk, so a rank never blocks on a slow controller and nothing is lost when the link drops (the file
is complete; ``--tail`` can resend it). A Follower reads the file at whatever pace the connection
allows and turns it into frames.

Line rules, shared by live forwarding and ``--tail``:
- a frame carries one line without its ``\\n``; ``offset`` is the file offset just after it, so a
  re-attach can continue exactly there (``--from``);
- a line longer than CHUNK bytes is split; every piece but the last has ``"partial": true``;
- a trailing line without ``\\n`` is held until the stream ends, then sent (``partial`` false); a
  non-follow ``--tail`` of a running job sends it with ``partial`` true;
- bytes that are not UTF-8 are escaped as ``\\xNN`` (Python's backslashreplace); the node-local file
  keeps the exact bytes.
"""
from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

CHUNK = 64 * 1024        # longest piece of a line in one frame
READ_SIZE = 1 << 20      # bytes read from a log file per step
PIPE_READ = 1 << 16


def open_private_append(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


class Capture:
    """One reader thread for one pipe: appends everything to ``path``, wakes its follower."""

    def __init__(self, fd: int, path: Path, name: str) -> None:
        self.path = path
        self.wake = threading.Event()
        self.done = threading.Event()
        self.dropped = 0      # bytes lost because the disk refused them (reported, never silent)
        self._fd = fd
        self._out = open_private_append(path)
        self._thread = threading.Thread(target=self._run, name=f"capture-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                data = os.read(self._fd, PIPE_READ)
                if not data:
                    break
                self._append(data)
                self.wake.set()
        finally:
            os.close(self._fd)
            os.close(self._out)
            self.done.set()
            self.wake.set()

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._out, view):]
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                # Disk full or similar: keep draining the pipe so the rank never blocks.
                self.dropped += len(view)
                return


def split_lines(buf: bytearray, base: int, final: bool) -> Iterator[tuple[bytes, int, bool]]:
    """Take complete lines (and over-long pieces) off the front of ``buf``.

    Yields (piece, offset after it, partial). ``base`` is the file offset of ``buf[0]``. With
    ``final`` the remainder is yielded too, as the end of its line.
    """
    start = 0
    while True:
        nl = buf.find(b"\n", start)
        end = nl if nl >= 0 else len(buf)
        while end - start > CHUNK:
            cut = start + CHUNK
            while cut > start + CHUNK - 3 and (buf[cut] & 0xC0) == 0x80:  # keep UTF-8 sequences whole
                cut -= 1
            yield bytes(buf[start:cut]), base + cut, True
            start = cut
        if nl < 0:
            break
        yield bytes(buf[start:nl]), base + nl + 1, False
        start = nl + 1
    if final and start < len(buf):
        yield bytes(buf[start:]), base + len(buf), False
        start = len(buf)
    del buf[:start]


def text(piece: bytes) -> str:
    return piece.decode("utf-8", "backslashreplace")


def log_frames(rank: int, stream: str) -> Callable[[bytes, int, bool], dict[str, Any] | None]:
    def make(piece: bytes, offset: int, partial: bool) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": "log", "rank": rank, "stream": stream, "line": text(piece),
                                 "offset": offset}
        if partial:
            frame["partial"] = True
        return frame
    return make


def metric_frames(rank: int) -> Callable[[bytes, int, bool], dict[str, Any] | None]:
    """Metrics lines are JSON objects written by the runtime; anything else is reported, not passed."""
    def make(piece: bytes, offset: int, partial: bool) -> dict[str, Any] | None:
        try:
            data = None if partial else json.loads(piece)
        except ValueError:
            data = None
        if isinstance(data, dict):
            return {"type": "metric", "rank": rank, "data": data}
        if not piece.strip():
            return None
        return {"type": "warning", "rank": rank,
                "message": f"rank {rank} wrote a metrics line that is not a JSON object (ignored)"}
    return make


class Follower:
    """Reads one file from ``offset`` and sends its lines as frames until ``finished()``.

    ``finished`` says no more bytes will be appended (checked *before* each read, so bytes written
    just before it turned true are still read); ``complete`` says whether the trailing unterminated
    line is really the end of its line.
    """

    def __init__(self, path: Path, offset: int, make: Callable[[bytes, int, bool], dict[str, Any] | None],
                 send: Callable[[list[dict[str, Any]]], bool], finished: Callable[[], bool],
                 wake: threading.Event | None = None, complete: Callable[[], bool] | None = None,
                 poll_s: float = 0.2) -> None:
        self.path = path
        self.offset = offset
        self._make = make
        self._send = send
        self._finished = finished
        self._complete = complete or finished
        self._wake = wake
        self._poll_s = poll_s
        self.done = threading.Event()

    def start(self, name: str) -> "Follower":
        threading.Thread(target=self.run, name=f"follow-{name}", daemon=True).start()
        return self

    def run(self) -> None:
        buf = bytearray()
        base = self.offset
        try:
            with self._open() as fh:
                fh.seek(base)
                while True:
                    if self._wake is not None:
                        self._wake.clear()
                    finished = self._finished()
                    data = fh.read(READ_SIZE)
                    if data:
                        buf += data
                        if not self._emit(buf, base, final=False):
                            return
                        base = self.offset
                        continue
                    if finished:
                        self._emit(buf, base, final=True, partial_end=not self._complete())
                        return
                    if self._wake is not None:
                        self._wake.wait(self._poll_s * 5)
                    else:
                        self.done.wait(self._poll_s)
        finally:
            self.done.set()

    def _open(self):
        try:
            return open(self.path, "rb")
        except FileNotFoundError:
            return open(os.devnull, "rb")

    def _emit(self, buf: bytearray, base: int, *, final: bool, partial_end: bool = False) -> bool:
        out = []
        pieces = list(split_lines(buf, base, final))
        for i, (piece, offset, partial) in enumerate(pieces):
            if final and partial_end and i == len(pieces) - 1 and not partial:
                partial = True
            frame = self._make(piece, offset, partial)
            if frame is not None:
                out.append(frame)
            self.offset = offset
        return self._send(out) if out else True
