"""Run one function on every node concurrently, finish every node, report one aggregate.

Modelled on Fabric's ThreadingGroup -> GroupResult: a failing node never hides the others.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from ..errors import HgError
from ..schema.stages import Cluster, NodeSpec
from .transport import Transport

T = TypeVar("T")

# Threads, not processes: the work is waiting on sockets. Bounded so a 500-node cluster does not
# open 500 connections at once from a laptop.
MAX_PARALLEL = 32


@dataclass(frozen=True)
class NodeResult(Generic[T]):
    """One node's part of a fan-out: its value or its one-line error, and how long it took."""

    node: NodeSpec
    value: T | None
    error: str | None
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class FanoutResult(Generic[T]):
    """Every node's result of a fan-out, in the nodes' order, split into succeeded and failed."""

    results: tuple[NodeResult[T], ...]   # in the order of the nodes given

    @property
    def succeeded(self) -> tuple[NodeResult[T], ...]:
        return tuple(r for r in self.results if r.ok)

    @property
    def failed(self) -> tuple[NodeResult[T], ...]:
        return tuple(r for r in self.results if not r.ok)


def fanout(nodes: Sequence[NodeSpec], fn: Callable[[NodeSpec], T], *,
           max_parallel: int = MAX_PARALLEL,
           on_done: Callable[[NodeResult[T]], None] | None = None) -> FanoutResult[T]:
    """``fn(node)`` for every node; an HgError becomes that node's error message.

    ``fn`` must bound its own waits (connect, read timeouts): fanout waits for every node.
    """

    def one(node: NodeSpec) -> NodeResult[T]:
        start = time.monotonic()
        try:
            value, error = fn(node), None
        except HgError as exc:
            value, error = None, getattr(exc, "reason", None) or str(exc)
        except Exception as exc:  # a bug on one node must not lose the other nodes' results
            value, error = None, f"internal error: {type(exc).__name__}: {exc}"
        result = NodeResult(node, value, error, time.monotonic() - start)
        if on_done is not None:
            on_done(result)
        return result

    if not nodes:
        return FanoutResult(())
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(nodes)))) as pool:
        return FanoutResult(tuple(pool.map(one, nodes)))


def open_transport(node: NodeSpec, cluster: Cluster) -> Transport:
    """The transport for a node of ``cluster``: a job step of its Slurm allocation when it is reached
    by srun (``--transport``), else local subprocesses for localhost and SSH otherwise (lazy imports)."""
    if cluster.srun is not None:
        from .srun import SrunTransport

        return SrunTransport(node, cluster.srun)
    if node.is_local:
        from .local import LocalTransport

        return LocalTransport(node)
    from .ssh import SshTransport

    return SshTransport(node, cluster.ssh)
