"""The agent's one way out: frames written to a file descriptor (the connection's stdout).

Log followers write here with ``send`` and may block while the connection is slow: that is the
back-pressure we want, since their data is already safe on disk. Control frames (exit, heartbeat,
stopping, end) go through ``post``, which never blocks the caller, so the supervisor's main loop keeps
deciding and killing even when the link is stalled.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Mapping, Sequence

from .. import frames


class FrameWriter:
    """The agent's only writer of frames to the controller: blocking ``send`` for logs, non-blocking ``post``
    for control frames."""

    def __init__(self, fd: int = 1, on_broken: Callable[[], None] = lambda: None) -> None:
        self._fd = fd
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._broken = False
        self._control: queue.SimpleQueue[Mapping[str, Any] | threading.Event] = queue.SimpleQueue()
        threading.Thread(target=self._control_loop, name="frames-control", daemon=True).start()

    @property
    def broken(self) -> bool:
        return self._broken

    def send(self, objs: Sequence[Mapping[str, Any]]) -> bool:
        """Write frames now (blocking); False once the connection is gone."""
        if not objs:
            return not self._broken
        data = b"".join(_wire(o) for o in objs)
        with self._lock:
            if self._broken:
                return False
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError:
                self._broken = True
        if self._broken:
            self._on_broken()
            return False
        return True

    def post(self, obj: Mapping[str, Any]) -> None:
        """Queue one control frame; never blocks."""
        self._control.put(obj)

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until every posted frame has been written or dropped."""
        done = threading.Event()
        self._control.put(done)
        return done.wait(timeout)

    def reattach(self, fd: int) -> None:
        """Point at a new descriptor (a detached agent's log file after the controller's pipe)."""
        with self._lock:
            self._fd = fd
            self._broken = False

    def _control_loop(self) -> None:
        while True:
            item = self._control.get()
            if isinstance(item, threading.Event):
                item.set()
            else:
                self.send([item])


def _wire(obj: Mapping[str, Any]) -> bytes:
    """A frame as bytes; a ``payload`` (raw log bytes) follows its line unescaped (frames.encode_raw)."""
    payload = obj.get("payload")
    if payload is None:
        return frames.encode(obj).encode("utf-8")
    return frames.encode_raw({k: v for k, v in obj.items() if k != "payload"}, payload)
