"""The cluster file's emulated slowdowns, and each emulated device's declared memory, carried onto
the plan's ranks (``RankPlan.slowdown``, ``RankPlan.memory_mib``).

A slowdown (``emulate.slowdown``, docs/cluster-file.md) changes no probe, bench or plan decision: the
devices are benched and planned at their declared speeds, and only the runtime's emulator applies it
while the job trains. So it joins the plan at launch, on the rank of the device it names.

A slowdown is the device's, not its process's: a rank restarted ``elapsed_s`` into the job (a
re-grouping, an elastic restart) meets it that much sooner, as a real GPU that slowed down stays
slow when its job restarts. Counted from the job's launch, a few seconds before its first ranks
start: a restarted rank meets its slowdown no later than it would have.

The declared memory joins the same way, for the same reason: the runtime alone enforces it (a step
above it fails as CUDA's out-of-memory would, runtime/memory.py), whoever laid the plan out.
"""
from __future__ import annotations

from dataclasses import replace

from ..schema.stages import Cluster, Plan, Role, Slowdown


def with_slowdowns(plan: Plan, cluster: Cluster, elapsed_s: float = 0.0) -> Plan:
    """``plan`` with each emulated worker's slowdowns (and declared memory) from its node's
    ``emulate`` table, for ranks that start ``elapsed_s`` after the job's launch."""
    ranks = []
    for r in plan.ranks:
        try:
            spec = cluster.node(r.node).emulate
        except KeyError:
            spec = None
        index = int(r.device[len("gpu"):]) if r.device.startswith("gpu") and r.device[len("gpu"):].isdigit() else -1
        if spec is None or r.role is not Role.WORKER or not 0 <= index < len(spec.devices):
            ranks.append(r)
            continue
        ranks.append(replace(r, slowdown=since(tuple(s for s in spec.slowdown if s.device == index), elapsed_s),
                             memory_mib=spec.memory_mib[index]))
    return replace(plan, ranks=tuple(ranks))


def since(slowdowns: tuple[Slowdown, ...], elapsed_s: float) -> tuple[Slowdown, ...]:
    """A device's slowdowns as a rank starting ``elapsed_s`` into the job meets them: the one in
    force then from its start, the later ones that much sooner."""
    if elapsed_s <= 0:
        return slowdowns
    ordered = sorted(slowdowns, key=lambda s: (s.after_s, s.factor))     # as the emulator orders them
    passed = [s for s in ordered if s.after_s <= elapsed_s]
    return ((replace(passed[-1], after_s=0.0),) if passed else ()) + tuple(
        replace(s, after_s=s.after_s - elapsed_s) for s in ordered if s.after_s > elapsed_s)
