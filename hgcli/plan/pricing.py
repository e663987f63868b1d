"""The cost model's common ground (``CostBase``: the devices, their batches, the network, the nodes'
cores, and the pieces every prediction prices) and the prediction of one synchronous all-reduce
group of every device, which needs nothing more, on its engine: DDP's all-reduce, or a sharded
group's gathers and reduce-scatter (plan/sharding.py) (docs/planning.md).
"""
from __future__ import annotations

from ..schema.stages import Engine, ExchangeProfile, GroupSyncProfile, Inventory, JobSpec, Strategy
from .costed import Device, GroupStats, Option, plan_overlap
from .delays import compute_cpu, oversubscription, straggle
from .memory import REPLICA, Layout
from .network import Network, broadcast_s, ring_allreduce_s
from .sharding import SHARDED_OVERLAP, ShardedTraffic, ddp_buckets, host_s, ring_s, sharded_traffic, units_of


class CostBase:
    """What every prediction reads: the devices, their batches, the network and the nodes' cores,
    and the pieces both predictors price (a group, a member's step, crowded CPUs)."""

    def __init__(self, devices: list[Device], batches: list[int], net: Network, model_bytes: float,
                 global_batch: int, inventory: Inventory, job: JobSpec,
                 exchange: dict[int, ExchangeProfile] | None = None,
                 group_sync: dict[int, GroupSyncProfile] | None = None, wire_bytes: float | None = None,
                 layout: Layout = REPLICA) -> None:
        self.devices, self.batches, self.net = devices, batches, net
        # How the all-reduce group of every device holds its state (engines.priced_layout): its engine
        # decides what its synchronisation costs. Groups under parameter servers are DDP.
        self.layout = layout
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
        sync = ring_allreduce_s(n, self.bytes, bw, lat) + broadcast_s(n, self.bytes, bw, lat)
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


class AllReducePredictor(CostBase):
    """One synchronous group of every device (Strategy.ALLREDUCE)."""

    def allreduce(self) -> Option:
        members = tuple(range(len(self.devices)))
        nodes = [d.node for d in self.devices]
        bw, lat = self.net.ring(nodes)
        step = max(self._member_time(i, len(members)) for i in members)
        step *= straggle(max(d.noise for d in self.devices), len(members))
        own, latency, host, traffic = self._sync_terms(len(members), bw, lat)   # its CPU work, uncontended
        measured = self._measured_sync(nodes, bw)
        if measured is not None and traffic is not None:
            comm = self._sharded_measured(measured, traffic, nodes, bw)
        elif measured is not None:
            comm = measured
        else:
            wait = max(self._oversub(n, {}) for n in set(nodes))
            comm = own + latency * (wait - 1.0)
        comm += host
        busy: dict[int, float] = {}
        for d, b in zip(self.devices, self.batches):
            if d.emulated:
                busy[d.node] = busy.get(d.node, 0.0) + (compute_cpu(d, b) + own) / (step + comm)
        crowded = self._crowding(busy)
        rate = self.global_batch / ((step + comm) * max(crowded.values(), default=1.0))
        engine = "" if self.layout.engine is Engine.DDP else f"{'fsdp+offload' if self.layout.offload else 'fsdp'} "
        return Option(Strategy.ALLREDUCE, (members,), (1,), (), 0, rate,
                       f"one {engine}all-reduce group of {len(members)}", (rate,))

    def _sync_terms(self, n: int, bw: float,
                    lat: float) -> tuple[float, float, float, ShardedTraffic | None]:
        """(ring seconds, their latency part, host seconds, the sharded traffic or None) of one update
        of the group of all ``n`` devices on its engine: DDP's all-reduce, or a sharded group's
        traffic (plan/sharding.py)."""
        if self.layout.engine is Engine.DDP:
            return ring_allreduce_s(n, self.bytes, bw, lat), (2 * (n - 1) * lat if n > 1 else 0.0), 0.0, None
        model = next((d.memory.model for d in self.devices if d.memory is not None), None)
        traffic = sharded_traffic(self.layout, self.bytes, units_of(model), [d.micro for d in self.devices])
        ring, latency = ring_s(traffic, n, bw, lat)
        return ring, latency, host_s(traffic), traffic

    def _sharded_measured(self, ddp: float, traffic: ShardedTraffic, nodes: list[int], bw: float) -> float:
        """A sharded group's step where the bench measured DDP's (``ddp``, at this plan's bytes): what
        the measurement holds beyond its ring's bytes is paid per collective (waking from the emulated
        sleep and the members' uneven arrivals, each time the group meets), so it is scaled from
        DDP's buckets to the sharded update's collectives; its bytes are the traffic's."""
        n = len(nodes)
        allreduce_bytes = 2 * (n - 1) / n * self.bytes
        fixed = max(0.0, ddp - allreduce_bytes / bw) / ddp_buckets(self.bytes)
        return fixed * traffic.collectives + (1.0 - SHARDED_OVERLAP) * traffic.ring_bytes / bw

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
