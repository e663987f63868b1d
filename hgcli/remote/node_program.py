"""A node-side program (``python -m hgcli.node.<module>``) seen from the controller: its frames.

One reader thread per stream: stdout is decoded into frames (noise skipped), stderr keeps its last
lines so a crash can be explained in one line. Every wait has a deadline; on timeout the program's
connection is dropped (stdin EOF: node programs started with ``--lifeline`` exit on it).
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Iterator, Sequence

from ..errors import RemoteError
from ..node.frames import decode
from .transport import RemoteProcess, Transport, node_module_argv

_EOF = object()


class NodeProgram:
    """One node program started on a transport, read as frames with bounded waits (probe, bench, link)."""

    def __init__(self, transport: Transport, module: str, args: Sequence[str], *,
                 env: dict[str, str] | None = None) -> None:
        argv, base_env = node_module_argv(transport, module, *args)
        self.host = transport.node.name
        self.what = module
        self._proc: RemoteProcess = transport.start(argv, env={**base_env, **(env or {})})
        self._frames: queue.Queue[Any] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._readers:
            t.start()

    def _read_stdout(self) -> None:
        try:
            for raw in iter(self._proc.stdout.readline, b""):
                frame = decode(raw.decode("utf-8", "replace"))
                if frame is not None:
                    self._frames.put(frame)
        except (OSError, ValueError):
            pass
        finally:
            self._frames.put(_EOF)

    def _read_stderr(self) -> None:
        try:
            for raw in iter(self._proc.stderr.readline, b""):
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    self._stderr.append(line)
        except (OSError, ValueError):
            pass

    def frames(self, deadline: float) -> Iterator[dict[str, Any]]:
        """Frames until the program closes stdout; RemoteError when ``deadline`` (monotonic) passes."""
        while True:
            remaining = deadline - time.monotonic()
            try:
                frame = self._frames.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                self.close()
                raise RemoteError(self.host, f"{self.what} timed out") from None
            if frame is _EOF:
                return
            yield frame

    def finish(self, deadline: float) -> int:
        """Exit code after stdout closed (bounded: a program that hangs on exit is dropped)."""
        try:
            code = self._proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except TimeoutError:
            self.close()
            raise RemoteError(self.host, f"{self.what} did not exit") from None
        self._readers[1].join(timeout=2.0)
        return code

    def failure(self, code: int) -> str:
        """One line for a program that ended without its result: exit code and last stderr line."""
        last = self._stderr[-1] if self._stderr else "no output"
        if code == -1:
            # SSH's "no exit status" (and a local SIGHUP): the node or its sshd went away under it.
            return f"{self.what} ended without an exit status (connection to the node lost?): {last}"
        return f"{self.what} exited with code {code}: {last}"

    def close(self) -> None:
        self._proc.close()

    def __enter__(self) -> "NodeProgram":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
