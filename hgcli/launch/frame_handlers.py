"""The agents' frames, turned into the job's record and events (one handler per frame type).

A rank that ends ``failed`` (non-zero or a signal, before any stop) is the root cause; its exit code
is the job's (128 + signal for a signal). A rank its agent stopped unasked (a SIGTERM from the node:
a shutdown) makes the node as lost. Everything else is recorded and reported: log lines to the
rank's file and the console, metrics to the board, ranks' starts and exits to the job record.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, ClassVar

from ..errors import EXIT_JOB, EXIT_NODES_FAILED
from ..node.protocol import FrameType
from ..schema.stages import JobState, Plan, RankState, Role
from .agentlink import Inbound, frame_bytes
from .events import Adapted, LogLines, Metric, Progress, RankExited, RankStarted, Resumed, RootCause
from .inbound import (
    AgentError, AgentStopping, AgentWarning, Detached, Ended, Exited, Logs, Malformed, MetricRecord, RecordedError,
    Started,
)
from .mailbox import Mailbox
from .metrics import MetricsBoard, RecordIntake
from .record import JobBook
from .stopping import Stop

TAIL_LINES = 10         # last lines of the root-cause rank shown with it
ERROR_CHARS = 500       # of the root-cause rank's @record exception message
PROGRESS_EVERY_S = 1.0


def last_lines(data: bytes, n: int) -> list[str]:
    """The last ``n`` complete lines of a batch (an unfinished piece after the last newline is not
    one), found from the end: only they are decoded, not the megabyte before them."""
    cut = data.rfind(b"\n")
    if cut < 0:
        return []
    start = cut
    for _ in range(n):
        start = data.rfind(b"\n", 0, start)
        if start < 0:
            break
    return data[start + 1:cut].decode("utf-8", "backslashreplace").split("\n")


def recorded_error(error: RecordedError | None) -> tuple[str | None, tuple[str, ...]]:
    """A failed rank's ``@record`` exception from its exit frame: the message as one line (at most
    ``ERROR_CHARS``) and the call stack's last ``TAIL_LINES`` lines, as the rank wrote them. What
    reaches a terminal shows their control characters visibly there (``render/safe.py``), as every
    other line of a rank; the job's record and ``--json`` keep them exact."""
    if error is None:
        return None, ()
    message = " ".join(error.message.split())
    if len(message) > ERROR_CHARS:
        message = message[:ERROR_CHARS - 3] + "..."
    stack = error.traceback
    lines = stack.rstrip("\n").split("\n")[-TAIL_LINES:] if stack.strip() else []
    return message or None, tuple(lines)


