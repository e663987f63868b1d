"""A recorded job's nodes, and its node agents reached over fresh connections.

``status``, ``logs`` and ``stop`` run from any terminal, long after ``launch`` returned: they find the
nodes again from the job record (its node source and the plan's node names) and talk to the agent
program (``python -m hgcli.node.agent --status|--stop|--tail JOB --node NODE``, docs/agent.md) over a
new connection each. The agents keep their job directories under their default jobs root
(``~/.cache/hgtrain/jobs`` on the node), the same one launch starts them with.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from ..errors import ConfigError, RemoteError
from ..schema.stages import Cluster, JobRecord, NodeSpec
from ..node import frames
from ..node.protocol import FrameType, first
from ..remote.fanout import open_transport
from ..remote.transport import RemoteProcess, node_module_argv


@dataclass(frozen=True)
class JobNodes:
    """The nodes a job runs on, in plan order, as the cluster declares them now."""

    cluster: Cluster
    nodes: tuple[NodeSpec, ...]
    missing: tuple[str, ...]       # job nodes the node source no longer declares: they cannot be reached


def record_nodes(record: JobRecord) -> tuple[str, ...]:
    """Node names of the job, in rank order, each once."""
    names = [r.node for r in record.ranks] or [r.node for r in record.plan.ranks]
    return tuple(dict.fromkeys(names))


def cluster_of(record: JobRecord, transport: str = "auto") -> Cluster:
    """The job's node source, read again: the embedded cluster, Slurm's list, a cluster file or a
    hostfile. A job launched by srun is reached as steps of its allocation again (``transport``
    auto or srun), from inside the allocation or from any other terminal of the cluster."""
    cluster = _source_of(record)
    if transport == "ssh" or (transport == "auto" and record.slurm_job is None):
        return cluster
    from ..config import slurm

    settings = slurm.wanted("srun", os.environ, record.slurm_job)
    assert settings is not None   # wanted("srun") returns one or raises
    return slurm.reach_by_srun(cluster, settings, os.environ, required=True)


def _source_of(record: JobRecord) -> Cluster:
    from ..config.cluster import SLURM_SOURCE, cluster_from_slurm, default_cluster, load_hostfile, load_node_source
    from ..config.slurm import allocation_nodelist

    source = record.cluster_source
    if source is None:
        return default_cluster()
    if source == SLURM_SOURCE:
        if record.slurm_job is not None:
            # Launched by srun: the controller's Python on the shared file system, as then. Outside
            # the allocation there is no SLURM_JOB_NODELIST: the nodes the job ran on, as recorded.
            nodelist = allocation_nodelist(os.environ) or ",".join(record_nodes(record))
            return cluster_from_slurm(nodelist, python=sys.executable)
        return load_node_source(None)
    try:
        return load_node_source(source)
    except ConfigError as first:
        try:
            return load_hostfile(source)   # the record does not say which kind of file it was
        except ConfigError:
            raise ConfigError(f"job {record.id}: cannot read its node source again: {first}") from None


def job_nodes(record: JobRecord, cluster: Cluster | None = None, transport: str = "auto") -> JobNodes:
    cluster = cluster or cluster_of(record, transport)
    declared = {n.name: n for n in cluster.nodes}
    names = record_nodes(record)
    return JobNodes(cluster, tuple(declared[n] for n in names if n in declared),
                    tuple(n for n in names if n not in declared))


def agent_control(cluster: Cluster, node: NodeSpec, job_id: str, action: str, *,
                  timeout: float) -> list[dict[str, Any]]:
    """``agent --<action> JOB --node NODE`` on the node: its frames. RemoteError (host named) when the
    node cannot be reached, times out, or answers with no frame at all (no hgtrain there)."""
    with open_transport(node, cluster) as transport:
        argv, env = node_module_argv(transport, "agent", f"--{action}", job_id, "--node", node.name)
        done = transport.run(argv, env=env, timeout=timeout)
    found = frames.decode_lines(done.stdout)
    if not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RemoteError(node.name, f"the agent gave no answer to --{action} (exit code {done.exit_code}): {last}")
    return found


def error_message(found: list[dict[str, Any]]) -> str | None:
    """The message of the agent's ``error`` frame (e.g. no such job on this host), or None."""
    error = first(found, FrameType.ERROR)
    return None if error is None else str(error.get("message"))


class AgentTail:
    """``agent --tail JOB --node NODE [--follow]`` kept open: its stdout is read line by line; closing
    it (stdin EOF) ends a follow on the node without touching the job."""

    def __init__(self, cluster: Cluster, node: NodeSpec, job_id: str, *, follow: bool,
                 offsets: str | None = None) -> None:
        self.node = node
        self._transport = open_transport(node, cluster)
        args = ["--tail", job_id, "--node", node.name] + (["--follow"] if follow else [])
        args += ["--from", offsets] if offsets else []
        argv, env = node_module_argv(self._transport, "agent", *args)
        try:
            self._proc: RemoteProcess = self._transport.start(argv, env=env)
        except BaseException:
            self._transport.close()
            raise

    def frames(self) -> Iterator[dict[str, Any]]:
        """Frames until the node closes the stream (tail_end is the last one when all went well)."""
        for raw in iter(self._proc.stdout.readline, b""):
            frame = frames.decode(raw.decode("utf-8", "replace"))
            if frame is not None:
                yield frame

    def close(self) -> None:
        self._proc.close()
        self._transport.close()
