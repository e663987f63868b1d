"""The network the cost model prices: measured links per node pair, documented defaults for the
rest, and the times of a ring all-reduce and broadcast over them (docs/planning.md).
"""
from __future__ import annotations

import math

from ..schema.stages import LinkProfile

# Links nobody measured: inside a node (PCIe/NVLink-class ring) and between nodes (10 GbE).
INTRA_NODE_GBS = 16.0
INTRA_NODE_LATENCY_S = 10e-6
DEFAULT_LINK_GBS = 1.25
DEFAULT_LINK_LATENCY_S = 50e-6


class Network:
    """Links by node pair. Building it is the one pass over every measured link (O(nodes^2) on a
    fully measured cluster, which is the size of the input); everything after is per node or group.
    The loops are plain and local-variable heavy because they run 130k times on 512 nodes."""

    def __init__(self, node_names: list[str], links: tuple[LinkProfile, ...]) -> None:
        index = {name: i for i, name in enumerate(node_names)}.get
        nodes = self.nodes = len(node_names)
        pairs: dict[tuple[int, int], tuple[float, float]] = {}
        # Measured intra-node links (a node to itself: emulated devices exchanging through gloo over
        # loopback on a shared CPU); other nodes get the INTRA_NODE_* defaults.
        self.intra: dict[int, tuple[float, float]] = {}
        for link in links:
            measured = link.bandwidth_gbs
            if measured is None or link.error:
                continue
            i, j = index(link.a), index(link.b)
            bw = measured.median * 1e9
            if i is None or j is None or not bw > 0:
                continue
            lat = link.latency_s.median if link.latency_s is not None else DEFAULT_LINK_LATENCY_S
            if i == j:
                self.intra[i] = (bw, max(lat, 0.0))
                continue
            key = (i, j) if i < j else (j, i)
            old = pairs.get(key)
            if old is None or old[0] < bw:
                pairs[key] = (bw, lat if lat > 0 else 0.0)
        self.pairs = pairs
        degree = [0] * nodes
        nic = [0.0] * nodes             # fastest link of a node: what its NIC can carry
        worst = [math.inf] * nodes      # slowest link of a node, defaults included
        worst_lat = [0.0] * nodes
        for (i, j), (bw, lat) in pairs.items():
            degree[i] += 1
            degree[j] += 1
            if bw > nic[i]:
                nic[i] = bw
            if bw > nic[j]:
                nic[j] = bw
            if bw < worst[i]:
                worst[i] = bw
            if bw < worst[j]:
                worst[j] = bw
            if lat > worst_lat[i]:
                worst_lat[i] = lat
            if lat > worst_lat[j]:
                worst_lat[j] = lat
        default = DEFAULT_LINK_GBS * 1e9
        for n in range(nodes):
            if degree[n] < nodes - 1 or nodes == 1:   # some pair unmeasured: it runs at the default
                nic[n] = max(nic[n], default)
                worst[n] = min(worst[n], default)
                worst_lat[n] = max(worst_lat[n], DEFAULT_LINK_LATENCY_S)
        self.nic, self.worst, self.worst_lat = nic, worst, worst_lat

    def link(self, i: int, j: int) -> tuple[float, float]:
        """(bytes/s, latency s) between two nodes; inside a node, the intra-node default."""
        if i == j:
            return self.intra.get(i, (INTRA_NODE_GBS * 1e9, INTRA_NODE_LATENCY_S))
        return self.pairs.get((i, j) if i < j else (j, i), (DEFAULT_LINK_GBS * 1e9, DEFAULT_LINK_LATENCY_S))

    def ring(self, members: list[int]) -> tuple[float, float]:
        """Slowest hop and largest latency on a ring through the members' nodes in node order."""
        nodes = sorted(set(members))
        bw, lat = math.inf, 0.0
        if len(nodes) < len(members):          # devices sharing a node: intra-node hops
            seen: set[int] = set()
            for n in members:
                if n in seen:
                    b, l = self.link(n, n)
                    bw, lat = min(bw, b), max(lat, l)
                seen.add(n)
        if len(nodes) > 1:
            for i, j in zip(nodes, nodes[1:] + nodes[:1]):
                b, l = self.link(i, j)
                bw, lat = min(bw, b), max(lat, l)
        return bw, lat


def ring_allreduce_s(n: int, nbytes: float, bw: float, lat: float) -> float:
    return 0.0 if n < 2 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def broadcast_s(n: int, nbytes: float, bw: float, lat: float) -> float:
    """Pipelined ring broadcast of fresh parameters from the group leader."""
    return 0.0 if n < 2 else nbytes / bw + (n - 1) * lat
