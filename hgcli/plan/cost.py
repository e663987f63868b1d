"""The cost model of the planner: predicted samples/s of a layout of groups and PS ranks.

Pure, like the planner that calls it. Every formula and constant is documented in docs/planning.md
(change both together). Work is per group, per node or per PS node, never over all device pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..schema.stages import Device as DeviceName, ExchangeProfile, GroupSyncProfile, Inventory, JobSpec, LinkProfile, Strategy

# Links nobody measured: inside a node (PCIe/NVLink-class ring) and between nodes (10 GbE).
INTRA_NODE_GBS = 16.0
INTRA_NODE_LATENCY_S = 10e-6
DEFAULT_LINK_GBS = 1.25
DEFAULT_LINK_LATENCY_S = 50e-6
# A PS rank applies the optimizer to its shard on the CPU at this many parameter bytes per second.
PS_APPLY_GBS = 2.0
# PS counts tried by the cost model: powers of two up to this, plus one PS per node.
PS_CANDIDATES_MAX = 16
# Accumulation is capped so a slow group still pushes now and then.
MAX_ACCUMULATE = 64
# A batch (a device's) or a push (a hybrid group's batch x accumulation) is sized at its "knee": the
# smallest size whose samples/s is within this fraction of the best that size can reach.
KNEE_TOLERANCE = 0.05
# A push weighs samples / global batch on the PS (docs/runtime-reference.md): a push of k global batches is one
# step k times as large. Measured end to end (benchmarks/pipeline_e2e.py, benchmarks/RESULTS.md),
# pushes of several global batches cost the hybrid runs far more accuracy against DDP than pushes of
# one, so a push stays one global batch until the PS's update rule accounts for size.
MAX_PUSH_GLOBAL_BATCHES = 1
# Staleness bound = slack x the pushes other groups make during the slowest group's window.
STALENESS_SLACK = 2.0
# Of the CPU work a measured PS round trip does beyond its fixed cost and the PS's update (pickling,
# copies in and out of the RPC buffers, on both ends), this share is the leader's side: its process
# converts, flattens and pickles the push and loads the answer on its training thread, so overlap
# cannot hide it. Push and pull are symmetric (a model's worth each way), hence half.
EXCHANGE_CLIENT_SHARE = 0.5
# Hybrid plans overlap each leader's PS exchange with its group's next step unless the job says
# (--overlap/--no-overlap); benchmarks/hybrid_links.py measured it (docs/planning.md, "Overlap").
OVERLAP_DEFAULT = False


def plan_overlap(job: JobSpec) -> bool:
    """Whether a hybrid or PS plan for ``job`` overlaps communication with compute."""
    return OVERLAP_DEFAULT if job.overlap is None else job.overlap


@dataclass(frozen=True)
class Device:
    """A usable worker device with its fitted cost: mean step time = a + c * batch, batch <= cap;
    ``noise`` = mean delay of a step / its noise-free time (hgcli.plan.fit.step_noise);
    ``benched`` = the largest batch its bench timed (0: costed from matmul figures); ``fitted``: the
    cost is fitted to a job's measured compute (devices.fit_to_rates), which had the node's CPU
    contention and the group's synchronous step in it already; ``together``: the cost is scaled to
    the device's steps beside its node's other devices (devices.beside_neighbours), which had the
    contention between them in it already."""

    node: int          # index in inventory node order
    device: DeviceName
    emulated: bool
    speed: float
    a: float
    c: float
    cap: int | None
    noise: float = 0.0
    benched: int = 0
    fitted: bool = False
    together: bool = False

    def time(self, batch: float) -> float:
        return self.a + self.c * batch

    def rate(self, batch: float) -> float:
        """Samples per second at ``batch``."""
        return batch / self.time(batch)


def _compute_cpu(d: Device, batch: float) -> float:
    """Seconds of a core an emulated device's step asks of its node (it computes ``speed`` of its
    step and sleeps the rest); 0 for a fitted cost or one benched together, whose measured step had
    its share of the node's cores in it already (counting it again would crowd the node twice)."""
    return 0.0 if d.fitted or d.together else d.speed * d.time(batch)


