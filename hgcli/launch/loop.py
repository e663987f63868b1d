"""The controller of one attempt: its agents' frames in, until every agent has ended, then the outcome.

One thread (the caller's) consumes the agents' frames from one inbox, so every decision sees the
frames in arrival order and the root cause is the first failure that reached us. The work is split
by job: ``frame_handlers`` (frames -> the job's record and events), ``liveness`` (connections,
heartbeats, reaping) and ``stopping`` (root cause, the stop of every agent, the outcome);
``ending.what_follows`` then decides what the launcher does after the attempt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .adapt import Regroup
from .agentlink import AgentLink, Inbound
from .ending import Outcome
from .events import Event
from .frame_handlers import FrameHandlers
from .liveness import Liveness
from .mailbox import Mailbox
from .metrics import MetricsBoard
from .record import JobBook
from ..errors import EXIT_JOB
from ..schema.stages import Plan
from .stopping import AgentNode, Interrupt, Stop

POLL_S = 0.2


@dataclass(frozen=True)
class AttemptSettings:
    """What one attempt's controller is to run and how patiently (from the request)."""

    job_id: str
    plan: Plan
    grace_s: float
    heartbeat_timeout_s: float
    detach: bool
    jobs_root: str
    agent_job_id: str | None = None   # what the agents run under (a restart's own id); None: job_id
    attempt: int = 0
    reached: int | None = None        # samples the job had trained when the last attempt ended


class JobController:
    """Runs one attempt to its end: takes every frame, runs the periodic checks (a signal, silence,
    a re-grouping that pays), and returns the attempt's ``Outcome``."""

    def __init__(self, settings: AttemptSettings, *, links: list[AgentLink], inbox: Mailbox[Inbound],
                 book: JobBook, board: MetricsBoard, emit: Callable[[Event], None], interrupt: Interrupt,
                 watch: Callable[[MetricsBoard], Regroup | None] | None = None) -> None:
        self.settings, self.inbox, self.book, self.board = settings, inbox, book, board
        nodes = {link.node: AgentNode(link) for link in links}
        self.stop = Stop(settings.job_id, nodes, emit, interrupt, settings.grace_s)
        self.frames = FrameHandlers(plan=settings.plan, attempt=settings.attempt, reached=settings.reached,
                                    inbox=inbox, book=book, board=board, stop=self.stop)
        self.liveness = Liveness(self.stop, attempt=settings.attempt,
                                 heartbeat_timeout_s=settings.heartbeat_timeout_s,
                                 agent_job_id=settings.agent_job_id or settings.job_id, jobs_root=settings.jobs_root)
        self.watch = watch                # launch --adapt: re-grouping a running all-reduce job
        self.regroup: Regroup | None = None

    def run(self) -> Outcome:
        while not self.stop.finished(self.settings.detach):
            for item in self.inbox.take(POLL_S):   # everything there is, before the periodic checks
                self.handle(item)
            self.stop.check_interrupt()
            self.liveness.check_silence()
            self.book.tick()
            self.frames.progress()
            self._check_watch()
            self.stop.check_deadline()
        self.liveness.join()
        return self.stop.outcome(tails=self.frames.tails, resumed=self.frames.resumed, regroup=self.regroup,
                                 detach=self.settings.detach, ranks=self.book.record.ranks)

    def handle(self, item: Inbound) -> None:
        """One item of the inbox: an agent's frame, or (no frame) the end of its connection."""
        if item.frame is None:
            self.liveness.connection_ended(self.stop.nodes[item.node])
        else:
            self.frames.handle(item.node, item.frame)

    def fail_to_start(self, node: str, error: str) -> None:
        """The agent could not be started on ``node``: the job fails before it begins there."""
        self.stop.nodes[node].ended = True
        self.stop.fail_node(node, f"its agent did not start: {error}", EXIT_JOB)

    def _check_watch(self) -> None:
        """A re-grouping that pays (launch/adapt.py): this attempt stops, the next runs its plan."""
        if self.watch is None or not self.stop.quiet:
            return
        regroup = self.watch(self.board)
        if regroup is not None:
            self.regroup = regroup
            self.stop.begin(f"re-grouping: {regroup.reason}")
