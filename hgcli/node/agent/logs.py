"""Rank output: pipe -> node-local file (Capture), then file -> frames (Follower).

The two halves are decoupled on purpose. A Capture thread only ever reads its pipe and appends to
disk, so a rank never blocks on a slow controller and nothing is lost when the link drops (the file
is complete; ``--tail`` can resend it). A Follower reads the file at whatever pace the connection
allows and turns it into frames.

Log frames are batches, because per-line frames cost the agent and the controller a JSON encode,
decode, event and write per line (a flood of short lines ran at a few per cent of ``ssh cat``).
Rules, shared by live forwarding and ``--tail``:
- a ``logs`` frame carries ``text``: the exact bytes ``[offset, end)`` of the node-local file,
  decoded; the frames of one stream tile the file, so a re-attach continues exactly at the last
  ``end`` (``--from``). Every line in ``text`` ends in ``\\n`` except perhaps the last one;
- a line longer than CHUNK bytes is cut into pieces of at most CHUNK bytes, each ending a frame
  with ``"partial": true`` (the next frame's text continues that line);
- a trailing line without ``\\n`` is held until the stream ends, then sent (``partial`` false); a
  non-follow ``--tail`` of a running job sends it with ``partial`` true;
- bytes that are not UTF-8 are escaped as ``\\xNN`` (Python's backslashreplace); the node-local file
  keeps the exact bytes. ``\\n`` is never part of a multi-byte sequence, so decoding a batch at once
  gives the same text as decoding its lines one by one.
Metrics stay one frame per line: each line is one JSON object that the controller parses anyway.
"""
from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

from ...schema.deepjson import MAX_DEPTH, too_deep
from ..protocol import FrameType, LogsFrame, MetricFrame, WarningFrame

CHUNK = 64 * 1024        # longest piece of a line in one frame
READ_SIZE = 1 << 20      # bytes read from a log file per step
GATHER_BYTES = 1 << 18   # a read smaller than this was a trickle (or the front of a flood) ...
GATHER_S = 0.01          # ... so let more gather this long before the next read: big frames in a
                         # flood, and a quiet rank's line is still on its way within 10 ms
PIPE_READ = 1 << 20     # a rank's pipe is grown to this (F_SETPIPE_SZ; 1 MiB is the unprivileged
                        # limit): a flooding rank then rarely waits for the capture thread, and the
                        # thread moves its output in few large reads instead of one per 64 KiB