def _harmonic(n: int) -> float:
    """1 + 1/2 + ... + 1/n (asymptotic form beyond 64 terms: error below 1e-7)."""
    if n <= 64:
        return sum(1.0 / k for k in range(1, n + 1))
    return math.log(n) + 0.5772156649 + 1.0 / (2 * n) - 1.0 / (12 * n * n)


def straggle(noise: float, n: int, accumulate: int = 1) -> float:
    """Expected slowest of ``n`` members / one member's mean, over ``accumulate`` steps between
    two synchronisations. A step is its noise-free time t0 plus an exponential delay of mean
    noise * t0; the largest of n such delays has mean H_n times theirs (H_n the harmonic number),
    and the delays of accumulated steps add up, so their spread grows as sqrt(accumulate)."""
    if n < 2 or noise <= 0:
        return 1.0
    return 1.0 + (_harmonic(n) - 1.0) * noise / ((1.0 + noise) * math.sqrt(accumulate))


def oversubscription(ranks: int, cores: int, demand: float | None = None) -> float:
    """How much longer a latency-bound exchange takes on a node whose ranks outnumber its cores:
    every hop wakes a process that may then wait for a core. With ``ranks`` processes all runnable,
    sharing ``cores`` round-robin, each runs ranks / cores of the time it would alone; that is the
    bound. ``demand`` (cores' worth of CPU the workers ask for: an emulated device at speed s runs
    s of a core while it computes and sleeps the rest) lowers it as a queue would: with the cores
    busy a share u = demand / cores of the time, a woken process's wait stretches it by 1 / (1 - u).
    1 when the node has a core per rank, or its core count is unknown (0)."""
    if not cores or ranks <= cores:
        return 1.0
    bound = ranks / cores
    if demand is None:
        return bound
    busy = min(demand / cores, 0.99)
    return min(bound, 1.0 / (1.0 - busy))


class GroupStats(NamedTuple):
    """A group's figures per synchronisation, before PS placement."""

    samples: float      # samples per step
    compute: float      # seconds per step of its slowest member
    sync: float         # all-reduce + broadcast seconds, uncontended
    latency: float      # the latency part of ``sync`` (stretched by oversubscription)
    leader: int         # node index of its leader
    noise: float        # noise of its noisiest member
    nodes: frozenset[int]


@dataclass(frozen=True)
class Option:
    """One candidate layout with its predicted throughput."""

    strategy: Strategy
    groups: tuple[tuple[int, ...], ...]   # device indices, in rank order
    accumulate: tuple[int, ...]
    ps_nodes: tuple[int, ...]             # node index of each PS rank
    staleness: int
    samples_per_s: float                  # the whole run's: every group's samples over the run
    summary: str
    # Each group's samples/s while it runs (its own steps, in ``groups`` order): what the launch
    # summary measures per group. Their sum exceeds ``samples_per_s`` where groups' steps differ.
    group_rates: tuple[float, ...] = ()


# ---------------------------------------------------------------------------------------------
# Network: measured links per node pair, documented defaults for the rest
# ---------------------------------------------------------------------------------------------

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


def _ring_allreduce_s(n: int, nbytes: float, bw: float, lat: float) -> float:
    return 0.0 if n < 2 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def _broadcast_s(n: int, nbytes: float, bw: float, lat: float) -> float:
    """Pipelined ring broadcast of fresh parameters from the group leader."""
    return 0.0 if n < 2 else nbytes / bw + (n - 1) * lat


# ---------------------------------------------------------------------------------------------
# Throughput of a layout
# ---------------------------------------------------------------------------------------------

