"""The Job stage's values: the record of a launched job and of its ranks (``status``, ``stop``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .base import SCHEMA_VERSION, frozen_map, settle
from .plan import Plan, Role
from .states import JobState, RankState


@dataclass(frozen=True)
class RankRecord:
    """A rank as a job record keeps it: where it ran, its state and exit, and its last metrics."""

    rank: int
    node: str
    role: Role
    state: RankState = RankState.PENDING
    exit_code: int | None = None
    signal: int | None = None
    last_metrics: Mapping[str, Any] = field(default_factory=dict)   # the rank's last record: JSON

    def __post_init__(self) -> None:
        settle(self, last_metrics=frozen_map(self.last_metrics))


@dataclass(frozen=True)
class JobRecord:
    """What `status` shows and `stop` needs; written atomically to the state dir. No secret values."""

    id: str
    cluster: str                   # Cluster.fingerprint()
    cluster_source: str | None     # the cluster file, None for the embedded default
    command: tuple[str, ...]
    plan: Plan
    state: JobState = JobState.STARTING
    ranks: tuple[RankRecord, ...] = ()
    started_at: float = 0.0
    ended_at: float | None = None
    exit_code: int | None = None
    root_cause: str | None = None  # first failing rank, host, code/signal, in words
    detached: bool = False
    restarts: tuple[str, ...] = ()  # reason of each restart, in order
    # The Slurm job whose steps run the agents (launched with --transport srun): status, logs and
    # stop reach the nodes as steps of it again, from inside or outside the allocation.
    slurm_job: str | None = None
    version: int = SCHEMA_VERSION
