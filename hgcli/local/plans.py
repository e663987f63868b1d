"""Plans for emulated devices on this machine, for tests, the benchmarks and ``python -m hgcli.local``.

Not the planner (hgcli/plan/placement.py): this only lays out the plan you describe (speeds, groups, batches,
PS count) in the rank-numbering convention: workers first, group by group, then the PS ranks.
"""
from __future__ import annotations

from typing import Sequence

from ..schema import stages as m


def emulated_plan(groups: Sequence[Sequence[float]], batches: Sequence[Sequence[int]], *,
                  n_ps: int = 0, accumulate: Sequence[int] | None = None,
                  staleness_bound: int = 0, strategy: m.Strategy | None = None,
                  nodes: Sequence[Sequence[str]] | None = None, ps_node: str = "local",
                  overlap: bool = False, wire: m.Wire = m.Wire.FP32) -> m.Plan:
    """``groups``: speeds of each group's devices; ``batches`` (and ``nodes``, default all "local"):
    the per-rank batch sizes (and node names) alike."""
    if len(groups) != len(batches) or any(len(a) != len(b) for a, b in zip(groups, batches)):
        raise ValueError("groups and batches need the same shape")
    if len(groups) > 1 and n_ps < 1:
        raise ValueError("several groups need at least one PS rank")
    ranks: list[m.RankPlan] = []
    group_plans = []
    for gid, (speeds, sizes) in enumerate(zip(groups, batches)):
        members = []
        for i, (speed, size) in enumerate(zip(speeds, sizes)):
            r = len(ranks)
            node = nodes[gid][i] if nodes else "local"
            ranks.append(m.RankPlan(rank=r, role=m.Role.WORKER, node=node, device=m.Device(f"emu{r}"),
                                    group=gid, batch_size=size, local_rank=_local(ranks, node),
                                    emulated=True, speed=speed))
            members.append(r)
        acc = accumulate[gid] if accumulate else 1
        group_plans.append(m.GroupPlan(id=gid, ranks=tuple(members), accumulate=acc))
    ps = []
    for _ in range(n_ps):
        r = len(ranks)
        ranks.append(m.RankPlan(rank=r, role=m.Role.PS, node=ps_node, device=m.CPU,
                                local_rank=_local(ranks, ps_node)))
        ps.append(r)
    if strategy is None:
        strategy = m.Strategy.HYBRID if n_ps else m.Strategy.ALLREDUCE
    return m.Plan(strategy=strategy, world_size=len(ranks), groups=tuple(group_plans),
                  ranks=tuple(ranks), predicted_samples_per_s={},
                  global_batch=sum(sum(b) for b in batches), cluster="local-emulated",
                  reason="laid out by hand for an emulated run (hgcli.local.plans)",
                  staleness_bound=staleness_bound, ps_shards=tuple(ps), overlap=overlap, wire=wire)


def _local(ranks: Sequence[m.RankPlan], node: str) -> int:
    return sum(1 for r in ranks if r.node == node)