class _CostBase:
    """What every prediction reads: the devices, their batches, the network and the nodes' cores,
    and the pieces both predictors price (a group, a member's step, crowded CPUs)."""

    def __init__(self, devices: list[Device], batches: list[int], net: Network, model_bytes: float,
                 global_batch: int, inventory: Inventory, job: JobSpec,
                 exchange: dict[int, ExchangeProfile] | None = None,
                 group_sync: dict[int, GroupSyncProfile] | None = None, wire_bytes: float | None = None) -> None:
        self.devices, self.batches, self.net = devices, batches, net
        self.bytes, self.global_batch, self.job = model_bytes, global_batch, job
        # What one push or one pull carries on the wire (the plan's wire format); the group's own
        # all-reduce and broadcast stay in the parameters' format (``bytes``).
        self.wire = model_bytes if wire_bytes is None else wire_bytes
        self.overlap = plan_overlap(job)
        self.exchange = exchange or {}   # node index -> its measured PS push
        self.group_sync = group_sync or {}   # node index -> its emulated devices' measured sync step
        self.cores = cores = [n.cpu_cores or 0 for n in inventory.nodes]
        # PS ranks go on healthy nodes (a CPU-only node qualifies): best network first, then most
        # CPU cores, then node order.
        self.names = [n.name for n in inventory.nodes]
        self.healthy = healthy = [i for i, n in enumerate(inventory.nodes) if n.ok]
        # A re-plan that keeps the PS shards on these nodes, in shard order (their checkpoints hold
        # the training state: placement.make_plan's keep_ps); () lets the model place them.
        self.fixed_ps: tuple[int, ...] = ()
        self.ps_order = sorted(healthy, key=lambda n: (-net.nic[n], -cores[n], n))
        self.ranks_on: dict[int, int] = {}       # worker ranks per node (every device is one)
        self.demand_on: dict[int, float] = {}    # cores' worth of CPU its workers ask for
        for d in devices:
            self.ranks_on[d.node] = self.ranks_on.get(d.node, 0) + 1
            # A real GPU's process spins on its stream and holds a core; an emulated one holds
            # ``speed`` of a core (the emulator sleeps the rest of each step).
            self.demand_on[d.node] = self.demand_on.get(d.node, 0.0) + (min(d.speed, 1.0) if d.emulated else 1.0)

    def _oversub(self, node: int, ps_ranks: dict[int, int]) -> float:
        return oversubscription(self.ranks_on.get(node, 0) + ps_ranks.get(node, 0), self.cores[node],
                                self.demand_on.get(node, 0.0))

    def _group(self, members: tuple[int, ...]) -> GroupStats:
        nodes = [self.devices[i].node for i in members]
        bw, lat = self.net.ring(nodes)
        n = len(members)
        compute = max(self._member_time(i, n) for i in members)
        noise = max(self.devices[i].noise for i in members)
        sync = _ring_allreduce_s(n, self.bytes, bw, lat) + _broadcast_s(n, self.bytes, bw, lat)
        latency = 3 * (n - 1) * lat if n > 1 else 0.0
        return GroupStats(float(sum(self.batches[i] for i in members)), compute, sync, latency, nodes[0],
                          noise, frozenset(nodes))

    def _member_time(self, i: int, members: int) -> float:
        """Device ``i``'s step at its batch as a member of a group of ``members``: an emulated device
        in a synchronous group computes slower by its node's measured ratio (hgcli/node/bench/group.py:
        the same ranks' CPU per step synchronous over free), which the emulator stretches x 1/speed."""
        d = self.devices[i]
        measured = self.group_sync.get(d.node) if d.emulated and members > 1 and not d.fitted else None
        ratio = measured.compute_ratio.median if measured is not None and measured.compute_ratio else 1.0
        return d.time(self.batches[i]) * ratio

    def _crowding(self, busy: dict[int, float]) -> dict[int, float]:
        """Slowdown of each node whose processes ask for more CPU than it has cores: they share
        the cores (docs/planning.md, CPU crowding); nodes of unknown core count are left out."""
        return {n: b / self.cores[n] for n, b in busy.items() if self.cores[n] and b > self.cores[n]}


