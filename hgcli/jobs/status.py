"""``hgtrain status``: the job records, and for running jobs what their node agents say right now.

Every node of a running job is asked concurrently over a fresh connection (bounded by
``STATUS_TIMEOUT_S`` plus the cluster's connect timeout); a node that cannot be reached is shown as
``unknown`` with the reason, and never hides the others.

The record is corrected, never guessed: when every node of a job the record calls running has
answered and none has anything running any more (each finished, its agent gone with no rank left,
or no trace of the job), the record gets the final state the nodes report (failed when an agent
vanished before finishing), its end time and rank states. A job whose agent died while ranks still
run ("orphaned") keeps its running record: ``hgtrain stop`` ends it. With any node unreachable the
record is left alone.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping, cast

from ..state import records as jobs
from ..errors import HgError, StateError
from .nodes import JobNodes, agent_control, error_message, job_nodes, record_nodes
from ..schema.stages import JobRecord, JobState, RankState, to_dict
from ..node.protocol import FrameType, NodeJobState, StatusFrame, first
from ..remote.fanout import fanout

STATUS_TIMEOUT_S = 30.0          # one --status on a node: reads agent.json and /proc, normally < 1 s

# A node's state of the job: the agent's (NodeJobState, with orphaned and lost: the agent died
# mid-job with ranks still running / with none), or the controller's own: no job directory on the
# node (absent); the node did not answer (unknown).
ABSENT, UNREACHABLE = NodeJobState.ABSENT, NodeJobState.UNKNOWN
NODE_FINAL = (NodeJobState.SUCCEEDED, NodeJobState.FAILED, NodeJobState.STOPPED, NodeJobState.LOST, ABSENT)


@dataclass(frozen=True)
class LiveRank:
    """A rank as its node's agent reports it now (state, pid, exit, last metrics line)."""

    rank: int
    state: RankState
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    metrics: Mapping[str, Any] | None = None   # the rank's last metrics line, as it wrote it


@dataclass(frozen=True)
class NodeLive:
    """One node's live view of a job: the agent's state there and its ranks, or why the node could
    not say."""

    node: str
    state: NodeJobState            # the agent's job state on that node, or orphaned/lost/absent/unknown
    reachable: bool
    agent_alive: bool = False
    error: str | None = None       # why it is unknown, or what the node said
    ranks: tuple[LiveRank, ...] = ()
    ended_at: float | None = None
    first_failure: int | None = None   # the rank that failed first on that node


@dataclass(frozen=True)
class JobLive:
    """What every node of a job said when asked at ``checked_at``; ``status`` shows it beside the record."""

    job_id: str
    nodes: tuple[NodeLive, ...]
    checked_at: float

    @property
    def unreachable(self) -> tuple[NodeLive, ...]:
        return tuple(n for n in self.nodes if not n.reachable)

    @property
    def finished(self) -> bool:
        """Every node answered and nothing of the job runs anywhere."""
        return all(n.reachable and n.state in NODE_FINAL for n in self.nodes)


@dataclass(frozen=True)
class JobStatus:
    """``hgtrain status JOB``'s answer: the saved record, plus the nodes' live view while the record
    says the job may still run."""

    record: JobRecord
    live: JobLive | None           # None for a job its record says has ended
    unsaved: str | None = None     # why the record the nodes corrected could not be saved (shown anyway)


def _node_live(name: str, frame: StatusFrame) -> NodeLive:
    ranks = tuple(LiveRank(rank=int(r["rank"]), state=RankState.parse(r.get("state")), pid=r.get("pid"),
                           exit_code=r.get("code"), signal=r.get("signal"), reason=r.get("reason"),
                           metrics=r.get("metrics"))
                  for r in frame.get("ranks", []) if isinstance(r.get("rank"), int))
    return NodeLive(node=name, state=NodeJobState.parse(frame.get("state")), reachable=True,
                    agent_alive=bool(frame.get("agent_alive")), error=frame.get("reason"), ranks=ranks,
                    ended_at=frame.get("ended_at"), first_failure=_rank_of(frame.get("first_failure")))


def _rank_of(first: object) -> int | None:
    """agent.json keeps the first failing rank's number; the end frame the whole exit frame."""
    if isinstance(first, dict):
        first = first.get("rank")
    return first if isinstance(first, int) else None


def _ask(where: JobNodes, record: JobRecord, node_name: str) -> NodeLive:
    node = where.cluster.node(node_name)
    found = agent_control(where.cluster, node, jobs.agent_job_id(record), "status", timeout=STATUS_TIMEOUT_S)
    missing = error_message(found)
    if missing is not None:
        return NodeLive(node=node_name, state=ABSENT, reachable=True, error=missing)
    frame = first(found, FrameType.STATUS)
    if frame is None:
        return NodeLive(node=node_name, state=UNREACHABLE, reachable=False, error="no status frame")
    return _node_live(node_name, cast(StatusFrame, frame))


