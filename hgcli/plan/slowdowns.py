"""The cluster file's emulated slowdowns, carried onto the plan's ranks.

A slowdown (``emulate.slowdown``, docs/cluster-file.md) changes no probe, bench or plan decision: the
devices are benched and planned at their declared speeds, and only the runtime's emulator applies it
while the job trains. So it joins the plan at launch, on the rank of the device it names.
"""
from __future__ import annotations

from dataclasses import replace

from ..schema.stages import Cluster, Plan, Role


def with_slowdowns(plan: Plan, cluster: Cluster) -> Plan:
    """``plan`` with each emulated worker's slowdowns from its node's ``emulate`` table."""
    ranks = []
    for r in plan.ranks:
        try:
            spec = cluster.node(r.node).emulate
        except KeyError:
            spec = None
        if (spec is None or not spec.slowdown or r.role is not Role.WORKER or not r.device.startswith("gpu")
                or not r.device[len("gpu"):].isdigit()):
            ranks.append(r)
            continue
        index = int(r.device[len("gpu"):])
        ranks.append(replace(r, slowdown=tuple(s for s in spec.slowdown if s.device == index)))
    return replace(plan, ranks=tuple(ranks))
