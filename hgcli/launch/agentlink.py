"""One node's agent as the controller sees it: a connection, a reader thread per stream, heartbeats.

Readers hand each frame straight to the controller's inbox. The inbox is bounded by the bytes of
rank output it holds (``INBOX_BYTES``): past that a reader stops reading until the controller has
caught up, and the agent keeps the rest (it paces its sends to the connection; its node-local files
hold everything). The controller never waits for the console (``dispatch.Dispatcher``), so the inbox
fills only while the controller itself is starved of CPU, and briefly.
Protocol: docs/agent.md.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Mapping, NamedTuple, cast

from ..errors import HgError
from ..node import frames
from ..node.agent.spec import AgentSpec
from ..node.protocol import FrameType, PreparedFrame, first, frame_type
from ..schema.stages import to_dict
from .mailbox import Mailbox
from ..remote.transport import RemoteProcess, Transport, node_module_argv


def without_site(argv: list[str]) -> list[str]:
    """``python -S -m hgcli.node.agent``: the agent needs only the standard library and the shipped
    package (``PYTHONPATH``), and the site module (site-packages, ``.pth`` files of editable installs
    and the like) was most of its start-up (0.05-0.15 s on the test machines), which every launch
    waits for. The ranks are started with their own command line and do get ``site``."""
    return [argv[0], "-S", *argv[1:]]


ANSWERS = (FrameType.PREPARED, FrameType.ERROR)   # to prepare(): not frames of the job
INBOX_BYTES = 8 << 20   # rank output waiting for the controller, over every node's reader


def frame_bytes(frame: Mapping[str, Any]) -> int:
    """What a frame weighs in the inbox: a log batch's bytes (released by the controller once it
    has handled them); other frames are small and count 0."""
    data = frame.get("data")
    return len(data) if isinstance(data, bytes) else 0


class Inbound(NamedTuple):
    """A frame from ``node``'s agent; ``frame is None`` means its connection ended (EOF).
    A tuple, not a dataclass: one is made per frame, and a chatty agent sends many."""

    node: str
    frame: dict[str, Any] | None


class AgentLink:
    """Start ``python -S -m hgcli.node.agent`` on a node and talk to it: ``prepare``, then the spec."""

    STDERR_LINES = 20   # the agent's own stderr (a traceback, "python3: not found") kept for errors
    PREPARE_TIMEOUT_S = 60.0

    def __init__(self, transport: Transport, inbox: Mailbox[Inbound]) -> None:
        self.transport = transport
        self.node = transport.node.name
        self._inbox = inbox
        self._send_lock = threading.Lock()
        self._proc: RemoteProcess | None = None
        self._stop = threading.Event()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=self.STDERR_LINES)
        self.last_heard = time.monotonic()
        self._threads: list[threading.Thread] = []
        self._answered = threading.Event()   # the answer to prepare() (or the end of the stream) came
        self._answer: dict[str, Any] | None = None
        # The end of the stream reaches the inbox only once the link carries a job (``send_spec``): a
        # link whose prepare failed is dropped and retried with a fresh one on a restart, and its end
        # must not read as the retried node's end.
        self._eof_lock = threading.Lock()
        self._attached = False
        self._ended = False

    def start(self) -> None:
        """Start the agent; it waits (bounded) for ``prepare`` and then its spec on stdin."""
        argv, env = node_module_argv(self.transport, "agent")
        self._proc = self.transport.start(without_site(argv), env=env)
        self.last_heard = time.monotonic()
        for target, name in ((self._read_frames, "frames"), (self._read_stderr, "stderr")):
            t = threading.Thread(target=target, name=f"hgtrain-{self.node}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def prepare(self, request: dict[str, Any]) -> PreparedFrame:
        """The agent's first exchange: the plan file on the node, and a free port there (node/prelaunch.py).
        HgError with the node's reason when it cannot."""
        self.send({"type": FrameType.PREPARE, **request})   # a dead agent shows as the end of its stream
        if not self._answered.wait(self.PREPARE_TIMEOUT_S):
            raise HgError(f"cannot prepare the job there: its agent did not answer within "
                          f"{self.PREPARE_TIMEOUT_S:g} s")
        answer = self._answer
        if answer is not None and frame_type(answer) is FrameType.PREPARED:
            return cast(PreparedFrame, answer)
        if answer is not None:
            why = str(answer.get("message"))
        else:
            self._threads[-1].join(2.0)   # the agent ended: its stderr says why ("python3: not found")
            why = self.stderr_tail[-1] if self.stderr_tail else "its agent ended without a word"
        raise HgError(f"cannot prepare the job there: {why}")

    def send_spec(self, spec: AgentSpec) -> None:
        with self._eof_lock:
            self._attached = True
            ended = self._ended
        if ended:
            self._inbox.put(Inbound(self.node, None))
        if not self.send({"type": FrameType.SPEC, **to_dict(spec)}):
            raise HgError("the connection to its agent closed before the job spec was sent")

    def _read_frames(self) -> None:
        assert self._proc is not None
        monotonic, put, node = time.monotonic, self._inbox.put, self.node
        try:
            for frame in frames.read_stream(self._proc.stdout, raw=True):
                if self._stop.is_set():
                    break
                self.last_heard = monotonic()
                if not self._answered.is_set() and frame_type(frame) in ANSWERS:
                    self._answer = frame   # prepare()'s answer, not the job's
                    self._answered.set()
                    continue
                put(Inbound(node, frame), frame_bytes(frame))
        except (OSError, ValueError, EOFError):
            pass   # the connection was dropped under us: that is the EOF below
        self._answered.set()
        with self._eof_lock:
            self._ended = True
            attached = self._attached
        if attached:
            self._inbox.put(Inbound(self.node, None))

    def _read_stderr(self) -> None:
        assert self._proc is not None
        try:
            for raw in self._proc.stderr:
                if self._stop.is_set():
                    break
                self.stderr_tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError, EOFError):
            pass

    def send(self, frame: Mapping[str, Any]) -> bool:
        """Write one frame to the agent's stdin; False when the connection is gone."""
        if self._proc is None:
            return False
        try:
            with self._send_lock:
                self._proc.stdin.write(frames.encode(frame).encode())
                self._proc.stdin.flush()
        except (OSError, ValueError, EOFError):
            return False
        except Exception:   # paramiko raises its own SSHException on a closed channel
            return False
        return True

    def heartbeat(self) -> bool:
        return self.send({"type": FrameType.HEARTBEAT})

    def stop(self) -> bool:
        """Ask the agent to stop its ranks (grace, then kill); its frames keep coming until ``end``."""
        return self.send({"type": FrameType.STOP})

    def close(self, join_s: float = 2.0) -> None:
        """Drop the connection: an agent still running stops its ranks by itself (stdin EOF)."""
        self._stop.set()
        if self._proc is not None:
            # On its own thread: closing a local pipe waits for a reader blocked on it (an agent
            # that is frozen, not dead), and the closing must never hold up the controller.
            closer = threading.Thread(target=self._proc.close, name=f"hgtrain-{self.node}-close", daemon=True)
            closer.start()
            closer.join(join_s)
        for t in self._threads:
            t.join(join_s)
        self.transport.close()

    def reap(self, job_id: str, jobs_root: str, timeout: float) -> str:
        """Stop what the lost agent left behind, over a fresh command (the agent's ``--stop``: its
        recorded process groups and the job marker, never other jobs). Returns what it reported."""
        argv, env = node_module_argv(self.transport, "agent", "--stop", job_id, "--node", self.node,
                                     "--jobs-root", jobs_root)
        try:
            done = self.transport.run(argv, env=env, timeout=timeout)
        except HgError as exc:
            return f"could not reach it to stop what is left: {exc}"
        report = first(frames.decode_lines(done.stdout), FrameType.STOPPED)
        if report is None:
            return f"stopping what is left failed (exit code {done.exit_code})"
        left = report.get("left") or []
        return (f"stopped what its agent left: {len(report.get('killed') or [])} process(es)"
                + (f"; STILL RUNNING: {left}" if left else ""))

    def wait(self, timeout: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout)
        except TimeoutError:
            return None


class Heartbeat:
    """One thread sending a heartbeat to every link every ``interval_s`` until stopped."""

    def __init__(self, links: list[AgentLink], interval_s: float) -> None:
        self._links = links
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hgtrain-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for link in self._links:
                link.heartbeat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 1)