class _AllReducePredictor(_CostBase):
    """One synchronous group of every device (Strategy.ALLREDUCE)."""

    def allreduce(self) -> Option:
        members = tuple(range(len(self.devices)))
        nodes = [d.node for d in self.devices]
        bw, lat = self.net.ring(nodes)
        step = max(self._member_time(i, len(members)) for i in members)
        step *= straggle(max(d.noise for d in self.devices), len(members))
        own = _ring_allreduce_s(len(members), self.bytes, bw, lat)   # its CPU work, uncontended
        measured = self._measured_sync(nodes, bw)
        if measured is not None:
            comm = measured
        else:
            wait = max(self._oversub(n, {}) for n in set(nodes))
            comm = own + 2 * (len(members) - 1) * lat * (wait - 1.0)
        busy: dict[int, float] = {}
        for d, b in zip(self.devices, self.batches):
            if d.emulated:
                busy[d.node] = busy.get(d.node, 0.0) + (_compute_cpu(d, b) + own) / (step + comm)
        crowded = self._crowding(busy)
        rate = self.global_batch / ((step + comm) * max(crowded.values(), default=1.0))
        return Option(Strategy.ALLREDUCE, (members,), (1,), (), 0, rate,
                       f"one all-reduce group of {len(members)}", (rate,))

    def _measured_sync(self, nodes: list[int], bw: float) -> float | None:
        """What a synchronous step adds when the group is exactly the emulated devices of one node and
        the bench measured that step (hgcli/node/bench/group.py): waking from the emulated sleep on
        shared cores and the uneven arrivals are in it, which the ring formula has no terms for. The
        benched model's bytes are swapped for this plan's at the ring's per-byte rate. None otherwise."""
        if len(set(nodes)) != 1:
            return None
        measured = self.group_sync.get(nodes[0])
        if measured is None or measured.ranks != len(nodes):
            return None
        n = len(nodes)
        return max(0.0, measured.seconds.median + 2 * (n - 1) / n * (self.bytes - measured.bytes) / bw)


class _PSPlacement(_CostBase):
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


class _ExchangeCosts(_CostBase):
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


