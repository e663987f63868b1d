"""Plans laid out by hand for launch tests (the planner has its own tests): which rank runs where.

Ranks are numbered as the planner numbers them: workers first, group by group, then the PS ranks.
Devices are emulated (they run on the CPU), so no test needs a GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from hgcli.schema.stages import Cluster, GroupPlan, NodeSpec, Plan, RankPlan, Role, Strategy
from hgcli.plan.files import write_plan


def local_cluster(names: Sequence[str] = ("local",)) -> Cluster:
    """Nodes on this machine through the local transport, running ranks with this interpreter."""
    return Cluster(nodes=tuple(NodeSpec(name=n, host="localhost", python=sys.executable) for n in names))


def make_plan(cluster: Cluster, groups: Sequence[Sequence[str]], *, ps: Sequence[str] = (),
              batch: int = 16, strategy: Strategy | None = None, predicted: float | None = None,
              speeds: Sequence[float] | None = None) -> Plan:
    """``groups``: per group, the node of each of its workers; ``ps``: the node of each PS rank;
    ``speeds``: the emulated speed of each group's devices (default 1.0)."""
    ranks: list[RankPlan] = []
    local: dict[str, int] = {}
    group_plans = []

    def add(node: str, role: Role, group: int | None) -> int:
        r = len(ranks)
        speed = speeds[group] if speeds and group is not None else 1.0
        ranks.append(RankPlan(rank=r, role=role, node=node, device="cpu" if role is Role.PS else f"emu{r}",
                              group=group, batch_size=batch if role is Role.WORKER else None,
                              local_rank=local.get(node, 0), emulated=role is Role.WORKER, speed=speed))
        local[node] = local.get(node, 0) + 1
        return r

    for gid, nodes in enumerate(groups):
        group_plans.append(GroupPlan(id=gid, ranks=tuple(add(n, Role.WORKER, gid) for n in nodes)))
    shards = tuple(add(n, Role.PS, None) for n in ps)
    if strategy is None:
        strategy = Strategy.HYBRID if ps else Strategy.ALLREDUCE
    workers = sum(len(g) for g in groups)
    prediction = {strategy.value: predicted, "ideal": predicted * 1.25} if predicted else {}
    return Plan(strategy=strategy, world_size=len(ranks), groups=tuple(group_plans), ranks=tuple(ranks),
                predicted_samples_per_s=prediction, global_batch=batch * workers,
                cluster=cluster.fingerprint(), reason="laid out by hand for a launch test",
                staleness_bound=2 if ps else 0, ps_shards=shards)


def plan_file(tmp_path: Path, plan: Plan) -> Path:
    path = tmp_path / "plan.json"
    write_plan(path, plan)
    return path
