"""The launcher's restart logic as one state machine: how an attempt ended, and what follows.

An attempt (one start of the whole job on its nodes) ends in one of the ``AttemptEnd`` ways; the
controller of the attempt (``loop.JobController``) says which, in an ``Outcome``. ``what_follows`` is
the one place that decides what the launcher does next: start the same plan again, re-plan on the
nodes that answer (``--nnodes``), run a re-grouped plan (``--adapt``), or end the job (as the attempt
ended, given up for want of restarts, stopped, or left running detached).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..schema.stages import JobState
from .adapt import Regroup
from .events import Resumed, RootCause


class AttemptEnd(str, enum.Enum):
    """How one attempt ended (what happened, not what the launcher does about it)."""

    SUCCEEDED = "succeeded"   # every rank succeeded
    FAILED = "failed"         # a rank failed, or the job could not start or run (see Outcome.restartable)
    STOPPED = "stopped"       # the user's stop: Ctrl-C / SIGTERM to hgtrain, or 'hgtrain stop'
    REGROUP = "regroup"       # stopped by the launcher to go on under a re-grouped plan (launch/adapt.py)
    REPLAN = "replan"         # a node was lost: the next attempt needs a plan on the nodes that answer
    DETACHED = "detached"     # every agent detached; the job runs on without the launcher

    @property
    def job_state(self) -> JobState:
        """The job's state if it ends with this attempt (a lost node is the job's failure)."""
        return _JOB_STATE[self]


_JOB_STATE = {AttemptEnd.SUCCEEDED: JobState.SUCCEEDED, AttemptEnd.FAILED: JobState.FAILED,
              AttemptEnd.STOPPED: JobState.STOPPED, AttemptEnd.REGROUP: JobState.STOPPED,
              AttemptEnd.REPLAN: JobState.FAILED, AttemptEnd.DETACHED: JobState.RUNNING}


@dataclass
class Outcome:
    """One attempt's ending, with what the launcher needs to decide and to report it."""

    end: AttemptEnd
    exit_code: int
    root_cause: RootCause | None
    notes: list[str] = field(default_factory=list)
    # A rank failed or a node was lost (not a stop asked for by Ctrl-C or 'hgtrain stop', nor a node
    # that could not even start): what `launch --restarts` restarts the job for. Always so for REPLAN.
    restartable: bool = False
    resumed: Resumed | None = None   # the state the attempt's training continued from
    regroup: Regroup | None = None   # REGROUP: the plan the next attempt runs

    def __post_init__(self) -> None:
        if (self.end is AttemptEnd.REGROUP) != (self.regroup is not None):
            raise ValueError("an attempt ends 'regroup' exactly when it carries the re-grouped plan")
        if self.end is AttemptEnd.REPLAN and not self.restartable:
            raise ValueError("a lost node ('replan') is always restartable; a failure for good is 'failed'")

    @property
    def state(self) -> JobState:
        return self.end.job_state


class Next(str, enum.Enum):
    """What the launcher does after an attempt ends."""

    RESTART = "restart"     # the same plan again on the same nodes (one of --restarts)
    REPLAN = "replan"       # --nnodes: the nodes that answer, and a plan on them when they changed (one of --restarts)
    REGROUP = "regroup"     # the re-grouped plan (not one of --restarts)
    FINISH = "finish"       # the job ends as the attempt did
    GIVE_UP = "give_up"     # a failure a restart could fix, but no restarts are left: the job fails
    STOP = "stop"           # the user stopped hgtrain while the attempt re-grouped: the job ends stopped
    DETACH = "detach"       # the job runs on, detached: the launcher ends, the job does not

    @property
    def restarts(self) -> bool:
        """Whether another attempt starts."""
        return self in (Next.RESTART, Next.REPLAN, Next.REGROUP)


def what_follows(outcome: Outcome, *, restarts_left: int, elastic: bool, interrupted: bool) -> Next:
    """The one decision after every attempt. ``restarts_left``: of ``--restarts``; ``elastic``: the
    request's ``--nnodes`` lets the job run on a changing set of nodes; ``interrupted``: hgtrain was
    asked to stop (a signal), which no restart overrides."""
    end = outcome.end
    if end is AttemptEnd.DETACHED:
        return Next.DETACH
    if end is AttemptEnd.REGROUP:
        return Next.STOP if interrupted else Next.REGROUP
    if interrupted or end in (AttemptEnd.SUCCEEDED, AttemptEnd.STOPPED) or not outcome.restartable:
        return Next.FINISH
    if restarts_left <= 0:
        return Next.GIVE_UP
    # Under --nnodes a failed rank re-plans too: a node lost by an earlier attempt may answer again.
    return Next.REPLAN if elastic else Next.RESTART
