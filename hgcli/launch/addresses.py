"""Where a job's ranks meet: rank 0's node as the others reach it (MASTER_ADDR), and the address
each node's ranks listen on. Both checked against the plan, so a cluster that cannot work is refused
before any node is contacted."""
from __future__ import annotations

from ..errors import UsageError
from ..schema.stages import Cluster, NodeSpec, Plan


def master_address(plan: Plan, cluster: Cluster) -> str:
    """MASTER_ADDR: rank 0's node as the other nodes reach it.

    A node declared ``localhost`` is 127.0.0.1, which only ranks on this machine can reach: with
    remote nodes in the plan that cannot work, so it is refused rather than left to time out."""
    node = cluster.node(plan.rank(0).node)
    if not node.is_local:
        return node.address
    remote = sorted({r.node for r in plan.ranks if not cluster.node(r.node).is_local})
    if remote:
        raise UsageError(f"rank 0 runs on node {node.name!r} (host {node.host}), which nodes "
                         f"{', '.join(remote)} cannot reach as 127.0.0.1: declare this machine by an "
                         "address they reach (host = \"10.0.0.5\") instead of localhost")
    return "127.0.0.1"


def bind_address(node: NodeSpec, plan: Plan, cluster: Cluster) -> str | None:
    """Where ``node``'s ranks listen (gloo, NCCL, TensorPipe): the address its peers reach it by.
    All ranks on this machine: loopback. A ``localhost`` node beside remote nodes has no address
    hgtrain knows its peers use: torch's own choice (the host name's address) stays."""
    if not node.is_local:
        return node.address
    if all(cluster.node(r.node).is_local for r in plan.ranks):
        return "127.0.0.1"
    return None


def store_peers(plan: Plan, cluster: Cluster) -> tuple[list[str], bool]:
    """Where the job's store on rank 0's node admits ranks from besides its own machine: the hosts
    of the plan's other nodes, and whether some ranks run on this (the launcher's) machine as a
    ``localhost`` node beside remote ones (they connect from the address rank 0's node sees the
    launcher at). Processes on rank 0's own machine are admitted by their user instead
    (node/store/peers.py)."""
    rank0 = plan.rank(0).node
    nodes = [cluster.node(n) for n in dict.fromkeys(r.node for r in plan.ranks) if n != rank0]
    local_rank0 = cluster.node(rank0).is_local
    return sorted({n.address for n in nodes if not n.is_local}), not local_rank0 and any(n.is_local for n in nodes)
