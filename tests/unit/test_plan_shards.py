"""Where the PS shards go (the bench's link matrix) and the CPU cost of a PS exchange."""
from __future__ import annotations

import dataclasses

from hgcli.schema.stages import ExchangeProfile, JobSpec, ModelSpec, Role, Strategy
from hgcli.plan.placement import make_plan
from tests.unit.plan_clusters import A100, T4, Kind, cluster, link, measured

RESNET = ModelSpec("resnet50-sized", 25_600_000)


def ps_nodes(plan) -> list[str]:
    return sorted(plan.rank(r).node for r in plan.ps_shards)


def test_shards_avoid_a_node_whose_links_to_the_leaders_are_slow():
    """n2 has the best NIC (10 GB/s, but only to n3, where no group is) and 10 MB/s links to the
    leaders' nodes: ranking PS nodes by NIC put the shard there; ranked by the leaders' links it
    goes where both leaders reach it fastest, and the reason says where and why."""
    links = (link(0, 1, 1.25), link(2, 3, 10.0), link(0, 2, 0.01), link(1, 2, 0.01), link(0, 3, 0.01),
             link(1, 3, 0.01))
    inventory, profiles = cluster([[A100, A100], [T4, T4], [], []], links=links, model=RESNET)
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=256))
    assert plan.ps_shards and not {"n2", "n3"} & set(ps_nodes(plan))
    assert "leaders' slowest link to a shard 1.25 GB/s" in plan.reason
    assert f"on node{'s' if len(set(ps_nodes(plan))) > 1 else ''} {', '.join(sorted(set(ps_nodes(plan))))}" \
        in plan.reason


def test_two_like_groups_behind_a_slow_link_get_a_local_shard_each():
    """Two groups of one kind on two nodes joined by 1 Gbit/s: one shard would put every push of the
    far group on the link; a shard on each node halves each leader's bytes across it."""
    inventory, profiles = cluster([[A100, A100], [A100, A100]], links=(link(0, 1, 0.125),), model=RESNET)
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=512))
    assert len(plan.groups) == 2
    assert ps_nodes(plan) == ["n0", "n1"]
    assert "2 PS shards on nodes n0, n1" in plan.reason and "2 of 2 leader node(s) with a local shard" in plan.reason
    assert all(plan.rank(r).role is Role.PS for r in plan.ps_shards)


def test_an_explicit_shard_count_is_placed_by_the_links_too():
    links = (link(0, 1, 1.25), link(2, 3, 10.0), link(0, 2, 0.01), link(1, 2, 0.01), link(0, 3, 0.01),
             link(1, 3, 0.01))
    inventory, profiles = cluster([[A100, A100], [T4, T4], [], []], links=links, model=RESNET)
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=256, ps_ranks=2))
    assert ps_nodes(plan) == ["n0", "n1"]


# The hybrid_links benchmark's shape (benchmarks/hybrid_links.py): devices [1, 1, 0.25, 0.25] x time
# scale 0.2 on nodes a (fast + PS) and b, 1 Gbit/s between, the MLP at 25.8M parameters; a speed-1
# step of 17 samples takes 0.32 s of CPU. Its two namespaces share one 2-core machine: a core each.
# The exchange is what exchange.py measured for 25.8M parameters on that machine (load 6):
# round trip 1.066 s, fixed cost 1.2 ms, the PS's update 0.381 s.
LINKS_PARAMS = 43 * 600_000 + 10


def links_scenario(round_trip: float = 1.066, service: float = 0.381, cores: int = 1):
    fast = Kind("emulated fast", 0.2, None, a=0.02, c=0.0175)
    slow = Kind("emulated slow", 0.05, None, a=0.02, c=0.0175)
    inventory, profiles = cluster([[fast, fast], [slow, slow]], links=(link("a", "b", 0.125, 1e-4),),
                                  model=ModelSpec("mlp 25.8M", LINKS_PARAMS), names=["a", "b"])
    inventory = dataclasses.replace(inventory, nodes=tuple(dataclasses.replace(n, cpu_cores=cores)
                                                           for n in inventory.nodes))
    ex = ExchangeProfile(bytes=4 * LINKS_PARAMS, round_trip_s=measured(round_trip), latency_s=measured(0.0012),
                         service_s=measured(service))
    return inventory, dataclasses.replace(profiles, devices=tuple(dataclasses.replace(p, exchange=ex)
                                                                  for p in profiles.devices))


def test_overlap_does_not_hide_the_leaders_cpu_work_of_an_exchange():
    """Under overlap, a round trip with 0.69 s of RPC copies (1.066 s less the PS's 0.381 s update)
    against one with 0.12 s: the copies' leader half stays on the training thread, so hybrid is
    predicted slower. Core counts unknown (no crowding) to isolate the term: before it, both
    exchanges hid behind the groups' compute (3.2 and 10 s per push) and predicted alike."""
    def hybrid(round_trip: float) -> float:
        inventory, profiles = links_scenario(round_trip=round_trip, cores=0)
        plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=40, overlap=True))
        return plan.predicted_samples_per_s["hybrid"]

    assert hybrid(1.066) < 0.95 * hybrid(0.5)