def _unknown(record: JobRecord, node: str, error: str) -> NodeLive:
    ranks = tuple(LiveRank(rank=r.rank, state=RankState.UNKNOWN)
                  for r in (record.ranks or record.plan.ranks) if r.node == node)
    return NodeLive(node=node, state=UNREACHABLE, reachable=False, error=error, ranks=ranks)


def live_status(record: JobRecord, where: JobNodes | None = None, transport: str = "auto") -> JobLive:
    """Ask every node of the job, concurrently; unreachable nodes are ``unknown`` with the reason."""
    if where is None:
        try:
            where = job_nodes(record, transport=transport)
        except HgError as exc:   # its cluster file is gone or broken: no node can be found
            return JobLive(record.id, tuple(_unknown(record, n, str(exc)) for n in record_nodes(record)),
                           time.time())
    results = fanout(where.nodes, lambda node: _ask(where, record, node.name))
    by_node = {r.node.name: (r.value if r.value is not None else _unknown(record, r.node.name, r.error or "failed"))
               for r in results.results}
    for name in where.missing:
        by_node[name] = _unknown(record, name, "no longer declared in the cluster's node source")
    nodes = tuple(by_node[n] for n in record_nodes(record) if n in by_node)
    return JobLive(job_id=record.id, nodes=nodes, checked_at=time.time())


def _final_state(live: JobLive) -> tuple[JobState, int | None, str | None]:
    """The job's end as the nodes tell it: failed first (with its root cause), then stopped."""
    for node in live.nodes:
        if node.state is NodeJobState.FAILED:
            rank = next((r for r in node.ranks if r.rank == node.first_failure), None) or next(
                (r for r in node.ranks if r.state is RankState.FAILED), None)
            if rank is None:
                return JobState.FAILED, None, f"{node.node}: {node.error or 'failed'}"
            code = rank.exit_code if rank.exit_code is not None else (128 + rank.signal if rank.signal else None)
            return JobState.FAILED, code, f"{node.node}: rank {rank.rank} {rank.reason or 'failed'}"
    for node in live.nodes:
        if node.state in (NodeJobState.LOST, ABSENT):
            return JobState.FAILED, None, f"{node.node}: the agent was gone before the job finished ({node.state.value})"
    if any(node.state is NodeJobState.STOPPED for node in live.nodes):
        return JobState.STOPPED, None, None
    return JobState.SUCCEEDED, 0, None


def reconcile(record: JobRecord, live: JobLive) -> JobRecord:
    """The record with what the nodes report: rank states always, the job's end once it has ended."""
    ranks = {r.rank: r for n in live.nodes for r in n.ranks}
    new_ranks = []
    for r in record.ranks:
        seen = ranks.get(r.rank)
        if seen is None or seen.state is RankState.UNKNOWN:
            new_ranks.append(r)
            continue
        new_ranks.append(dataclasses.replace(r, state=seen.state, exit_code=seen.exit_code, signal=seen.signal,
                                             last_metrics=seen.metrics or r.last_metrics))
    updated = dataclasses.replace(record, ranks=tuple(new_ranks))
    if not live.finished:
        return updated
    state, code, cause = _final_state(live)
    ended = max((n.ended_at for n in live.nodes if n.ended_at), default=live.checked_at)
    return dataclasses.replace(updated, state=state, ended_at=ended, exit_code=code,
                               root_cause=record.root_cause or cause)


def _save_if_still_running(fixed: JobRecord) -> JobStatus:
    """Write the corrected record unless its launcher finished it meanwhile (its word is richer). A
    state directory that is full or read-only does not hide what the nodes said: the status says it
    was not saved."""
    current = jobs.load(fixed.id)
    if not current.state.is_running():
        return JobStatus(current, None)
    try:
        jobs.save(fixed)
    except StateError as exc:
        return JobStatus(fixed, None, unsaved=str(exc))
    return JobStatus(fixed, None)


def job_status(job_id: str, transport: str = "auto") -> JobStatus:
    """One job: its record, and for a running one what its nodes say (the record fixed if it ended)."""
    record = jobs.load(job_id)
    return _with_live(record, transport)


def _with_live(record: JobRecord, transport: str) -> JobStatus:
    if not record.state.is_running():
        return JobStatus(record, None)
    live = live_status(record, transport=transport)
    if not live.finished:
        return JobStatus(record, live)
    saved = _save_if_still_running(reconcile(record, live))
    return dataclasses.replace(saved, live=live)


def list_status(transport: str = "auto") -> list[JobStatus]:
    """Every recorded job, newest first; running ones asked live (one job's failure never hides another)."""
    return [_with_live(record, transport) for record in jobs.list_jobs()]


def status_dict(status: JobStatus) -> dict[str, Any]:
    """``--json`` of one job: its record, plus ``live`` (what the nodes said; null for an ended job)."""
    return {**to_dict(status.record), "live": to_dict(status.live) if status.live else None}