CAPTURE_SMALL = 64 * 1024   # a pipe read smaller than this: the rank writes in small pieces (a Python
CAPTURE_LINGER_S = 0.002    # rank with PYTHONUNBUFFERED, as torchrun runs it, writes each line by
                            # itself) so wait this long before the next read: one read per ~2 ms
                            # instead of one per line (a wake-up, a file write and a follower wake
                            # each, most of a flood's cost on the node). The first line after a
                            # quiet spell is read at once; the pipe (1 MiB) holds 2 ms of any rank.


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
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_READ)
            # Only a pipe that holds 1 MiB may be left alone for a while: the default 64 KiB would
            # make a flooding rank wait.
            self._linger = CAPTURE_LINGER_S
        except OSError:
            self._linger = 0.0   # not a pipe, or over this node's pipe-max-size: the default size still works
        self._out = open_private_append(path)
        self._thread = threading.Thread(target=self._run, name=f"capture-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # One buffer for every read: os.read would allocate PIPE_READ bytes per call (an mmap at
        # this size) however little the pipe holds.
        pipe = io.FileIO(self._fd, "rb", closefd=False)
        view = memoryview(bytearray(PIPE_READ))
        try:
            while True:
                n = pipe.readinto(view)
                if not n:
                    break
                self._append(view[:n])
                self.wake.set()
                if n < CAPTURE_SMALL and self._linger:
                    time.sleep(self._linger)
        finally:
            os.close(self._fd)
            os.close(self._out)
            self.done.set()
            self.wake.set()

    def _append(self, view: memoryview) -> None:
        while view:
            try:
                view = view[os.write(self._out, view):]
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                # Disk full or similar: keep draining the pipe so the rank never blocks.
                self.dropped += len(view)
                return


Framer = Callable[[bytearray, int, bool, bool], Sequence[Mapping[str, Any]]]
"""Takes what it can off the front of ``buf`` (file offset ``base``) and returns its frames; with
``final`` (no more bytes will come) everything, the unterminated last line marked partial when
``open_end`` (the stream may still go on)."""


def _cut(buf: bytearray, start: int) -> int:
    """Where a piece of the over-long line at ``start`` ends: CHUNK bytes on, moved back so no UTF-8
    sequence is split (each piece then decodes alone)."""
    cut = start + CHUNK
    while cut > start + CHUNK - 3 and (buf[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


def split_batches(buf: bytearray, base: int, final: bool, open_end: bool = False
                  ) -> Iterator[tuple[bytes, int, bool]]:
    """Take runs of whole lines (and pieces of over-long lines) off the front of ``buf``.

    Yields (data, file offset after it, partial): ``data`` holds consecutive lines, each ending in
    ``\\n``, except that a run ends early with a piece (``partial``) when a line is longer than CHUNK;
    with ``final`` the unterminated remainder ends the last run (``partial`` = ``open_end``).
    Lines are checked a window at a time (one ``rfind`` per CHUNK bytes), never one by one.
    """
    start = pos = 0   # data[start:pos] is whole lines, none longer than CHUNK
    while True:
        nl = buf.rfind(b"\n", pos, pos + CHUNK + 1)
        if nl >= 0:
            pos = nl + 1
            continue
        if len(buf) - pos <= CHUNK:
            break      # an unfinished line that may still fit in one piece: wait for more
        cut = _cut(buf, pos)
        yield bytes(buf[start:cut]), base + cut, True
        start = pos = cut
    if final and pos < len(buf):
        pos = len(buf)
    if pos > start:
        yield bytes(buf[start:pos]), base + pos, open_end and not buf.endswith(b"\n", start, pos)
    del buf[:pos]


def split_lines(buf: bytearray, base: int, final: bool, open_end: bool = False
                ) -> Iterator[tuple[bytes, int, bool]]:
    """Take complete lines (and over-long pieces) off the front of ``buf``, one at a time.

    Yields (line without its ``\\n``, offset after it, partial); with ``final`` the remainder too, as
    the end of its line (``partial`` = ``open_end``).
    """
    start = 0
    while True:
        nl = buf.find(b"\n", start)
        end = nl if nl >= 0 else len(buf)
        while end - start > CHUNK:
            cut = _cut(buf, start)
            yield bytes(buf[start:cut]), base + cut, True
            start = cut
        if nl < 0:
            break
        yield bytes(buf[start:nl]), base + nl + 1, False
        start = nl + 1
    if final and start < len(buf):
        yield bytes(buf[start:]), base + len(buf), open_end
        start = len(buf)
    del buf[:start]


def text(piece: bytes) -> str:
    return piece.decode("utf-8", "backslashreplace")


def log_frames(rank: int, stream: str, raw: bool = False) -> Framer:
    """``logs`` frames with ``text``; with ``raw`` the bytes go as the frame's payload instead
    (``frames.encode_raw``: no decoding or JSON escaping on the node; readers get ``text`` back)."""
    def make(buf: bytearray, base: int, final: bool, open_end: bool) -> list[LogsFrame]:
        out = []
        for data, end, partial in split_batches(buf, base, final, open_end):
            frame: LogsFrame = {"type": FrameType.LOGS, "rank": rank, "stream": stream,
                                "offset": end - len(data), "end": end}
            if raw:
                frame["payload"] = data
            else:
                frame["text"] = text(data)
            if partial:
                frame["partial"] = True
            out.append(frame)
        return out
    return make


def frame_lines(frame: Mapping[str, Any]) -> tuple[list[str], bool]:
    """The lines of a ``logs`` frame without their newlines, and whether the last one is a piece
    whose line continues in the next frame (the controller's and ``--tail`` readers' view)."""
    lines = str(frame.get("text", "")).split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines, bool(frame.get("partial"))


def metric_frames(rank: int) -> Framer:
    """Metrics lines are JSON objects written by the runtime; anything else is reported, not passed.
    A line nested deeper than any record (schema/deepjson.py) is dropped here, on the node, with one
    notice for the rank: past it, every recursive reader on the controller would fail."""
    told: list[bool] = []

    def make(buf: bytearray, base: int, final: bool, open_end: bool) -> list[MetricFrame | WarningFrame]:
        out: list[MetricFrame | WarningFrame] = []
        for piece, _, partial in split_lines(buf, base, final, open_end):
            if not partial and too_deep(piece):
                if not told:
                    told.append(True)
                    out.append({"type": FrameType.WARNING, "rank": rank,
                                "message": f"rank {rank} wrote a metrics record nested deeper than {MAX_DEPTH} "
                                           f"levels: dropped (and any more like it, without another notice)"})
                continue
            try:
                data = None if partial else json.loads(piece)
            except ValueError:
                data = None
            if isinstance(data, dict):
                out.append({"type": FrameType.METRIC, "rank": rank, "data": data})
            elif piece.strip():
                out.append({"type": FrameType.WARNING, "rank": rank,
                            "message": f"rank {rank} wrote a metrics line that is not a JSON object (ignored)"})
        return out
    return make


class Follower:
    """Reads one file from ``offset`` (waiting for it to exist) and sends its lines as frames until
    ``finished()``.

    ``finished`` says no more bytes will be appended (checked *before* each read, so bytes written
    just before it turned true are still read); ``complete`` says whether the trailing unterminated
    line is really the end of its line.
    """

    def __init__(self, path: Path, offset: int, make: Framer,
                 send: Callable[[Sequence[Mapping[str, Any]]], bool], finished: Callable[[], bool],
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
        try:
            fh = self._open()
            if fh is not None:
                with fh:
                    self._follow(fh)
        finally:
            self.done.set()

    def _follow(self, fh: BinaryIO) -> None:
        buf = bytearray()
        base = self.offset
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
                if len(data) < GATHER_BYTES and not finished:
                    time.sleep(GATHER_S)
                continue
            if finished:
                self._emit(buf, base, final=True, partial_end=not self._complete())
                return
            self._pause()

    def _open(self) -> BinaryIO | None:
        """The file, once it exists; None when the stream finished without one (a rank that never
        started). A ``--tail`` can attach while the agent's record lists a rank whose Capture has not
        created its file yet: following nothing then (the old ``/dev/null``) lost all its output."""
        while True:
            finished = self._finished()   # before the open, as before a read: a file created just
            try:                          # before the stream finished is still found
                return open(self.path, "rb")
            except FileNotFoundError:
                if finished:
                    return None
            self._pause()

    def _pause(self) -> None:
        if self._wake is not None:
            self._wake.wait(self._poll_s * 5)
        else:
            self.done.wait(self._poll_s)

    def _emit(self, buf: bytearray, base: int, *, final: bool, partial_end: bool = False) -> bool:
        size = len(buf)
        out = self._make(buf, base, final, partial_end)
        self.offset = base + size - len(buf)
        return self._send(out) if out else True
