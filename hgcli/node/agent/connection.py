"""The controller's connection as the agent sees it: stop requests, heartbeats and EOF come in on
stdin; heartbeats and the ranks' output go out through the frame writer.

Its threads only put events on the supervisor's queue (``events``) and write frames; what a lost
connection means for the job is the supervisor's decision.
"""
from __future__ import annotations

import queue
import sys
import threading
import time

from . import outbound
from .events import ENDS_DRAIN, Event, StdinClosed, StopRequested
from .logs import Follower, log_frames, metric_frames
from .output import FrameWriter
from .ranks import STREAMS, Rank
from .spec import AgentSpec
from .. import frames
from ..protocol import FrameType, frame_type

DRAIN_STALL_S = 30.0   # after the job: give up sending logs when the connection takes none for this long
DRAIN_POLL_S = 0.01    # ... checking this often whether the followers are done: the end frame (and the
                       # launcher's exit) waited up to a whole 0.2 s poll after the last log frame


class Connection:
    """The agent's link to the controller while the job runs: one thread per direction of control
    (stdin reader, heartbeat sender) and one log follower per rank stream."""

    def __init__(self, spec: AgentSpec, writer: FrameWriter, events: queue.SimpleQueue[Event]) -> None:
        self.spec = spec
        self.writer = writer
        self.events = events
        self.lost = False           # EOF, a failed write, or the controller's heartbeats stopped
        self.last_heard = time.monotonic()
        self.followers: list[Follower] = []
        self._finished = threading.Event()

    def start(self, ranks: dict[int, Rank]) -> None:
        threading.Thread(target=self._read_stdin, name="stdin", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        for rank in ranks.values():
            if rank.captures:
                self._follow(rank)

    def _follow(self, rank: Rank) -> None:
        """Forward the rank's output and metrics from their node-local files, at the connection's pace."""
        for stream in STREAMS:
            cap = rank.captures[stream]
            self.followers.append(Follower(
                cap.path, 0, log_frames(rank.rank, stream, self.spec.raw_logs), self.writer.send, cap.done.is_set,
                wake=cap.wake).start(f"rank{rank.rank}-{stream}"))
        cap = rank.captures["metrics"]
        self.followers.append(Follower(
            cap.path, 0, metric_frames(rank.rank), self.writer.send, cap.done.is_set,
            wake=cap.wake).start(f"rank{rank.rank}-metrics"))

    def _read_stdin(self) -> None:
        """Heartbeats and stop requests from the controller; EOF means the controller is gone."""
        for line in sys.stdin.buffer:
            self.last_heard = time.monotonic()
            frame = frames.decode(line.decode("utf-8", "replace"))
            if frame_type(frame) is FrameType.STOP:
                self.events.put(StopRequested())
        self.events.put(StdinClosed())

    def _heartbeat(self) -> None:
        while not self._finished.wait(self.spec.heartbeat_interval_s):
            self.writer.post(outbound.heartbeat())

    def silent_for(self) -> float | None:
        """Seconds since the controller was last heard, when that exceeds the spec's limit; else None."""
        limit, silent = self.spec.heartbeat_timeout_s, time.monotonic() - self.last_heard
        return silent if 0 < limit < silent else None

    def finish(self) -> None:
        """The job is over: no more heartbeats."""
        self._finished.set()

    def drain(self) -> bool:
        """Let the followers send the rest while the connection keeps taking it; True when they did.

        A flood may need minutes on a slow link, so the bound is on lack of progress (and on the
        connection going away), not on the total time. Reads the supervisor's queue meanwhile: the
        job is over, so only the events that end the connection matter.
        """
        progress, since = -1, time.monotonic()
        while not self.lost:
            if all(f.done.is_set() for f in self.followers):
                return True
            sent = sum(f.offset for f in self.followers)
            if sent != progress:
                progress, since = sent, time.monotonic()
            elif time.monotonic() - since > DRAIN_STALL_S:
                return False
            try:
                event: Event | None = self.events.get(timeout=DRAIN_POLL_S)
            except queue.Empty:
                event = None
            if (event is not None and type(event) in ENDS_DRAIN) or self.silent_for() is not None:
                self.lost = True   # a signal: someone wants the agent gone now
        return False
