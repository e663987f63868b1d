"""The planner's memory model: what a worker holds in device memory under each engine, and the
largest micro-batch that fits (docs/planning.md, "Memory"; change both together).

A rank holds its training state and one micro-batch's activations:
- ddp: the whole state (parameters, gradients, AdamW's two moments);
- fsdp: 1/n of it over a group of n, and the GATHERED_UNITS largest units unsharded while it
  computes them;
- fsdp with offload: the gathered units alone (the shards and the optimizer live in host memory).
Devices are filled to MEMORY_USABLE_FRACTION (fit.py) of their memory, as DDP replicas always were.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema.stages import GATHERED_UNITS, DeviceProfile, Engine, MemoryProfile, RankMemory
from .fit import MEMORY_USABLE_FRACTION

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    """How a group holds its state: its engine, its size, and whether the state is offloaded."""

    engine: Engine
    members: int = 1
    offload: bool = False


@dataclass(frozen=True)
class MemoryNeed:
    """One device's memory and the benched model's needs (bytes)."""

    model: MemoryProfile
    usable: float                  # MEMORY_USABLE_FRACTION of the device's memory

    def state(self, layout: Layout) -> float:
        """The training state on the device under ``layout``."""
        gathered = GATHERED_UNITS * self.model.largest_unit_bytes
        if layout.engine is Engine.DDP:
            return float(self.model.state_bytes)
        if layout.offload:
            return float(gathered)
        return self.model.state_bytes / max(1, layout.members) + gathered

    def cap(self, layout: Layout) -> int:
        """The largest batch one step (or micro-batch) holds under ``layout``; 0 when not one."""
        room = self.usable - self.state(layout)
        if room < self.model.activation_bytes(1):
            return 0
        per_sample = self.model.activation_bytes(2) - self.model.activation_bytes(1)
        if per_sample <= 0:
            return 1 << 30       # activations that do not grow with the batch: the batch is free
        return max(1, math.floor(1 + (room - self.model.activation_bytes(1)) / per_sample))

    def record(self, layout: Layout, batch: int) -> RankMemory:
        """The rank's figures at micro-batch ``batch``."""
        state, activations = self.state(layout), self.model.activation_bytes(batch)
        return RankMemory(state_gib=_gib(state), activation_gib=_gib(activations), usable_gib=_gib(self.usable),
                          headroom_gib=_gib(max(0.0, self.usable - state - activations)), offload=layout.offload)


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def memory_need(p: DeviceProfile) -> MemoryNeed | None:
    """The device's need from its profile; None without the model's memory profile or the device's
    memory (then its steps' memory caps it as before: fit.memory_cap)."""
    if p.memory is None or p.memory_total_mib is None:
        return None
    return MemoryNeed(p.memory, MEMORY_USABLE_FRACTION * p.memory_total_mib * MIB)


def micro_batches(batch: int, cap: int) -> int:
    """Micro-batches of at most ``cap`` samples that make up ``batch``."""
    return max(1, -(-batch // max(1, cap)))


# The layouts auto tries, cheapest first: a replica needs no exchange of parameters; a sharded group
# gathers every unit each step; offloading also moves the state over the host link every step.
REPLICA = Layout(Engine.DDP)
OFFLOADED = Layout(Engine.FSDP, offload=True)


def no_room_note(need: MemoryNeed, shardable: bool, memory_mib: int | None) -> str | None:
    """Why a device cannot train the model (``shardable``: under the most it may shard), or None."""
    most = OFFLOADED if shardable else REPLICA
    if need.cap(most) >= 1:
        return None
    wanted = (need.state(most) + need.model.activation_bytes(1)) / MIB
    if shardable:
        return (f"cannot hold one sample in {memory_mib} MiB even sharded with its state offloaded: "
                f"{wanted:,.0f} MiB needed")
    return (f"cannot hold a DDP replica with its optimizer state and one sample in {memory_mib} MiB: "
            f"{wanted:,.0f} MiB needed")


def fits_nowhere(profiles: list[DeviceProfile], shardable: bool) -> str | None:
    """The one line of a plan no device can train, when memory is why (every profile that carries the
    model's memory profile and no error has no room for one sample); None otherwise."""
    sized: list[tuple[DeviceProfile, MemoryNeed]] = []
    for p in profiles:
        need = memory_need(p)
        if need is not None and not p.error:
            sized.append((p, need))
    if not sized or any(no_room_note(need, shardable, p.memory_total_mib) is None for p, need in sized):
        return None
    model = sized[0][1].model
    total = sum(p.memory_total_mib or 0 for p, _ in sized) * MIB
    smallest = min(sized, key=lambda t: t[0].memory_total_mib or 0)[0]
    head = (f"the model does not fit: its training state is {model.state_bytes / GIB:.2f} GiB (parameters, "
            f"gradients and AdamW's two moments), the cluster's {len(sized)} device(s) have {total / GIB:.2f} GiB "
            f"in all, the smallest {smallest.device}@{smallest.node} {(smallest.memory_total_mib or 0) / 1024:.2f} GiB")
    if not shardable:
        return (f"{head}; each device would hold a whole replica: --engine auto shards the state over a "
                f"group (finer with more devices, --strategy allreduce) and offloads it to host memory "
                f"where that is not enough")
    return (f"{head}; even sharded over any number of devices with the state offloaded, a rank needs "
            f"{model.least_bytes() / GIB:.2f} GiB (one sample's activations and {GATHERED_UNITS} of its largest "
            f"unit, {model.largest_unit_bytes / GIB:.2f} GiB, gathered): devices with more memory, or a model "
            f"with smaller layers")
