"""The controller's decisions while a job runs: who failed first, when to stop everyone, when it is over.

One thread (the caller's) consumes the agents' frames from one inbox, so every decision sees the
frames in arrival order and the root cause is the first failure that reached us. The rules:
- a rank ends ``failed`` (non-zero or a signal, before any stop): it is the root cause; every agent
  is told to stop (its grace period, then SIGKILL), and the job's exit code is that rank's code
  (128 + signal for a signal);
- an agent's connection ends before its ``end`` frame, or nothing (not even a heartbeat) arrives from
  it for ``heartbeat_timeout_s``: the node is lost, named as the root cause, the others are stopped,
  exit code 4; its own agent stops its ranks by itself (stdin EOF or heartbeat silence);
- SIGINT/SIGTERM to hgtrain: stop everyone the same way, exit 130/143;
- after a stop, wait at most ``grace_s + STOP_EXTRA_S`` for every ``end``, then drop the connections
  (the agents still kill their ranks: they die with their connection).
"""
from __future__ import annotations

import collections
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..errors import EXIT_JOB, EXIT_NODES_FAILED, EXIT_TERMINATED
from .events import (
    Adapted, Event, LogLines, Metric, NodeLost, Notice, Progress, RankExited, RankStarted, Resumed, RootCause,
    Stopping,
)
from .metrics import MetricsBoard, RecordIntake
from .record import JobBook
from .mailbox import Mailbox
from ..schema.stages import JobState, Plan, RankState, Role
from ..node.protocol import FrameType
from .agentlink import AgentLink, Inbound, frame_bytes
from .inbound import (
    AgentError, AgentStopping, AgentWarning, Detached, Ended, Exited, Logs, Malformed, MetricRecord, RecordedError,
    Started,
)

if TYPE_CHECKING:
    from .adapt import Regroup

REAP_EXTRA_S = 30.0    # beyond the grace period: connect, the agent's --stop waits, SIGKILL
STOP_EXTRA_S = 20.0     # beyond the grace period: the agent's 5 s after SIGKILL, draining its logs
TAIL_LINES = 10         # last lines of the root-cause rank shown with it
ERROR_CHARS = 500       # of the root-cause rank's @record exception message
POLL_S = 0.2
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


@dataclass
class Interrupt:
    """Set by the signal handlers of ``launch``: the signal that asked us to stop, and how often."""

    signum: int | None = None
    count: int = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.count += 1

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@dataclass
class _Node:
    link: AgentLink
    ended: bool = False            # `end` received, or given up on
    detached: bool = False
    end: Ended | None = None


@dataclass
class Outcome:
    state: JobState
    exit_code: int
    root_cause: RootCause | None
    notes: list[str] = field(default_factory=list)
    # A rank failed or a node was lost (not a stop asked for by Ctrl-C or 'hgtrain stop', nor a node
    # that could not even start): what `launch --restarts` restarts the job for.
    restartable: bool = False
    resumed: Resumed | None = None   # the state the attempt's training continued from
    regroup: Regroup | None = None   # the attempt stopped to go on under this plan (launch/adapt.py)


