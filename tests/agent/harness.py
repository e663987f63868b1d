"""Drives a real node agent through the real LocalTransport, as the launcher will over SSH.

Processes are found the way a user would check the process table: every live process whose
environment carries the job's id marker (children and setsid'd grandchildren inherit it).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from hgcli.schema.stages import NodeSpec
from hgcli.node import frames
from hgcli.node.agent.logs import frame_lines
from hgcli.remote.local import LocalTransport
from hgcli.remote.transport import node_module_argv

WAIT_S = 60.0   # generous: the test machines are shared and slow; every wait is still bounded


def transport(node: str = "n1") -> LocalTransport:
    return LocalTransport(NodeSpec(name=node, host="localhost", python=sys.executable))


def new_job_id() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def job_pids(job_id: str, node: str | None = None) -> list[int]:
    """Live (non-zombie) processes carrying HGTRAIN_JOB_ID=<job_id> (and HGTRAIN_NODE=<node>)."""
    marker = f"HGTRAIN_JOB_ID={job_id}".encode()
    node_marker = f"HGTRAIN_NODE={node}".encode() if node else None
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if node_marker is not None and node_marker not in env:
            continue
        if marker in env and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(int(name))
    return found


def store_pid(job_id: str) -> int | None:
    """The job's store process (served by rank 0's agent under a launch), if it runs."""
    for pid in job_pids(job_id):
        try:
            if b"hgcli.node.agent.store" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            pass
    return None


def rank_pids(job_id: str, node: str | None = None) -> list[int]:
    """``job_pids`` but the job's store: the ranks (and their children)."""
    store = store_pid(job_id)
    return [pid for pid in job_pids(job_id, node) if pid != store]


def log_lines(found: list[dict[str, Any]], rank: int, stream: str = "out") -> list[str]:
    """Whole lines of one stream from its ``logs`` frames, the pieces of long lines joined."""
    out, cur = [], ""
    for f in found:
        if f.get("type") == "logs" and f["rank"] == rank and f["stream"] == stream:
            lines, partial = frame_lines(f)
            lines[0] = cur + lines[0]
            cur = lines.pop() if partial else ""
            out += lines
    return out


def has_line(frame: dict[str, Any], line: str, rank: int | None = None) -> bool:
    """A ``logs`` frame (of ``rank``) that carries ``line`` as one of its lines."""
    return (frame.get("type") == "logs" and (rank is None or frame["rank"] == rank)
            and line in frame_lines(frame)[0])


def wait_until(pred: Callable[[], Any], timeout: float = WAIT_S, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Agent:
    """One agent process; its frames are collected by a reader thread."""

    def __init__(self, jobs_root: Path, ranks: list[dict[str, Any]], *, job_id: str | None = None,
                 node: str = "n1", count_only: frozenset[int] = frozenset(), heartbeats: bool = True,
                 **spec: Any) -> None:
        self.job_id = job_id or new_job_id()
        self.node = node
        self.jobs_root = jobs_root
        self.detached = bool(spec.get("detach"))
        self.transport = transport(node)
        argv, env = node_module_argv(self.transport, "agent")
        self.proc = self.transport.start(argv, env=env)
        self.frames: list[dict[str, Any]] = []
        self.noise: list[bytes] = []
        # Ranks whose stdout frames are only counted (floods):
        # {(rank, stream): [frames, chars, last end, frames not starting where the previous one ended]}
        self.count_only = count_only
        self.counts: dict[tuple[int, str], list[int]] = {}
        self._cond = threading.Condition()
        self._stdin_lock = threading.Lock()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        body = {"type": "spec", "job_id": self.job_id, "node": node, "jobs_root": str(jobs_root),
                "ranks": ranks, "grace_s": 2.0, **spec}
        self.proc.stdin.write(frames.encode(body).encode())
        self.proc.stdin.flush()
        if heartbeats:   # as the launcher does; tests of heartbeat loss send their own
            threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        try:
            while not self._eof:
                self.heartbeat()
                time.sleep(1.0)
        except (OSError, ValueError):
            pass   # stdin closed by the test

    def _read(self) -> None:
        try:
            self._collect()
        except (ValueError, OSError):
            pass   # close() dropped the connection under us: what we have is what arrived
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _collect(self) -> None:
        for raw in self.proc.stdout:
            frame = frames.decode(raw.decode("utf-8"))
            if frame is not None and frame.get("type") == "logs" and frame["rank"] in self.count_only \
                    and frame["stream"] == "out":
                c = self.counts.setdefault((frame["rank"], frame["stream"]), [0, 0, 0, 0])
                c[3] += frame["offset"] != c[2]
                c[0] += 1
                c[1] += len(frame["text"])
                c[2] = frame["end"]
                continue
            with self._cond:
                if frame is None:
                    self.noise.append(raw)
                else:
                    self.frames.append(frame)
                self._cond.notify_all()

    def wait_frame(self, pred: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for f in self.frames:
                    if pred(f):
                        return f
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"no matching frame; last frames: {self.frames[-5:]}")
                self._cond.wait(min(left, 0.5))

    def wait_type(self, kind: str, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.wait_frame(lambda f: f.get("type") == kind, timeout)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [f for f in self.frames if f.get("type") == kind]

    def lines(self, rank: int, stream: str = "out") -> list[str]:
        """Whole lines of one stream, continuation pieces joined."""
        return log_lines(self.of_type("logs"), rank, stream)

    def heartbeat(self) -> None:
        self.send({"type": "heartbeat"})

    def send(self, frame: dict[str, Any]) -> None:
        with self._stdin_lock:
            self.proc.stdin.write(frames.encode(frame).encode())
            self.proc.stdin.flush()

    def pid(self) -> int:
        return self.wait_type("agent")["pid"]

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def control(self, *args: str, timeout: float = WAIT_S) -> tuple[int, list[dict[str, Any]]]:
        """A fresh invocation (a new connection): --stop/--status/--tail."""
        argv, env = node_module_argv(self.transport, "agent", *args, "--jobs-root", str(self.jobs_root))
        done = self.transport.run(argv, env=env, timeout=timeout)
        # split("\n"), not splitlines(): the frame marker's \x1e is a line boundary to splitlines.
        found = [frames.decode(line) for line in done.stdout.split("\n")]
        return done.exit_code, [f for f in found if f is not None]

    def control_attached(self, *args: str, timeout: float = WAIT_S) -> tuple[int, list[dict[str, Any]]]:
        """Like ``control`` but with stdin held open for the whole run (``--tail --follow``)."""
        argv, env = node_module_argv(self.transport, "agent", *args, "--jobs-root", str(self.jobs_root))
        proc = self.transport.start(argv, env=env)
        found: list[dict[str, Any]] = []
        reader = threading.Thread(target=lambda: found.extend(
            f for f in (frames.decode(raw.decode()) for raw in proc.stdout) if f is not None), daemon=True)
        reader.start()
        reader.join(timeout)
        code = proc.wait(timeout)
        proc.close()
        return code, found

    @property
    def job_dir(self) -> Path:
        return self.jobs_root / self.job_id / self.node

    def close_stdin(self) -> None:
        """EOF on the agent's stdin while we keep reading its frames."""
        with self._stdin_lock:
            self.proc.stdin.close()

    def close(self) -> None:
        """Drop the whole connection (stdin EOF, stdout and stderr closed)."""
        self.proc.close()