class _AsyncPredictor(_AllReducePredictor, _PSPlacement, _ExchangeCosts):
    """Groups with parameter servers (Strategy.HYBRID, Strategy.PS): the layout, accumulation and
    PS placement that predict the most samples/s."""

    def best_async(self, strategy: Strategy, layouts: list[tuple[tuple[int, ...], ...]]) -> Option:
        """The fastest layout and PS count; a candidate must win by 1% to displace an earlier one,
        so ties keep the fewer groups and the fewer PS ranks."""
        candidates: list[Option] = []
        if self.fixed_ps and any(len(g) > 1 for g in layouts):
            layouts = [g for g in layouts if len(g) > 1]   # one group would have no PS to keep
        for groups in layouts:
            if len(groups) == 1:
                one = self.allreduce()
                candidates.append(Option(strategy, one.groups, one.accumulate, (), 0, one.samples_per_s,
                                          "a single group: no parameter servers", one.group_rates))
            else:
                candidates.extend(self._with_ps(strategy, groups))
        best = candidates[0]
        for option in candidates[1:]:
            if option.samples_per_s > best.samples_per_s * 1.01:
                best = option
        return best

    def _with_ps(self, strategy: Strategy, groups: tuple[tuple[int, ...], ...]) -> list[Option]:
        stats = [self._group(g) for g in groups]
        placements = self.ps_placements(sorted({s.leader for s in stats}))
        return [self._predict_async(strategy, groups, stats, nodes, len(placements)) for nodes in placements]

    def _push_knee(self, stats: GroupStats, overhead: float) -> int:
        """A hybrid group's accumulation: the smallest push (batch x accumulation) whose samples/s,
        acc * B / (acc * T + overhead), is within KNEE_TOLERANCE of the group's compute-bound
        B / T, i.e. acc >= (1 - tol) / tol * overhead / T; at most the first accumulation that
        reaches MAX_PUSH_GLOBAL_BATCHES global batches (a group whose step is just short of a global
        batch may still double its push when the exchange is dear), and MAX_ACCUMULATE steps.
        No floor: every push is one update of the PS's optimizer, and with AdamW (or momentum) the
        number of updates, not their size, sets the progress per sample; a group that accumulated to
        a whole global batch gave the PS about two thirds of the updates DDP makes over the same
        samples (docs/planning.md, "Push size")."""
        knee = 1
        if overhead > 0 and stats.compute > 0:
            knee = math.ceil((1 - KNEE_TOLERANCE) / KNEE_TOLERANCE * overhead / stats.compute - 1e-9)
        most = max(1, math.ceil(MAX_PUSH_GLOBAL_BATCHES * self.global_batch / stats.samples - 1e-9))
        return min(MAX_ACCUMULATE, max(1, min(knee, most)))

    def _predict_async(self, strategy: Strategy, groups: tuple[tuple[int, ...], ...],
                       stats: list[GroupStats], ps_nodes: tuple[int, ...], tried: int = 1) -> Option:
        count = len(ps_nodes)
        node_share: dict[int, float] = {}
        ps_ranks: dict[int, int] = {}
        for q in ps_nodes:
            node_share[q] = node_share.get(q, 0.0) + self.wire / count
            ps_ranks[q] = ps_ranks.get(q, 0) + 1
        # Latencies under oversubscribed cores (oversubscription): a group's ring on its nodes, an
        # RPC round trip on the leader's node and the PS nodes'.
        ps_wait = max(self._oversub(q, ps_ranks) for q in ps_ranks)
        exchange = {n: self._push_pull_s(n, node_share, count, max(ps_wait, self._oversub(n, ps_ranks)))
                    for n in {s.leader for s in stats}}
        syncs = [s.sync + s.latency * (max(self._oversub(n, ps_ranks) for n in s.nodes) - 1.0) for s in stats]
        overheads = [sync + exchange[s.leader] for s, sync in zip(stats, syncs)]
        if strategy is Strategy.HYBRID:
            # asynchronous large mini-batch, sized for throughput (the push's knee)
            accumulate = tuple(self._push_knee(s, o) for s, o in zip(stats, overheads))
        else:
            accumulate = (1,) * len(stats)   # the classic asynchronous PS: every worker pushes every step
        windows = self._windows(groups, stats, accumulate, syncs, exchange, node_share, count)
        if self.job.staleness is not None:
            # A bound S lets a group push at most S - groups + 2 times per push of the slowest before
            # it waits (docs/runtime-reference.md). A hybrid group that would get further ahead pushes larger
            # instead (fewer pushes, same samples); what is still ahead at the cap waits.
            # With overlap every group has one more gradient in flight: groups more of the bound.
            ahead = max(1, max(self.job.staleness, len(groups) - 1) - len(groups) + 2
                        - (len(groups) if self.overlap else 0))
            slowest = max(windows)
            if strategy is Strategy.HYBRID and any(slowest / w > ahead for w in windows):
                accumulate = tuple(
                    acc if slowest / w <= ahead else
                    max(acc, min(MAX_ACCUMULATE, math.ceil((slowest / ahead - o) / (s.compute or 1e-12))))
                    for acc, w, o, s in zip(accumulate, windows, overheads, stats))
                windows = self._windows(groups, stats, accumulate, syncs, exchange, node_share, count)
                slowest = max(windows)
            windows = [max(w, slowest / ahead) for w in windows]
        # Every worker runs the same number of steps per epoch (ctx.sampler: each step's batches are
        # one block of the epoch's permutation), so a group whose steps are shorter finishes its share
        # first and waits in ctx.finish() while the others run: over the run, every group's samples
        # per step over the slowest group's time per step. Its own rate while running is what the
        # launch summary measures per group.
        step_s = [w / acc for w, acc in zip(windows, accumulate)]
        group_rates = tuple(s.samples / t for s, t in zip(stats, step_s))
        rate = sum(s.samples for s in stats) / max(step_s)
        total_pushes = sum(1.0 / w for w in windows)
        slowest = 1.0 / max(windows)
        staleness = self.job.staleness
        if staleness is None:
            staleness = max(1, math.ceil(STALENESS_SLACK * (total_pushes - slowest) / slowest))
            if self.overlap:         # each group's own push in flight, and one more round of the others'
                staleness += len(groups)
        # The runtime's waiting rule (docs/runtime-reference.md) needs S >= groups - 1 (S >= groups with overlap):
        # with a smaller bound every group could be waiting for another. A lower --staleness is raised.
        staleness = max(staleness, len(groups) if self.overlap else len(groups) - 1)
        return Option(strategy, groups, accumulate, ps_nodes, staleness, rate,
                      f"{len(groups)} groups, {self._where(ps_nodes, stats, tried)}", group_rates)

    def _windows(self, groups: tuple[tuple[int, ...], ...], stats: list[GroupStats], accumulate: tuple[int, ...],
                 syncs: list[float], exchange: dict[int, float], node_share: dict[int, float],
                 count: int) -> list[float]:
        """Seconds between two pushes of each group: its accumulated compute, all-reduce and PS
        exchange, stretched by a shared NIC, a saturated PS and crowded CPUs."""
        # With overlap the exchange runs during the next step: a window is the longer of the two,
        # except the leader's own CPU work of the exchange, which stays on its training thread.
        if self.overlap:
            windows = [max(acc * s.compute * straggle(s.noise, len(g), acc) + self._client_cpu_s(s.leader),
                           exchange[s.leader]) + sync for s, sync, acc, g in zip(stats, syncs, accumulate, groups)]
        else:
            windows = [acc * s.compute * straggle(s.noise, len(g), acc) + exchange[s.leader] + sync
                       for s, sync, acc, g in zip(stats, syncs, accumulate, groups)]
        # A node's NIC carries the pushes and pulls of every group led from it: share it.
        nic_load: dict[int, float] = {}
        for s, window in zip(stats, windows):
            remote = self.wire - node_share.get(s.leader, 0.0)
            nic_load[s.leader] = nic_load.get(s.leader, 0.0) + 2 * remote / self.net.nic[s.leader] / window
        windows = [w * max(1.0, nic_load[s.leader]) for s, w in zip(stats, windows)]
        pushes_from: dict[int, float] = {}
        for s, window in zip(stats, windows):
            pushes_from[s.leader] = pushes_from.get(s.leader, 0.0) + 1.0 / window
        total_pushes = sum(1.0 / w for w in windows)
        loads = {q: self._ps_load(q, share, total_pushes, pushes_from.get(q, 0.0), count)
                 for q, share in node_share.items()}
        scale = max(1.0, max(loads.values()))     # a saturated PS slows every group down alike
        windows = [w * scale for w in windows]
        # Emulated devices and PS ranks sharing a node's cores (node CPU seconds per second).
        busy = {q: load / scale for q, load in loads.items()}
        # CPU work of communication: its uncontended time (waiting for a core is not demand).
        own = {n: self._push_pull_s(n, node_share, count, 1.0) for n in exchange}
        for g, s, acc, w in zip(groups, stats, accumulate, windows):
            for i in g:
                d = self.devices[i]
                if d.emulated:
                    cpu = acc * _compute_cpu(d, self.batches[i]) + s.sync + own[s.leader]
                    busy[d.node] = busy.get(d.node, 0.0) + cpu / w
        crowded = self._crowding(busy)
        if crowded:
            windows = [w * max((crowded.get(self.devices[i].node, 1.0) for i in g), default=1.0)
                       for g, w in zip(groups, windows)]
        return windows


class CostModel(_AsyncPredictor):
    """Predicts samples/s of a layout; see docs/planning.md for every formula. One class of the
    predictor of each strategy and the pieces they share, each above."""
