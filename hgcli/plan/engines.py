"""Each group's engine in a plan (``GroupPlan.engine``), and each worker's micro-batches and memory.

``--engine auto`` (JobSpec.engine None) gives each group the cheapest layout in which every member
holds at least one sample (plan/memory.py): DDP, else FSDP2 over the group, else FSDP2 with the state
offloaded to host memory. Where a member's memory holds fewer samples than its batch (its share of
the speed), it runs its batch as micro-batches. Devices of profiles without the model's memory
profile (older benches) hold anything: their groups stay DDP under auto, as before. Sharded groups
under parameter servers (hybrid, ps) are not built yet, so such a plan is refused.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import UsageError
from ..schema.stages import Device, Engine, Plan, RankPlan, Strategy
from .costed import Device as CostedDevice
from .memory import REPLICA, Layout, MemoryNeed, micro_batches


def refuse_engine(strategy: Strategy, engine: Engine | None) -> None:
    """Before anything is probed or benched: fsdp groups under parameter servers."""
    if engine is Engine.FSDP and strategy in (Strategy.HYBRID, Strategy.PS):
        raise UsageError(f"--engine fsdp: a {strategy.value} plan cannot have fsdp groups yet (sharded "
                         f"groups exchange with parameter servers in a later version); plan with "
                         f"--strategy allreduce, or --engine ddp")


def may_shard(strategy: Strategy, engine: Engine | None) -> bool:
    """Whether a plan of ``strategy`` may have sharded groups (none under parameter servers yet)."""
    return engine is not Engine.DDP and strategy in (Strategy.AUTO, Strategy.ALLREDUCE)


def with_engines(plan: Plan, engine: Engine | None,
                 needs: Mapping[tuple[str, Device], MemoryNeed] | None = None) -> Plan:
    """``plan`` with every group on ``engine`` (None: each group's cheapest that fits), and each worker
    of a device in ``needs`` (by node and device name) with its micro-batches and memory figures."""
    if plan.ps_shards:
        refuse_engine(plan.strategy, engine or Engine.DDP)
    known = needs or {}
    ranks = list(plan.ranks)
    groups = []
    for g in plan.groups:
        members = [(plan.ranks[r], known.get((plan.ranks[r].node, plan.ranks[r].device))) for r in g.ranks]
        layout = group_layout(engine, [need for _, need in members], len(members), bool(plan.ps_shards))
        groups.append(dataclasses.replace(g, engine=layout.engine))
        for rank, need in members:
            ranks[rank.rank] = fitted_rank(rank, need, layout)
    return dataclasses.replace(plan, groups=tuple(groups), ranks=tuple(ranks),
                               reason=plan.reason + memory_note(ranks))


def memory_note(ranks: list[RankPlan]) -> str:
    """The reason's word on the workers that micro-batch, and on offloaded groups (how to launch them)."""
    micro = [r for r in ranks if r.micro_batches > 1]
    offloaded = sorted({r.group for r in ranks if r.memory is not None and r.memory.offload and r.group is not None})
    note = (f"; {len(micro)} device(s) run their batch as micro-batches, their memory holding less than their "
            f"share of the speed" if micro else "")
    if offloaded:
        note += (f"; group(s) {', '.join(map(str, offloaded))} keep their state in host memory: launch with "
                 f"--env HGTRAIN_FSDP_OFFLOAD=1")
    return note


def priced_layout(devices: list[CostedDevice], engine: Engine | None, shardable: bool) -> Layout:
    """The layout ``with_engines`` gives one group of all ``devices`` (the all-reduce group the cost
    model prices): where the plan may shard and a device holds no replica, a sharded group of all
    (``auto`` plans allreduce then); otherwise replicas, or fsdp over all where asked."""
    return group_layout(engine, [d.memory for d in devices], len(devices), parameter_servers=not shardable)


def micro_priced(devices: list[CostedDevice], batches: list[int], layout: Layout) -> list[CostedDevice]:
    """The devices as the cost model prices them at ``batches`` under ``layout``: one whose batch runs
    as m micro-batches pays its fixed cost once per micro-batch (m a + c b), and carries m."""
    if not any(d.memory for d in devices):
        return devices
    out = []
    for d, batch in zip(devices, batches):
        parts = micro_batches(batch, d.memory.cap(layout)) if d.memory is not None else 1
        out.append(dataclasses.replace(d, a=d.a * parts, micro=parts) if parts > 1 else d)
    return out


def _layouts(engine: Engine | None, members: int, parameter_servers: bool) -> list[Layout]:
    sharded = [Layout(Engine.FSDP, members), Layout(Engine.FSDP, members, offload=True)]
    if engine is Engine.DDP or parameter_servers:
        return [REPLICA]
    return sharded if engine is Engine.FSDP else [REPLICA, *sharded]


def group_layout(engine: Engine | None, needs: list[MemoryNeed | None], members: int,
                 parameter_servers: bool = False) -> Layout:
    """The first layout allowed by ``engine`` in which every member holds one sample (a member of
    unknown memory holds anything); the last allowed where none is (usable_devices left out the
    devices that fit under none)."""
    candidates = _layouts(engine, members, parameter_servers)
    for layout in candidates:
        if all(need is None or need.cap(layout) >= 1 for need in needs):
            return layout
    return candidates[-1]


def fitted_rank(rank: RankPlan, need: MemoryNeed | None, layout: Layout) -> RankPlan:
    """``rank`` with the micro-batches its memory needs for its batch under ``layout``, and its
    figures at the micro-batch."""
    if need is None or rank.batch_size is None:
        return rank
    parts = micro_batches(rank.batch_size, need.cap(layout))
    return dataclasses.replace(rank, micro_batches=parts, memory=need.record(layout, -(-rank.batch_size // parts)))
