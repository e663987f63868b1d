"""What the supervisor's thread reacts to: one frozen value per kind of event on its queue.

Waiter threads, the stdin reader, the frame writer, the store's watcher and signal handlers only
put these on the queue; the supervisor alone decides what each means (``Supervisor.HANDLERS``, a
table keyed on the event's class).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .store import StoreFailure


@dataclass(frozen=True, slots=True)
class RankExited:
    """A rank's waiter thread saw it exit (it stays an unreaped zombie until the end)."""

    rank: int
    code: int | None
    signal: int | None


@dataclass(frozen=True, slots=True)
class Signalled:
    """SIGTERM, SIGINT or SIGHUP to the agent."""

    signum: int


@dataclass(frozen=True, slots=True)
class StopRequested:
    """The controller sent a stop frame."""


@dataclass(frozen=True, slots=True)
class StdinClosed:
    """The controller's end of stdin closed: it is gone."""


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """A write to the controller failed: the connection broke."""


@dataclass(frozen=True, slots=True)
class StoreEnded:
    """The job's rendezvous store ended before the job."""

    failure: StoreFailure


Event = Union[RankExited, Signalled, StopRequested, StdinClosed, WriteFailed, StoreEnded]

# A detached agent has no connection: these mean nothing to it.
CONNECTION_EVENTS: frozenset[type[Event]] = frozenset({StopRequested, StdinClosed, WriteFailed})
# While the last logs drain: someone wants the agent gone now (a signal), or nobody reads them any more.
ENDS_DRAIN: frozenset[type[Event]] = frozenset({StdinClosed, WriteFailed, Signalled})
