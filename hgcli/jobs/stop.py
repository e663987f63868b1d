"""``hgtrain stop JOB``: stop a job on every node, from any terminal, touching no other job.

Each node gets ``agent --stop JOB --node NODE`` over a fresh connection, concurrently: the agent
there stops its ranks (grace period, then SIGKILL) or, when the agent is gone, the command kills what
carries the job's marker itself (docs/agent.md). Only that job's processes are ever signalled.

The record: every rank on a node that confirmed becomes ``stopped`` (unless it had already ended);
ranks on a node that could not be reached become ``unknown``, and the job stays ``running`` so that
``status`` keeps checking it and ``stop`` can be repeated. Once every node confirmed, the job is
``stopped`` with its end time. A job that had already ended keeps its record; its nodes are still
asked, which cleans up anything left behind.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from ..state import records as jobs
from ..errors import NodesFailedError, RemoteError
from .nodes import agent_control, error_message, job_nodes
from ..schema.stages import Cluster, JobRecord, JobState, NodeSpec, RankState
from ..node.protocol import FrameType, first
from ..remote.fanout import fanout
from ..remote.srun import job_nodelists

# The agent waits its grace period (10 s by default) + 15 s for its ranks, then kills leftovers with
# another grace period: generous, still bounded.
STOP_TIMEOUT_S = 120.0
RESTART_CHASES = 3


@dataclass(frozen=True)
class NodeStop:
    """What ``hgtrain stop`` did on one node and what is left there, so a partial stop names the node
    and its pids."""

    node: str
    ok: bool                       # the node confirmed nothing of the job is left there
    agent: str | None = None       # "stopped" | "gone" | "not responding" | None (no job there)
    killed: tuple[int, ...] = ()   # pids the stop signalled itself (the agent was gone or too slow)
    left: tuple[int, ...] = ()     # pids still there afterwards
    state: str | None = None       # the node's job state afterwards
    error: str | None = None       # unreachable, or what is left


@dataclass(frozen=True)
class StopResult:
    """A stop over every node of the job, with the record as saved afterwards; ``failed`` names the
    nodes where something may be left."""

    record: JobRecord              # as saved afterwards
    nodes: tuple[NodeStop, ...]

    @property
    def failed(self) -> tuple[NodeStop, ...]:
        return tuple(n for n in self.nodes if not n.ok)


def _stop_node(job: JobRecord, cluster: Cluster, node: NodeSpec) -> NodeStop:
    try:
        found = agent_control(cluster, node, jobs.agent_job_id(job), "stop", timeout=STOP_TIMEOUT_S)
    except RemoteError:
        if cluster.srun is not None and not job_nodelists(cluster.srun):
            # The allocation ended while we stopped (under salloc or sbatch it ends when hgtrain
            # launch returns, which stopping another node made it do): Slurm has ended every
            # process of it on every node, this one's stop step included.
            return NodeStop(node=node.name, ok=True, agent="gone", state="allocation ended")
        raise
    missing = error_message(found)
    if missing is not None:   # no job directory there: nothing of the job can run on that node
        return NodeStop(node=node.name, ok=True, state="absent", error=missing)
    frame = first(found, FrameType.STOPPED) or {}
    left = tuple(frame.get("left") or ())
    return NodeStop(node=node.name, ok=bool(frame) and not left, agent=frame.get("agent"),
                    killed=tuple(frame.get("killed") or ()), left=left, state=frame.get("state"),
                    error=(f"processes left: {', '.join(map(str, left))}" if left else
                           None if frame else "no stopped frame from the agent"))


def stop_job(job_id: str, transport: str = "auto") -> StopResult:
    """Stop the job on every node (concurrently, bounded) and record the outcome."""
    record = jobs.load(job_id)
    where = job_nodes(record, transport=transport)
    results = fanout(where.nodes, lambda node: _stop_node(record, where.cluster, node))
    # A launch under --restarts may have started its next attempt (new agents, a new agent job id)
    # while we stopped the previous one: stop that one too, a bounded number of times.
    for _ in range(RESTART_CHASES):
        now = jobs.load(job_id)
        if len(now.restarts) == len(record.restarts) or not now.state.is_running():
            break
        record = now
        results = fanout(where.nodes, lambda node: _stop_node(record, where.cluster, node))
    by_node = {r.node.name: r.value or NodeStop(node=r.node.name, ok=False, error=r.error) for r in results.results}
    for name in where.missing:
        by_node[name] = NodeStop(node=name, ok=False, error="no longer declared in the cluster's node source")
    nodes = tuple(by_node[n] for n in dict.fromkeys(r.node for r in (record.ranks or record.plan.ranks)))
    return StopResult(_record_stop(record, nodes), nodes)


def _record_stop(record: JobRecord, nodes: tuple[NodeStop, ...]) -> JobRecord:
    current = jobs.load(record.id)     # the launcher may have finished it meanwhile
    if not current.state.is_running():
        return current
    confirmed = {n.node for n in nodes if n.ok}
    ranks = tuple(r if r.state.is_final() else
                  dataclasses.replace(r, state=RankState.STOPPED if r.node in confirmed else RankState.UNKNOWN)
                  for r in current.ranks)
    updated = dataclasses.replace(current, ranks=ranks)
    if len(confirmed) == len(nodes):
        updated = dataclasses.replace(updated, state=JobState.STOPPED, ended_at=time.time(),
                                      root_cause=current.root_cause or "stopped with 'hgtrain stop'")
    jobs.save(updated)
    return updated


def unconfirmed_error(result: StopResult) -> NodesFailedError | None:
    """Exit 4 naming every node that did not confirm, or None when all did."""
    if not result.failed:
        return None
    names = "; ".join(f"{n.node} ({n.error})" for n in result.failed)
    return NodesFailedError(f"job {result.record.id} not confirmed stopped on {len(result.failed)} node(s): "
                            f"{names}; run 'hgtrain stop' again when they are reachable")
