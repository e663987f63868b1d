"""Parameter servers in the cost model: where the PS shards may go (and the reason's word on where
they went), and what a leader's push and pull cost it and the PS nodes. Constants documented in
docs/planning.md (change both together).
"""
from __future__ import annotations

from .costed import GroupStats
from .pricing import CostBase
from .sharding import CPU_OPTIMIZER_GBS

# A PS rank applies the optimizer to its shard on the CPU at this many parameter bytes per second
# (the rate an offloaded fsdp rank's CPU optimizer is priced at too).
PS_APPLY_GBS = CPU_OPTIMIZER_GBS
# PS counts tried by the cost model: powers of two up to this, plus one PS per node.
PS_CANDIDATES_MAX = 16


# Of the CPU work a measured PS round trip does beyond its fixed cost and the PS's update (pickling,
# copies in and out of the RPC buffers, on both ends), this share is the leader's side: its process
# converts, flattens and pickles the push and loads the answer on its training thread, so overlap
# cannot hide it. Push and pull are symmetric (a model's worth each way), hence half.
EXCHANGE_CLIENT_SHARE = 0.5


class PSPlacement(CostBase):
    """Where the PS shards may go, and the reason's word on where they went."""

    def _ps_counts(self) -> list[int]:
        if self.job.ps_ranks is not None:
            return [self.job.ps_ranks]
        nodes = len(self.ps_order)
        counts = [p for p in (2 ** k for k in range(5)) if p <= min(nodes, PS_CANDIDATES_MAX)]
        if nodes not in counts:
            counts.append(nodes)   # a local PS on every node
        return counts

    def _link_order(self, leaders: list[int]) -> list[int]:
        """Healthy nodes by their slowest link to any group leader's node (a leader's own node at its
        intra-node rate), then NIC, cores and node order: the first nodes are those every leader
        reaches fastest. With more than PS_CANDIDATES_MAX leader nodes, by NIC alone (``ps_order``):
        the pair lookups would grow with nodes x leaders."""
        if len(leaders) > PS_CANDIDATES_MAX:
            return self.ps_order
        link, nic, cores = self.net.link, self.net.nic, self.cores
        reach = {q: min(link(l, q)[0] for l in leaders) for q in self.healthy}
        return sorted(self.healthy, key=lambda q: (-reach[q], -nic[q], -cores[q], q))

    def ps_placements(self, leaders: list[int]) -> list[tuple[int, ...]]:
        """Where the PS shards may go for groups led from ``leaders`` (node indices), fewest shards
        first: for every count, the first nodes of ``_link_order`` (round-robin when the count
        exceeds them), and one shard on every leader's node (each leader then exchanges its share
        locally and no one link carries every group's traffic). The cost model prices each."""
        if self.fixed_ps:
            return [self.fixed_ps]
        order = self._link_order(leaders)
        out: list[tuple[int, ...]] = []
        for count in self._ps_counts():
            out.append(tuple(order[k % len(order)] for k in range(count)))
        own = tuple(sorted({n for n in leaders if n in set(self.healthy)}))
        if 1 < len(own) <= PS_CANDIDATES_MAX and self.job.ps_ranks in (None, len(own)):
            out.append(own)
        seen: set[tuple[int, ...]] = set()
        unique = []
        for nodes in sorted(out, key=len):     # stable: a count's link order before the leaders' nodes
            key = tuple(sorted(nodes))
            if key not in seen:
                seen.add(key)
                unique.append(nodes)
        return unique

    def _where(self, ps_nodes: tuple[int, ...], stats: list[GroupStats], tried: int) -> str:
        """The reason's word on the shards: how many, on which nodes, and the links that chose them."""
        nodes = sorted(set(ps_nodes))
        count = len(ps_nodes)
        shards = f"{count} PS shard{'s' if count > 1 else ''}"
        names = ", ".join(self.names[q] for q in nodes[:6]) + (f" and {len(nodes) - 6} more" if len(nodes) > 6 else "")
        where = f"{shards} on node{'s' if len(nodes) > 1 else ''} {names}"
        if len(nodes) == len(self.healthy) > 1:
            where += " (one on every node)"
        leaders = sorted({s.leader for s in stats})
        if len(leaders) > PS_CANDIDATES_MAX or len(nodes) > PS_CANDIDATES_MAX:
            return where
        slowest = min(self.net.link(l, q)[0] for l in leaders for q in nodes)
        local = sum(1 for l in leaders if l in nodes)
        return (f"{where} (leaders' slowest link to a shard {slowest / 1e9:.3g} GB/s, {local} of {len(leaders)} "
                f"leader node(s) with a local shard; best of {tried} placement(s) priced)")


