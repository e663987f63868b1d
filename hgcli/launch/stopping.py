"""Stopping one attempt, and how it ended: the root cause, the stop of every agent, the outcome.

The first failure that reaches the controller is the root cause; every agent is then told to stop
(its grace period, then SIGKILL). SIGINT/SIGTERM to hgtrain stop everyone the same way (exit
130/143). After a stop, the controller waits at most ``grace_s + STOP_EXTRA_S`` for every ``end``,
then drops the connections (the agents still kill their ranks: they die with their connection).
"""
from __future__ import annotations

import collections
import signal
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import EXIT_NODES_FAILED, EXIT_TERMINATED
from ..schema.stages import RankRecord, RankState
from .adapt import Regroup
from .agentlink import AgentLink
from .ending import AttemptEnd, Outcome
from .events import Event, Notice, Resumed, RootCause, Stopping
from .inbound import Ended

STOP_EXTRA_S = 20.0     # beyond the grace period: the agent's 5 s after SIGKILL, draining its logs


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
class AgentNode:
    """One node's agent as the controller follows it through an attempt."""

    link: AgentLink
    ended: bool = False            # `end` received, or given up on
    detached: bool = False
    end: Ended | None = None


class Stop:
    """An attempt's root cause and stop: who failed first, telling every agent to stop, how long to
    wait for them, and the ``Outcome`` once they have all ended."""

    def __init__(self, job_id: str, nodes: dict[str, AgentNode], emit: Callable[[Event], None],
                 interrupt: Interrupt, grace_s: float) -> None:
        self.job_id, self.nodes, self.emit, self.interrupt, self.grace_s = job_id, nodes, emit, interrupt, grace_s
        self.root_cause: RootCause | None = None
        self.root_code: int | None = None
        self.reason: str | None = None           # why every agent was told to stop; None: not told
        self.deadline: float | None = None
        self.notes: list[str] = []
        self.stopped_outside = False   # an agent said 'hgtrain stop' stopped it: not restarted

    @property
    def quiet(self) -> bool:
        """Nothing has failed and no stop began: the attempt runs as it should."""
        return self.root_cause is None and self.reason is None

    def note(self, node: str | None, message: str) -> None:
        self.notes.append(f"{node}: {message}" if node else message)
        self.emit(Notice(self.job_id, node, message))

    def fail_rank(self, cause: RootCause, code: int) -> None:
        """A rank failed (``cause`` names it): the root cause when it is the first failure."""
        if self.quiet:
            self.root_cause, self.root_code = cause, code
            self.begin(f"{cause.node}:{cause.rank} {cause.reason}")

    def fail_node(self, node: str, reason: str, code: int) -> None:
        if self.quiet:
            self.root_cause = RootCause(node=node, rank=None, exit_code=None, signal=None, reason=reason,
                                        oom=None)
            self.root_code = code
        else:
            self.note(node, reason)
        self.begin(f"node {node} {reason}")

    def begin(self, reason: str) -> None:
        """Tell every agent still running to stop its ranks (once)."""
        if self.reason is not None:
            return
        self.reason = reason
        self.emit(Stopping(self.job_id, reason))
        for node in self.nodes.values():
            if not node.ended:
                node.link.stop()
        self.deadline = time.monotonic() + self.grace_s + STOP_EXTRA_S

    def check_interrupt(self) -> None:
        if self.interrupt.count == 0:
            return
        if self.reason is None:
            name = signal.Signals(self.interrupt.signum or signal.SIGINT).name
            self.begin(f"hgtrain received {name}")
        elif self.interrupt.count > 1 and self.deadline is not None:
            self.deadline = 0.0   # asked twice: stop waiting; the agents finish the stop alone

    def check_deadline(self) -> None:
        """Past the stop's deadline, stop waiting for the agents that have not confirmed it."""
        if self.deadline is None or time.monotonic() <= self.deadline:
            return
        for node in self.nodes.values():
            if not node.ended:
                node.ended = True
                node.link.close(join_s=0.5)
                self.note(node.link.node, "did not confirm the stop in time; its connection is closed, "
                                          "so its agent kills what is left by itself")

    def finished(self, detach: bool) -> bool:
        """Every agent has ended (or, detaching without a failure or stop, detached or ended)."""
        if detach and self.quiet:
            return all(n.detached or n.ended for n in self.nodes.values())
        return all(n.ended for n in self.nodes.values())

    def outcome(self, *, tails: collections.defaultdict[int, collections.deque[str]], resumed: Resumed | None,
                regroup: Regroup | None, detach: bool, ranks: Sequence[RankRecord]) -> Outcome:
        """How the attempt ended, once every agent has: ``tails`` are the ranks' last lines (the
        root-cause rank's are shown with it), ``ranks`` the job record's."""
        cause = self.root_cause
        if cause is not None:
            return self._failed(cause, tails, resumed)
        if self.interrupt.count:
            return Outcome(AttemptEnd.STOPPED, self.interrupt.exit_code, None, self.notes)
        if regroup is not None and not self.stopped_outside:
            return Outcome(AttemptEnd.REGROUP, 0, None, self.notes, resumed=resumed, regroup=regroup)
        if detach:
            return Outcome(AttemptEnd.DETACHED, 0, None, self.notes)
        if all(r.state is RankState.SUCCEEDED for r in ranks):
            return Outcome(AttemptEnd.SUCCEEDED, 0, None, self.notes, resumed=resumed)
        if self.stopped_outside:
            # 'hgtrain stop' from another terminal: the user's stop, as a SIGTERM to this controller.
            return Outcome(AttemptEnd.STOPPED, EXIT_TERMINATED, None, self.notes)
        # Every agent ended without a failing rank, yet some rank did not succeed: report, not hide.
        odd = ", ".join(f"{r.node}:{r.rank} {r.state.value}" for r in ranks if r.state is not RankState.SUCCEEDED)
        return Outcome(AttemptEnd.FAILED, 1, RootCause(node="-", rank=None, exit_code=None, signal=None,
                                                       reason=f"ended without succeeding: {odd}", oom=None),
                       self.notes)

    def _failed(self, cause: RootCause, tails: collections.defaultdict[int, collections.deque[str]],
                resumed: Resumed | None) -> Outcome:
        if cause.rank is not None:
            cause = RootCause(**{**cause.__dict__, "last_lines": tuple(tails[cause.rank])})
        lost = self.root_code == EXIT_NODES_FAILED
        restartable = not self.interrupt.count and not self.stopped_outside and (cause.rank is not None or lost)
        end = AttemptEnd.REPLAN if lost and restartable else AttemptEnd.FAILED
        return Outcome(end, self.root_code or 1, cause, self.notes, restartable, resumed=resumed)

