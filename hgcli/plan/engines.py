"""Each group's engine in a plan (``GroupPlan.engine``): DDP, or FSDP2 where the request asks for it.

``--engine auto`` (JobSpec.engine None) is DDP for every group for now: the planner has no memory
model yet to tell that a group's replica with its optimizer state does not fit its devices, so it
never has a reason to shard. Sharded groups under parameter servers (hybrid, ps) are not built yet,
so such a plan is refused.
"""
from __future__ import annotations

import dataclasses

from ..errors import UsageError
from ..schema.stages import Engine, Plan, Strategy


def refuse_engine(strategy: Strategy, engine: Engine | None) -> None:
    """Before anything is probed or benched: fsdp groups under parameter servers."""
    if engine is Engine.FSDP and strategy in (Strategy.HYBRID, Strategy.PS):
        raise UsageError(f"--engine fsdp: a {strategy.value} plan cannot have fsdp groups yet (sharded "
                         f"groups exchange with parameter servers in a later version); plan with "
                         f"--strategy allreduce, or --engine ddp")


def with_engines(plan: Plan, engine: Engine | None) -> Plan:
    """``plan`` with every group on ``engine`` (None: the planner's choice, DDP)."""
    chosen = engine or Engine.DDP
    if plan.ps_shards:
        refuse_engine(plan.strategy, chosen)
    groups = tuple(dataclasses.replace(g, engine=chosen) for g in plan.groups)
    return dataclasses.replace(plan, groups=groups)