class ExchangeCosts(CostBase):
    """What a leader's push and pull cost it, and what the pushes cost the PS nodes."""

    def _push_pull_s(self, leader: int, node_share: dict[int, float], shards: int, wait: float) -> float:
        """A leader pushes its update to every shard and pulls fresh parameters back: the RPC
        round trips as measured on the leader's node (fixed cost, times ``wait`` for cores, + per
        byte, scaled to a shard), plus the wire time of the shards on other nodes."""
        measured = self.exchange.get(leader)
        if measured is None:
            return self._wire_s(leader, node_share)
        share = self.wire / shards
        # The per-byte part is what the measured round trip adds to the measured fixed cost, both
        # uncontended; only the fixed cost (waking the RPC threads) then waits for cores. (Taking
        # the stretched fixed cost off the round trip cancelled the wait whenever one shard held
        # the whole model.)
        per_byte = max(0.0, measured.round_trip_s.median - measured.latency_s.median) / measured.bytes
        fixed = measured.latency_s.median * wait
        # one round trip to every shard at once; with several shards the runtime then pulls from the
        # others (hgcli/runtime/exchange/gradient.py): a second round trip, without the PS update.
        software = (fixed + per_byte * share) * (2 if shards > 1 else 1)
        remote = any(q != leader for q in node_share)
        return software + (self._wire_s(leader, node_share) if remote else 0.0)

    def _rpc_cpu_per_byte(self, node: int) -> float:
        """CPU seconds per wire byte of one push and its pull, both ends together, from the node's
        measured exchange: the round trip less its fixed cost and the PS's update (``service_s``)
        is the RPC's pickling and copies of a model's worth each way over loopback, where no wire
        time hides it. 0 when unmeasured."""
        m = self.exchange.get(node)
        if m is None:
            return 0.0
        return max(0.0, m.round_trip_s.median - m.latency_s.median - m.service_s.median) / m.bytes

    def _client_cpu_s(self, leader: int) -> float:
        """The leader's CPU seconds per push on its training thread: its share of the RPC work for
        every shard's bytes (the whole wire vector, however many shards)."""
        return EXCHANGE_CLIENT_SHARE * self._rpc_cpu_per_byte(leader) * self.wire

    def _wire_s(self, leader: int, node_share: dict[int, float]) -> float:
        if len(node_share) <= PS_CANDIDATES_MAX:
            slowest, lat = 0.0, 0.0
            for q, share in node_share.items():
                bw, l = self.net.link(leader, q)
                slowest, lat = max(slowest, share / bw), max(lat, l)
        else:   # shards on every node: bound by the leader's slowest link instead of pair lookups
            slowest = max(node_share.values()) / self.net.worst[leader]
            lat = self.net.worst_lat[leader]
        remote = self.wire - node_share.get(leader, 0.0)
        return 2 * (max(slowest, remote / self.net.nic[leader]) + lat)

    def _ps_load(self, node: int, share: float, total_pushes: float, local_pushes: float,
                 count: int) -> float:
        """Fraction of a second the PS ranks of one node are busy per second of training."""
        nic = self.net.nic[node]
        intra = self.net.link(node, node)[0]
        traffic = 2 * share * ((total_pushes - local_pushes) / nic + local_pushes / intra)
        measured = self.exchange.get(node)
        if measured is not None:   # the PS's measured busy time per push, scaled to its shard
            apply = total_pushes * measured.service_s.median * (self.bytes / count) / measured.bytes
            # and its side of the RPC's copies, which service_s leaves out, for its shard's bytes
            apply += total_pushes * (1 - EXCHANGE_CLIENT_SHARE) * self._rpc_cpu_per_byte(node) * self.wire / count
        else:
            apply = total_pushes * (self.bytes / count) / (PS_APPLY_GBS * 1e9)
        return traffic + apply
