"""Link benchmarks: every pair of nodes, in rounds where no node is in two pairs at once.

The rounds are a round-robin tournament (circle method): n - 1 rounds of n / 2 pairs for n nodes,
each pair exactly once. Pairs of one round run concurrently; since they share no node, a node's NIC
carries one test at a time. Each pair is a 2-rank process group (``hgcli.node.bench.link``) of the
backend training will use: NCCL when both nodes have real GPUs with CUDA torch, else gloo.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from ..errors import RemoteError
from ..schema.stages import Cluster, Inventory, LinkProfile, Measurement, NodeInfo, NodeSpec, from_dict
from ..remote.fanout import MAX_PARALLEL, open_transport
from ..remote.node_program import NodeProgram
from ..node.protocol import FrameType, frame_type

# Per pair, the torch import on both nodes included; the node side bounds each of its waits by
# the --timeout it is given.
LINK_TIMEOUT_S = {True: 180.0, False: 600.0}
NODE_WAIT_S = 60.0


def link_rounds(names: list[str]) -> list[list[tuple[str, str]]]:
    """Every unordered pair once, grouped in rounds where each name appears at most once."""
    items: list[str | None] = list(names)
    if len(items) % 2:
        items.append(None)  # a bye: its partner sits the round out
    n = len(items)
    rounds = []
    for _ in range(n - 1):
        pairs = [(items[i], items[n - 1 - i]) for i in range(n // 2)]
        played = [(a, b) for a, b in pairs if a is not None and b is not None]
        if played:
            rounds.append(played)
        items = [items[0], items[-1], *items[1:-1]]
    return rounds


def link_backend(a: NodeInfo, b: NodeInfo) -> str:
    def has_cuda(n: NodeInfo) -> bool:
        return bool(n.torch_cuda) and any(not g.emulated for g in n.gpus)

    return "nccl" if has_cuda(a) and has_cuda(b) else "gloo"


def intra_node_gloo(node: NodeInfo) -> bool:
    """Whether the devices of this node exchange through gloo over its loopback: two or more
    emulated GPUs, or GPUs that this node's torch cannot drive with NCCL. Such a node's intra-node
    link is measured (a "link" from the node to itself), because it is nothing like the NVLink/PCIe
    rate the planner assumes for a GPU node. NCCL between two GPUs of one node is not measured."""
    return len(node.gpus) >= 2 and (any(g.emulated for g in node.gpus) or not node.torch_cuda)


def bench_links(cluster: Cluster, inventory: Inventory, *, quick: bool,
                on_event: Callable[[str, str], None]) -> tuple[LinkProfile, ...]:
    """Links between the nodes the inventory reached, then (one round, each on its own node) the
    intra-node gloo link of nodes where ``intra_node_gloo``; ``on_event("a<->b", stage)`` for progress."""
    infos = {n.name: n for n in inventory.succeeded}
    names = [n.name for n in cluster.nodes if n.name in infos]
    links: list[LinkProfile] = []
    selves = [(name, name) for name in names if intra_node_gloo(infos[name])]
    for pairs in link_rounds(names) + ([selves] if selves else []):
        def one(pair: tuple[str, str]) -> LinkProfile:
            a, b = pair
            on_event(f"{a}<->{b}", "measuring")
            link = bench_link(cluster, cluster.node(a), cluster.node(b),
                              link_backend(infos[a], infos[b]), quick=quick)
            on_event(f"{a}<->{b}", "failed" if link.error else "done")
            return link

        with ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(pairs)))) as pool:
            links.extend(pool.map(one, pairs))
    return tuple(links)


def bench_link(cluster: Cluster, a: NodeSpec, b: NodeSpec, backend: str, *, quick: bool) -> LinkProfile:
    """One pair; every failure (connect, store, collective, timeout) is the link's error."""
    try:
        return _measure(cluster, a, b, backend, quick)
    except RemoteError as exc:
        return LinkProfile(a=a.name, b=b.name, backend=backend, error=str(exc))
    except (ValueError, KeyError) as exc:
        return LinkProfile(a=a.name, b=b.name, backend=backend, error=f"bad result from the node: {exc}")


def _measure(cluster: Cluster, a: NodeSpec, b: NodeSpec, backend: str, quick: bool) -> LinkProfile:
    # Rank 0 hosts the store, so its address must be reachable from the other node: a node the
    # controller calls "localhost" is only reachable as such from another local node. Both ranks
    # of an intra-node link run on one node and meet on its loopback.
    first, second = (b, a) if a.is_local and not b.is_local else (a, b)
    addr = "127.0.0.1" if first.is_local or a.name == b.name else first.address
    deadline = time.monotonic() + LINK_TIMEOUT_S[quick]
    common = ["--addr", addr, "--backend", backend, "--timeout", repr(NODE_WAIT_S), "--lifeline"]
    common += ["--quick"] if quick else []

    def fail(message: str) -> LinkProfile:
        return LinkProfile(a=a.name, b=b.name, backend=backend, error=message)

    with open_transport(first, cluster) as t0, open_transport(second, cluster) as t1, \
            NodeProgram(t0, "bench.link", ["--rank", "0", *common]) as rank0:
        frames0 = rank0.frames(deadline)
        port = None
        for frame in frames0:
            kind = frame_type(frame)
            if kind is FrameType.LISTENING:
                port = int(frame["port"])
                break
            if kind is FrameType.ERROR:
                return fail(f"{first.name}: {frame.get('message')}")
        if port is None:
            return fail(f"{first.name}: {rank0.failure(rank0.finish(deadline))}")
        with NodeProgram(t1, "bench.link", ["--rank", "1", "--port", str(port), *common]) as rank1:
            result0 = _result(frames0)
            result1 = _result(rank1.frames(deadline))
            code0, code1 = rank0.finish(deadline), rank1.finish(deadline)
            if frame_type(result0) is FrameType.LINK:
                return link_profile(a.name, b.name, backend, result0)
            for node, result in ((first, result0), (second, result1)):
                if frame_type(result) is FrameType.ERROR:
                    return fail(f"{node.name}: {result.get('message')}")
            failed = (first, rank0, code0) if code0 else (second, rank1, code1)
            return fail(f"{failed[0].name}: {failed[1].failure(failed[2])}")


def link_profile(a: str, b: str, backend: str, frame: dict[str, Any]) -> LinkProfile:
    """The profile a link rank's ``link`` frame measured between nodes ``a`` and ``b``."""
    return LinkProfile(a=a, b=b, backend=backend, bandwidth_gbs=from_dict(Measurement, frame["bandwidth_gbs"]),
                       latency_s=from_dict(Measurement, frame["latency_s"]))


RESULTS = (FrameType.LINK, FrameType.ERROR)   # a link rank's last word


def _result(frames: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The last ``link`` or ``error`` frame of a rank ({} when it ended without one)."""
    out: dict[str, Any] = {}
    for frame in frames:
        if frame_type(frame) in RESULTS:
            out = frame
    return out