class JobController:
    def __init__(self, *, job_id: str, plan: Plan, links: list[AgentLink],
                 inbox: Mailbox[Inbound], book: JobBook, board: MetricsBoard,
                 emit: Callable[[Event], None], interrupt: Interrupt, grace_s: float,
                 heartbeat_timeout_s: float, detach: bool, jobs_root: str,
                 agent_job_id: str | None = None, attempt: int = 0, reached: int | None = None,
                 watch: Callable[[MetricsBoard], Regroup | None] | None = None) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.reached = reached         # samples the job had trained when the last attempt ended
        self.first_worker = plan.workers[0].rank if plan.workers else -1
        self.resumed: Resumed | None = None
        self.agent_job_id = agent_job_id or job_id   # what the agents run under (a restart's own id)
        self.plan = plan
        self.group_ranks = {g.id: tuple(g.ranks) for g in plan.groups}
        self.nodes = {link.node: _Node(link) for link in links}
        self.inbox = inbox
        self.book = book
        self.board = board
        self.emit = emit
        self.interrupt = interrupt
        self.grace_s = grace_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.detach = detach
        self.jobs_root = jobs_root
        self.reapers: list[threading.Thread] = []
        self.reap_notes: list[tuple[str, str]] = []
        self.role = {r.rank: r.role for r in plan.ranks}
        self.malformed: set[tuple[str, str]] = set()   # (node, frame type) told about
        self.intake = RecordIntake()               # tells of bad records once per rank / kind
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.root_cause: RootCause | None = None
        self.root_code: int | None = None
        self.stop_reason: str | None = None
        self.stop_deadline: float | None = None
        self.started: set[int] = set()
        self.notes: list[str] = []
        self.metrics_seen = False
        self.progress_at = 0.0
        self.stopped_outside = False   # an agent said 'hgtrain stop' stopped it: not restarted
        self.agent_stops: dict[str, str] = {}   # node -> why its agent stopped its ranks by itself
        self.watch = watch                # launch --adapt: re-grouping a running all-reduce job
        self.regroup: Regroup | None = None

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> Outcome:
        while not self._finished():
            for item in self.inbox.take(POLL_S):   # everything there is, before the periodic checks
                self._handle(item)
            self._check_interrupt()
            self._check_silence()
            self.book.tick()
            self._progress()
            self._check_watch()
            if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                self._give_up_waiting()
        for reaper in self.reapers:
            reaper.join(self.grace_s + REAP_EXTRA_S)
        for node, message in self.reap_notes:
            self._note(node, message)
        return self._outcome()

    def _check_watch(self) -> None:
        """A re-grouping that pays (launch/adapt.py): this attempt stops, the next runs its plan."""
        if self.watch is None or self.stop_reason is not None or self.root_cause is not None:
            return
        regroup = self.watch(self.board)
        if regroup is not None:
            self.regroup = regroup
            self._begin_stop(f"re-grouping: {regroup.reason}")

    def _finished(self) -> bool:
        if self.detach and self.root_cause is None and self.stop_reason is None:
            return all(n.detached or n.ended for n in self.nodes.values())
        return all(n.ended for n in self.nodes.values())

    def _progress(self) -> None:
        now = time.monotonic()
        if self.metrics_seen and now - self.progress_at >= PROGRESS_EVERY_S:
            self.progress_at, self.metrics_seen = now, False
            self.emit(Progress(self.job_id, self.board.view()))

    # -- frames --------------------------------------------------------------------------------------

    def _handle(self, item: Inbound) -> None:
        frame = item.frame
        if frame is None:
            self._connection_ended(self.nodes[item.node])
            return
        handler = self.HANDLERS.get(type(frame))   # the others (a late prepare answer): only heard
        if handler is not None:
            handler(self, item.node, frame)

    def _malformed(self, node: str, frame: Malformed) -> None:
        """Told once per node and frame type: an agent of another version may send many alike."""
        if (node, frame.type.value) not in self.malformed:
            self.malformed.add((node, frame.type.value))
            self._note(node, f"dropped a malformed '{frame.type.value}' frame from its agent ({frame.why})")

    def _role(self, node: str, kind: FrameType, rank: int) -> Role | None:
        """The role of a rank the plan has; None (the frame is reported and dropped) for another."""
        role = self.role.get(rank)
        if role is None:
            self._malformed(node, Malformed(kind, f"rank {rank} is not in the plan"))
        return role

    def _end(self, node: str, frame: Ended) -> None:
        entry = self.nodes[node]
        entry.ended, entry.end = True, frame
        if not frame.logs_complete:
            self._note(node, "the connection was too slow to forward every log line; the "
                             "node-local files are complete ('hgtrain logs' reads them)")

    def _stopping(self, node: str, frame: AgentStopping) -> None:
        """An agent stops its ranks on its own: only a failure of its own part (the job's store) is
        the job's root cause; for the rest (a stop asked for, a lost link) the ranks' exits say it.
        Only 'hgtrain stop' is the user's stop: a SIGTERM from elsewhere (a node shutting down)
        leaves the job restartable, as a lost node."""
        if frame.requested:
            self.stopped_outside = True
        self.agent_stops[node] = frame.reason or "stopped"
        if frame.failed:
            self._fail_node(node, frame.reason or "failed", EXIT_JOB)

    def _detached(self, node: str, frame: Detached) -> None:
        self.nodes[node].detached = True

    def _warning(self, node: str, frame: AgentWarning) -> None:
        who = f"rank {frame.rank}: " if frame.rank is not None else ""
        self._note(node, who + frame.message)

    def _error(self, node: str, frame: AgentError) -> None:
        self.nodes[node].ended = True   # the agent exits after this frame, having started nothing
        self._fail_node(node, f"its agent refused the job: {frame.message}", EXIT_JOB)

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
            self._note(node, note)
        self.book.write_metric(rank, node, data)
        self.board.add(rank, data)
        self.metrics_seen = True
        self.emit(Metric(self.job_id, rank, node, role, data))
        adapted = Adapted.parse(self.job_id, rank, data, self.group_ranks,
                                self.plan.ps_shards[0] if self.plan.ps_shards else None)
        if adapted is not None:
            self.emit(adapted)
        resumed = Resumed.parse(self.job_id, self.attempt, rank, self.first_worker, data, self.reached,
                                self.plan.ps_shards[0] if self.plan.ps_shards else None)
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
        if state is RankState.FAILED and self.root_cause is None and self.stop_reason is None:
            error, stack = recorded_error(frame.error)
            self.root_cause = RootCause(node=node, rank=rank, exit_code=code, signal=frame.signal_name,
                                        reason=reason, oom=frame.oom, error=error, traceback=stack)
            self.root_code = code if code else 1
            self._begin_stop(f"{node}:{rank} {reason}")
        elif state is RankState.STOPPED and self.stop_reason is None and not self.stopped_outside:
            # Its agent stopped it unasked (a SIGTERM from the node: a shutdown, a kill): the node
            # is going away, as lost; the other nodes stop now rather than wait in a collective.
            why = self.agent_stops.get(node, reason)
            self._fail_node(node, f"its agent stopped its ranks: {why}", EXIT_NODES_FAILED)

    # Dispatch on the decoded frame's type (launch/inbound.py).
    HANDLERS: ClassVar[dict[type, Callable[[JobController, str, Any], None]]] = {
        Logs: _logs, MetricRecord: _metric, Started: _started, Exited: _exit, Ended: _end,
        AgentStopping: _stopping, Detached: _detached, AgentWarning: _warning, AgentError: _error,
        Malformed: _malformed,
    }

    def _connection_ended(self, node: _Node) -> None:
        if node.ended:
            return
        if node.detached:
            node.ended = True     # the foreground agent exited after detaching: as designed
            return
        node.ended = True
        code = node.link.wait(2.0)
        detail = f"its agent exited with code {code}" if code is not None else "the connection closed"
        stderr = [line for line in node.link.stderr_tail if line.strip()]
        if stderr:
            detail += f"; agent stderr: {stderr[-1]}"
        self._lose(node.link.node, f"lost before the job ended ({detail})")
        self._reap(node.link)

    def _check_silence(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            return
        now = time.monotonic()
        for node in self.nodes.values():
            if node.ended or node.detached:
                continue
            silent = now - node.link.last_heard
            if silent > self.heartbeat_timeout_s:
                node.ended = True
                node.link.close(join_s=0.5)   # its agent stops its ranks on EOF / its own silence timer
                self._lose(node.link.node, f"lost: nothing heard from its agent for {silent:.0f} s "
                                           f"(heartbeat timeout {self.heartbeat_timeout_s:g} s)")
                self._reap(node.link)

    def _reap(self, link: AgentLink) -> None:
        """A lost agent may have left ranks running (an agent killed by SIGKILL cannot stop them):
        stop them over a fresh command, in the background; a cut link just makes this fail."""
        def reap() -> None:
            self.reap_notes.append((link.node, link.reap(self.agent_job_id, self.jobs_root, self.grace_s + REAP_EXTRA_S)))

        thread = threading.Thread(target=reap, name=f"hgtrain-reap-{link.node}", daemon=True)
        thread.start()
        self.reapers.append(thread)

    def _lose(self, node: str, reason: str) -> None:
        self.emit(NodeLost(self.job_id, node, self.attempt, reason))
        self._fail_node(node, reason, EXIT_NODES_FAILED)

    def fail_to_start(self, node: str, error: str) -> None:
        """The agent could not be started on ``node``: the job fails before it begins there."""
        self.nodes[node].ended = True
        self._fail_node(node, f"its agent did not start: {error}", EXIT_JOB)

    def _fail_node(self, node: str, reason: str, code: int) -> None:
        if self.root_cause is None and self.stop_reason is None:
            self.root_cause = RootCause(node=node, rank=None, exit_code=None, signal=None, reason=reason,
                                        oom=None)
            self.root_code = code
        else:
            self._note(node, reason)
        self._begin_stop(f"node {node} {reason}")

    def _note(self, node: str | None, message: str) -> None:
        self.notes.append(f"{node}: {message}" if node else message)
        self.emit(Notice(self.job_id, node, message))

    # -- stopping ------------------------------------------------------------------------------------

    def _check_interrupt(self) -> None:
        if self.interrupt.count == 0:
            return
        if self.stop_reason is None:
            name = signal.Signals(self.interrupt.signum or signal.SIGINT).name
            self._begin_stop(f"hgtrain received {name}")
        elif self.interrupt.count > 1 and self.stop_deadline is not None:
            self.stop_deadline = 0.0   # asked twice: stop waiting; the agents finish the stop alone

    def _begin_stop(self, reason: str) -> None:
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self.emit(Stopping(self.job_id, reason))
        for node in self.nodes.values():
            if not node.ended:
                node.link.stop()
        self.stop_deadline = time.monotonic() + self.grace_s + STOP_EXTRA_S

    def _give_up_waiting(self) -> None:
        for node in self.nodes.values():
            if not node.ended:
                node.ended = True
                node.link.close(join_s=0.5)
                self._note(node.link.node, "did not confirm the stop in time; its connection is closed, "
                                           "so its agent kills what is left by itself")

    # -- the result ----------------------------------------------------------------------------------

    def _outcome(self) -> Outcome:
        cause = self.root_cause
        if cause is not None and cause.rank is not None:
            cause = RootCause(**{**cause.__dict__, "last_lines": tuple(self.tails[cause.rank])})
        if cause is not None:
            restartable = (not self.interrupt.count and not self.stopped_outside
                           and (cause.rank is not None or self.root_code == EXIT_NODES_FAILED))
            return Outcome(JobState.FAILED, self.root_code or 1, cause, self.notes, restartable,
                           resumed=self.resumed)
        if self.interrupt.count:
            return Outcome(JobState.STOPPED, self.interrupt.exit_code, None, self.notes)
        if self.regroup is not None and not self.stopped_outside:
            return Outcome(JobState.RUNNING, 0, None, self.notes, resumed=self.resumed, regroup=self.regroup)
        if self.detach:
            return Outcome(JobState.RUNNING, 0, None, self.notes)
        ranks = self.book.record.ranks
        if all(r.state is RankState.SUCCEEDED for r in ranks):
            return Outcome(JobState.SUCCEEDED, 0, None, self.notes, resumed=self.resumed)
        if self.stopped_outside:
            # 'hgtrain stop' from another terminal: the user's stop, as a SIGTERM to this controller.
            return Outcome(JobState.STOPPED, EXIT_TERMINATED, None, self.notes)
        # Every agent ended without a failing rank, yet some rank did not succeed: report, not hide.
        odd = ", ".join(f"{r.node}:{r.rank} {r.state.value}" for r in ranks if r.state is not RankState.SUCCEEDED)
        return Outcome(JobState.FAILED, 1, RootCause(node="-", rank=None, exit_code=None, signal=None,
                                                     reason=f"ended without succeeding: {odd}", oom=None),
                       self.notes)

