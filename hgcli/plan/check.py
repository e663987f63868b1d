"""The whole-plan check of a plan file (``launch --plan``), before anything is recorded or started.

The planner's plans hold these rules by construction; a hand-edited file may not, and each broken
rule used to surface late and obscurely (a missing rank as an IndexError after the job record and
the agents existed, ``world_size`` 5 with 2 ranks "succeeding", a negative batch accepted). Each
rule names the field as the file spells it (``ranks[3].batch_size``), so the fix is one edit.
Types and enum values are already checked by the schema codec when the file is read.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

from ..schema.stages import Plan, RankPlan, Role


class PlanProblem(ValueError):
    """The first rule a plan breaks: ``field`` as the file names it, ``message`` what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_plan(plan: Plan) -> Plan:
    """``plan`` with its ranks in rank order, or PlanProblem for the first rule it breaks."""
    _check_ranks(plan)
    by_rank = {r.rank: r for r in plan.ranks}
    ordered = tuple(by_rank[i] for i in range(len(plan.ranks)))
    if plan.world_size != len(ordered):
        raise PlanProblem("world_size", f"is {plan.world_size} but the plan lists {len(ordered)} rank(s)")
    if plan.global_batch < 1:
        raise PlanProblem("global_batch", f"must be at least 1, not {plan.global_batch}")
    if plan.staleness_bound < 0:
        raise PlanProblem("staleness_bound", f"must be >= 0, not {plan.staleness_bound}")
    _check_workers(plan)
    _check_groups(plan, by_rank)
    _check_shards(plan, by_rank)
    _check_local_ranks(plan)
    if ordered != plan.ranks:
        plan = dataclasses.replace(plan, ranks=ordered)   # plan.rank(i) indexes by position
    return plan


def _check_ranks(plan: Plan) -> None:
    if not plan.ranks:
        raise PlanProblem("ranks", "the plan has no ranks")
    counts = Counter(r.rank for r in plan.ranks)
    for i, r in enumerate(plan.ranks):
        if counts[r.rank] > 1:
            raise PlanProblem(f"ranks[{i}].rank", f"rank {r.rank} is listed {counts[r.rank]} times")
        if not 0 <= r.rank < len(plan.ranks):
            missing = min(set(range(len(plan.ranks))) - set(counts))
            raise PlanProblem(f"ranks[{i}].rank", f"is {r.rank}, but the plan's {len(plan.ranks)} ranks are "
                                                  f"numbered 0-{len(plan.ranks) - 1} (rank {missing} is missing)")


def _check_workers(plan: Plan) -> None:
    for i, r in enumerate(plan.ranks):
        where = f"ranks[{i}]"
        if r.role is Role.WORKER:
            if r.batch_size is None or r.batch_size < 1:
                raise PlanProblem(f"{where}.batch_size", f"worker rank {r.rank} needs a batch size of at "
                                                         f"least 1, not {r.batch_size}")
            if r.group is None:
                raise PlanProblem(f"{where}.group", f"worker rank {r.rank} belongs to no group")
        else:
            if r.group is not None:
                raise PlanProblem(f"{where}.group", f"parameter-server rank {r.rank} cannot be in a group "
                                                    f"(it is in group {r.group})")
        if not r.speed > 0:
            raise PlanProblem(f"{where}.speed", f"must be > 0, not {r.speed}")
        for k, s in enumerate(r.slowdown):
            if not (math.isfinite(s.after_s) and s.after_s >= 0):
                raise PlanProblem(f"{where}.slowdown[{k}].after_s", f"must be a number >= 0, not {s.after_s}")
            if not (math.isfinite(s.factor) and s.factor >= 1):
                raise PlanProblem(f"{where}.slowdown[{k}].factor", f"must be a number >= 1, not {s.factor}")
    if not plan.workers:
        raise PlanProblem("ranks", "the plan has no worker rank")


def _check_groups(plan: Plan, by_rank: dict[int, RankPlan]) -> None:
    seen_ids: set[int] = set()
    listed: dict[int, int] = {}   # worker rank -> the group that lists it
    for gi, g in enumerate(plan.groups):
        where = f"groups[{gi}]"
        if g.id in seen_ids:
            raise PlanProblem(f"{where}.id", f"group {g.id} is listed twice")
        seen_ids.add(g.id)
        if not g.ranks:
            raise PlanProblem(f"{where}.ranks", f"group {g.id} has no ranks")
        if g.accumulate < 1:
            raise PlanProblem(f"{where}.accumulate", f"must be at least 1, not {g.accumulate}")
        for rank in g.ranks:
            member = by_rank.get(rank)
            if member is None:
                raise PlanProblem(f"{where}.ranks", f"group {g.id} lists rank {rank}, which the plan does not have")
            if member.role is not Role.WORKER:
                raise PlanProblem(f"{where}.ranks", f"group {g.id} lists rank {rank}, a parameter-server rank")
            if member.group != g.id:
                raise PlanProblem(f"{where}.ranks", f"group {g.id} lists rank {rank}, whose group is {member.group}")
            if rank in listed:
                raise PlanProblem(f"{where}.ranks", f"rank {rank} is also listed in group {listed[rank]}")
            listed[rank] = g.id
    for i, r in enumerate(plan.ranks):
        if r.role is Role.WORKER and r.rank not in listed:
            raise PlanProblem(f"ranks[{i}].group", f"worker rank {r.rank} is in group {r.group}, "
                                                   "which does not list it")


def _check_shards(plan: Plan, by_rank: dict[int, RankPlan]) -> None:
    ps = {r.rank for r in plan.ranks if r.role is Role.PS}
    counts = Counter(plan.ps_shards)
    for i, rank in enumerate(plan.ps_shards):
        if rank not in by_rank:
            raise PlanProblem(f"ps_shards[{i}]", f"rank {rank} is not in the plan")
        if rank not in ps:
            raise PlanProblem(f"ps_shards[{i}]", f"rank {rank} is a worker, not a parameter-server rank")
        if counts[rank] > 1:
            raise PlanProblem(f"ps_shards[{i}]", f"rank {rank} is listed {counts[rank]} times")
    unlisted = sorted(ps - set(plan.ps_shards))
    if unlisted:
        raise PlanProblem("ps_shards", f"parameter-server rank {unlisted[0]} holds no shard (list it here)")


def _check_local_ranks(plan: Plan) -> None:
    seen: dict[tuple[str, int], int] = {}
    for i, r in enumerate(plan.ranks):
        if not 0 <= r.local_rank < len(plan.ranks):     # a node cannot hold more ranks than the plan has
            raise PlanProblem(f"ranks[{i}].local_rank", f"must be between 0 and {len(plan.ranks) - 1}, "
                                                        f"not {r.local_rank}")
        key = (r.node, r.local_rank)
        if key in seen:
            raise PlanProblem(f"ranks[{i}].local_rank", f"rank {r.rank} and rank {seen[key]} both have local "
                                                        f"rank {r.local_rank} on node {r.node}")
        seen[key] = r.rank
