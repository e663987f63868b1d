"""``--engine auto`` between fewer devices and more: the sets of devices the planner prices, each on
the engine its memory allows, so that the cost model, not memory alone, decides whether the devices
that hold no replica are worth sharding the state for (docs/planning.md, "Sharded groups").
"""
from __future__ import annotations

import dataclasses

from ..schema.stages import Engine, Plan
from .costed import Device
from .memory import REPLICA, Layout

# A candidate with fewer devices must be predicted faster than all of them by more than this
# fraction, as an async layout must beat an earlier one (cost.best_async): ties keep every device.
CANDIDATE_MARGIN = 0.01


def _hold(devices: list[Device], members: list[int], layout: Layout) -> list[int]:
    needs = [(i, devices[i].memory) for i in members]
    return [i for i, need in needs if need is None or need.cap(layout) >= 1]


def _shard_holders(devices: list[Device]) -> list[int]:
    """The devices that hold one sample as ranks of an fsdp group (not offloaded) of themselves: a
    smaller group leaves each rank a larger share of the state, so drop and re-check until it holds."""
    members = list(range(len(devices)))
    while members:
        kept = _hold(devices, members, Layout(Engine.FSDP, len(members)))
        if kept == members:
            break
        members = kept
    return members


def engine_candidates(devices: list[Device], engine: Engine | None,
                      shardable: bool) -> list[tuple[list[int], Engine | None]]:
    """(device indices, engine) the planner prices, every device first (each group's cheapest layout
    that fits, or ``engine``). Under auto, where some devices hold no replica, also: the devices that
    hold one, as DDP replicas; and the devices that hold an fsdp shard without offload, sharded,
    where that is a third set."""
    everyone = list(range(len(devices)))
    out: list[tuple[list[int], Engine | None]] = [(everyone, engine)]
    if engine is not None or not shardable:
        return out
    replicas = _hold(devices, everyone, REPLICA)
    if len(replicas) == len(devices):
        return out
    if replicas:
        out.append((replicas, Engine.DDP))
    sharded = _shard_holders(devices)
    if len(replicas) < len(sharded) < len(devices):
        out.append((sharded, Engine.FSDP))
    return out


def predicted(plan: Plan) -> float:
    """The plan's predicted samples/s on its own strategy."""
    return plan.predicted_samples_per_s[plan.strategy]


def _label(plan: Plan) -> str:
    engines = sorted({g.engine.value for g in plan.groups})
    offload = any(r.memory is not None and r.memory.offload for r in plan.workers)
    return (f"{'/'.join(engines)}{'+offload' if offload else ''} on {len(plan.workers)} device(s) "
            f"{predicted(plan):.4g} samples/s")


def pick(plans: list[Plan]) -> Plan:
    """The fastest predicted of the candidates' plans (the first, every device, unless another wins by
    CANDIDATE_MARGIN), its reason saying what each was predicted where there was a choice."""
    best = plans[0]
    for plan in plans[1:]:
        if predicted(plan) > predicted(best) * (1 + CANDIDATE_MARGIN):
            best = plan
    if len(plans) == 1:
        return best
    others = "; ".join(_label(p) for p in plans if p is not best)
    return dataclasses.replace(best, reason=f"{best.reason}; engine by cost: {_label(best)}, chosen over {others}")
