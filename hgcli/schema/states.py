"""The states of a rank and of a job, shared by the node agent, the controller and the job record.

Standard library only: the agent imports these on start-up (it is shipped with the package), and the
stage dataclasses (``stages``) record them. Never format a member directly (``f"{state}"`` gives
``RankState.FAILED`` on Python 3.11): use ``.value``.
"""
from __future__ import annotations

import enum
from typing import TypeVar

_S = TypeVar("_S", bound="_States")


class _States(str, enum.Enum):
    """The state enums' base: ``parse`` reads the plain string of a decoded frame or a record."""

    @classmethod
    def parse(cls: type[_S], value: object) -> _S:
        """The member ``value`` names; ``unknown`` for anything else."""
        try:
            return cls(value)
        except ValueError:
            return cls("unknown")


class RankState(_States):
    """One rank's state: in the agent's record and frames, and in the controller's job record."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"        # exited with code 0
    FAILED = "failed"              # non-zero or a signal, before any stop: a root cause
    STOPPED = "stopped"            # ended after hgtrain's stop began
    UNKNOWN = "unknown"            # still there after SIGKILL, or its node cannot be reached

    def is_running(self) -> bool:
        return self in (RankState.PENDING, RankState.RUNNING)

    def is_final(self) -> bool:
        return self in (RankState.SUCCEEDED, RankState.FAILED, RankState.STOPPED)


class NodeJobState(_States):
    """A job's state on one node: the agent's record (agent.json) and its ``end`` and ``status`` frames."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"              # a rank failed (the end frame's first_failure), or the job's store
    STOPPED = "stopped"
    ORPHANED = "orphaned"          # --status: the agent died before finishing; ranks still run
    LOST = "lost"                  # --status: the agent died before finishing; none runs
    UNKNOWN = "unknown"            # no state recorded; on the controller: the node did not answer
    ABSENT = "absent"              # the controller's: the node has no trace of the job

    def is_final(self) -> bool:
        """The agent finished the job (its record will not change again)."""
        return self in (NodeJobState.SUCCEEDED, NodeJobState.FAILED, NodeJobState.STOPPED)


class JobState(str, enum.Enum):
    """A job's state on the controller: its record's, and the launch's outcome."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    def is_running(self) -> bool:
        return self in (JobState.STARTING, JobState.RUNNING)