class FrameHandlers:
    """One attempt's handling of its agents' frames: what each frame writes to the job's record and
    board, which events it emits, and which failures it hands to the attempt's ``Stop``."""

    def __init__(self, *, plan: Plan, attempt: int, reached: int | None, inbox: Mailbox[Inbound], book: JobBook,
                 board: MetricsBoard, stop: Stop) -> None:
        self.job_id, self.plan, self.attempt, self.stop = stop.job_id, plan, attempt, stop
        self.reached = reached         # samples the job had trained when the last attempt ended
        self.inbox, self.book, self.board, self.emit = inbox, book, board, stop.emit
        self.first_worker = plan.workers[0].rank if plan.workers else -1
        self.group_ranks = {g.id: tuple(g.ranks) for g in plan.groups}
        self.role = {r.rank: r.role for r in plan.ranks}
        self.resumed: Resumed | None = None
        self.malformed: set[tuple[str, str]] = set()   # (node, frame type) told about
        self.intake = RecordIntake()               # tells of bad records once per rank / kind
        self.tails: collections.defaultdict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.started: set[int] = set()
        self.agent_stops: dict[str, str] = {}   # node -> why its agent stopped its ranks by itself
        self.metrics_seen = False
        self.progress_at = 0.0

    def handle(self, node: str, frame: object) -> None:
        handler = self.HANDLERS.get(type(frame))   # the others (a late prepare answer): only heard
        if handler is not None:
            handler(self, node, frame)

    def progress(self) -> None:
        """A progress event at most every ``PROGRESS_EVERY_S``, when metrics came since the last."""
        now = time.monotonic()
        if self.metrics_seen and now - self.progress_at >= PROGRESS_EVERY_S:
            self.progress_at, self.metrics_seen = now, False
            self.emit(Progress(self.job_id, self.board.view()))

    def _malformed(self, node: str, frame: Malformed) -> None:
        """Told once per node and frame type: an agent of another version may send many alike."""
        if (node, frame.type.value) not in self.malformed:
            self.malformed.add((node, frame.type.value))
            self.stop.note(node, f"dropped a malformed '{frame.type.value}' frame from its agent ({frame.why})")

    def _role(self, node: str, kind: FrameType, rank: int) -> Role | None:
        """The role of a rank the plan has; None (the frame is reported and dropped) for another."""
        role = self.role.get(rank)
        if role is None:
            self._malformed(node, Malformed(kind, f"rank {rank} is not in the plan"))
        return role

    def _end(self, node: str, frame: Ended) -> None:
        entry = self.stop.nodes[node]
        entry.ended, entry.end = True, frame
        if not frame.logs_complete:
            self.stop.note(node, "the connection was too slow to forward every log line; the "
                                 "node-local files are complete ('hgtrain logs' reads them)")

    def _stopping(self, node: str, frame: AgentStopping) -> None:
        """An agent stops its ranks on its own: only a failure of its own part (the job's store) is
        the job's root cause; for the rest (a stop asked for, a lost link) the ranks' exits say it.
        Only 'hgtrain stop' is the user's stop: a SIGTERM from elsewhere (a node shutting down)
        leaves the job restartable, as a lost node."""
        if frame.requested:
            self.stop.stopped_outside = True
        self.agent_stops[node] = frame.reason or "stopped"
        if frame.failed:
            self.stop.fail_node(node, frame.reason or "failed", EXIT_JOB)

    def _detached(self, node: str, frame: Detached) -> None:
        self.stop.nodes[node].detached = True

    def _warning(self, node: str, frame: AgentWarning) -> None:
        who = f"rank {frame.rank}: " if frame.rank is not None else ""
        self.stop.note(node, who + frame.message)

    def _error(self, node: str, frame: AgentError) -> None:
        self.stop.nodes[node].ended = True   # the agent exits after this frame, having started nothing
        self.stop.fail_node(node, f"its agent refused the job: {frame.message}", EXIT_JOB)

    def _logs(self, node: str, frame: Logs) -> None:
        """A batch of lines: one file write, one event, no per-line step whatever their number."""
        self.inbox.release(frame_bytes(frame))   # as its reader weighed it: room for the next
        rank, data = frame.rank, frame.data
        role = self._role(node, FrameType.LOGS, rank)
        if role is None:
            return
        if not frame.partial and not data.endswith(b"\n"):
            data += b"\n"   # the stream's last line, unterminated: it ends here all the same
        lines = LogLines(self.job_id, rank, node, role, frame.stream, data, frame.partial)
        self.book.write_log(lines)
        self.tails[rank].extend(last_lines(data, TAIL_LINES))
        self.emit(lines)

    def _metric(self, node: str, frame: MetricRecord) -> None:
        rank = frame.rank
        role = self._role(node, FrameType.METRIC, rank)
        if role is None:
            return
        data, notes = self.intake.take(rank, frame.data)
        for note in notes:
            self.stop.note(node, note)
        self.book.write_metric(rank, node, data)
        self.board.add(rank, data)
        self.metrics_seen = True
        self.emit(Metric(self.job_id, rank, node, role, data))
        first_ps = self.plan.ps_shards[0] if self.plan.ps_shards else None
        adapted = Adapted.parse(self.job_id, rank, data, self.group_ranks, first_ps)
        if adapted is not None:
            self.emit(adapted)
        resumed = Resumed.parse(self.job_id, self.attempt, rank, self.first_worker, data, self.reached, first_ps)
        if resumed is not None and self.resumed is None:
            self.resumed = resumed
            self.emit(resumed)

    def _started(self, node: str, frame: Started) -> None:
        rank = frame.rank
        role = self._role(node, FrameType.STARTED, rank)
        if role is None:
            return
        self.started.add(rank)
        self.book.update_rank(rank, state=RankState.RUNNING)
        self.emit(RankStarted(self.job_id, rank, node, role, frame.pid))
        if len(self.started) == self.plan.world_size:
            self.book.update(state=JobState.RUNNING)

    def _exit(self, node: str, frame: Exited) -> None:
        rank, state, code = frame.rank, frame.state, frame.exit_code
        role = self._role(node, FrameType.EXIT, rank)
        if role is None:
            return
        self.book.update_rank(rank, state=state, exit_code=frame.code, signal=frame.signal)
        reason = frame.reason or f"ended ({state.value})"
        self.emit(RankExited(self.job_id, rank, node, role, state, code, frame.signal_name, reason, frame.oom))
        if state is RankState.FAILED and self.stop.quiet:
            error, stack = recorded_error(frame.error)
            self.stop.fail_rank(RootCause(node=node, rank=rank, exit_code=code, signal=frame.signal_name,
                                          reason=reason, oom=frame.oom, error=error, traceback=stack),
                                code if code else 1)
        elif state is RankState.STOPPED and self.stop.reason is None and not self.stop.stopped_outside:
            # Its agent stopped it unasked (a SIGTERM from the node: a shutdown, a kill): the node
            # is going away, as lost; the other nodes stop now rather than wait in a collective.
            why = self.agent_stops.get(node, reason)
            self.stop.fail_node(node, f"its agent stopped its ranks: {why}", EXIT_NODES_FAILED)

    # Dispatch on the decoded frame's type (launch/inbound.py).
    HANDLERS: ClassVar[dict[type, Callable[[FrameHandlers, str, Any], None]]] = {
        Logs: _logs, MetricRecord: _metric, Started: _started, Exited: _exit, Ended: _end,
        AgentStopping: _stopping, Detached: _detached, AgentWarning: _warning, AgentError: _error,
        Malformed: _malformed,
    }

