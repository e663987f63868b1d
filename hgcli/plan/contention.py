"""Whether a plan's emulated devices crowd their node's CPU.

An emulated device computes on the CPU for ``speed`` of each step (speed 1: a whole core) and sleeps
the rest (hgcli/runtime/emulate.py). When a node's emulated devices ask for more than a small share
of its cores, they wait for each other's cores and every measured figure of the job (samples/s, the
share of the ideal) holds that contention, which real GPUs do not have. The prediction holds it too
when the bench ran the node's devices together (``Plan.bench_together``, docs/bench.md); the ideal
never does. hgtrain says so, so that a reader knows what the figures mean and how to avoid it
(declare lower speeds, or fewer devices per node, in the cluster file).
"""
from __future__ import annotations

from ..schema.stages import Inventory, Plan

# Above this share of a node's cores, contention between emulated ranks is no longer a small part of
# their steps (the data loader workers, PS ranks and the agent need the rest).
SMALL_SHARE = 0.5


def contention_note(plan: Plan, inventory: Inventory) -> str | None:
    """One line naming each node whose emulated workers ask more than SMALL_SHARE of its cores."""
    demand: dict[str, float] = {}
    for rank in plan.workers:
        if rank.emulated:
            demand[rank.node] = demand.get(rank.node, 0.0) + min(rank.speed or 1.0, 1.0)
    crowded = []
    for node in inventory.nodes:
        asked = demand.get(node.name)
        if asked and node.cpu_cores and asked > SMALL_SHARE * node.cpu_cores:
            crowded.append(f"{node.name} ask {asked:.3g} of its {node.cpu_cores} cores")
    if not crowded:
        return None
    where = ("in every measured figure and in the prediction (their bench ran them together), not in the ideal"
             if plan.bench_together else "in every measured figure")
    return ("emulated devices on " + ", ".join(crowded) + " (speed 1 computes on a whole core): CPU "
            f"contention between their ranks is {where}; declare lower speeds in the cluster file to "
            "keep it small")
