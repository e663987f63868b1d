"""What a sharded (FSDP2) group's update costs beside its compute: the gathers and the reduce-scatter
over the group's ring, and with offload the state's trips over the host link and the optimizer on the
CPU (docs/planning.md, "Sharded groups"; change both together).

What one update of an fsdp group does, per rank, as the runtime drives FSDP2 (runtime/group/sharded.py):
- each gather is an all-gather of every unit's parameters, ``(n - 1) / n * M`` bytes sent per rank,
  one collective per unit;
- the gradients are reduce-scattered once per update, ``(n - 1) / n * M`` bytes, one per unit: the
  runtime keeps the micro-steps' gradients unsharded and reduces their sum in the last backward;
- gathers per update: 2 (forward, then backward again: FSDP2 reshards after forward) with one
  micro-batch; with ``m`` micro-batches on every member ``m + 1`` (the window keeps the parameters
  unsharded after each backward, so only the first forward gathers, but every backward gathers again);
  with members of different ``m``, 1 (the runtime turns resharding after forward off so that every
  member runs the same collectives; ZeRO-2's memory for that update).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..schema.stages import MemoryProfile
from .memory import Layout

# FSDP2 prefetches the next unit's all-gather while the current unit computes, so some of a sharded
# update's traffic could hide behind compute; DDP's bucketed all-reduce could hide behind backward the
# same way, and the model prices neither (docs/planning.md, "All-reduce": the measured emulated
# groups showed no such overlap, their collectives running on the cores that compute). The two engines
# are priced on that one footing, so that auto's choice between them is not decided by an overlap
# credited to one: the fraction of a sharded update's ring time hidden behind compute is 0.
SHARDED_OVERLAP = 0.0
# DDP all-reduces its gradients in buckets of this many bytes (torch's default bucket_cap_mb = 25):
# the collectives of a measured DDP step (pricing._sharded_measured).
DDP_BUCKET_BYTES = 25 * 2**20
# Offloaded state crosses the host link every update: the shard in for each gather, the gradient shard
# out. 12 GB/s is what a PCIe 3.0 x16 link (or a 4.0 one from pageable memory) carries in practice.
HOST_LINK_GBS = 12.0
# An offloaded rank's optimizer steps its shard on the CPU: AdamW at the PS's rate (plan/ps.py's
# PS_APPLY_GBS, which is this constant), parameter bytes per second.
CPU_OPTIMIZER_GBS = 2.0


@dataclass(frozen=True)
class ShardedTraffic:
    """One update of a sharded group, per rank."""

    gathers: int          # all-gathers of the whole parameters
    ring_bytes: float     # bytes sent over the group's ring: the gathers and the reduce-scatter
    collectives: int      # one per unit for each gather and for the reduce-scatter
    host_bytes: float     # with offload: the shard in for each gather, the gradient shard out
    cpu_bytes: float      # with offload: the shard's parameter bytes the CPU's optimizer steps


def gathers_per_update(micro: Sequence[int]) -> int:
    """All-gathers of the parameters per update of a group whose members run ``micro`` micro-batches."""
    steps = set(micro) or {1}
    if len(steps) > 1:
        return 1
    m = steps.pop()
    return 2 if m <= 1 else m + 1


def units_of(model: MemoryProfile | None) -> int:
    """FSDP2 units the model is wrapped into: its parameters over its largest unit's, rounded up (the
    fewest units of that size; a model benched without its memory figures is one unit)."""
    if model is None or model.largest_unit_bytes <= 0:
        return 1
    return max(1, math.ceil(model.parameter_bytes / model.largest_unit_bytes))


def sharded_traffic(layout: Layout, param_bytes: float, units: int, micro: Sequence[int]) -> ShardedTraffic:
    """The traffic of one update of a sharded group of ``layout.members`` ranks of ``param_bytes``."""
    n = max(1, layout.members)
    gathers = gathers_per_update(micro)
    ring = (gathers + 1) * (n - 1) / n * param_bytes
    shard = param_bytes / n
    host = (gathers + 1) * shard if layout.offload else 0.0
    return ShardedTraffic(gathers, ring, (gathers + 1) * units if n > 1 else 0, host,
                          shard if layout.offload else 0.0)


def ddp_buckets(param_bytes: float) -> int:
    """All-reduces of one DDP step of ``param_bytes`` of gradients."""
    return max(1, math.ceil(param_bytes / DDP_BUCKET_BYTES))


def ring_s(traffic: ShardedTraffic, n: int, bw: float, lat: float) -> tuple[float, float]:
    """(seconds on the ring not hidden behind compute, their latency part) of one update over a ring
    of slowest hop ``bw`` bytes/s and latency ``lat``: each collective's ring takes n - 1 hops."""
    if n < 2:
        return 0.0, 0.0
    latency = traffic.collectives * (n - 1) * lat
    return (1.0 - SHARDED_OVERLAP) * (traffic.ring_bytes / bw + latency), latency


def host_s(traffic: ShardedTraffic) -> float:
    """Seconds of an offloaded rank's update on the host link and its CPU's optimizer (0 without)."""
    return traffic.host_bytes / (HOST_LINK_GBS * 1e9) + traffic.cpu_bytes / (CPU_OPTIMIZER_GBS * 1e9)
