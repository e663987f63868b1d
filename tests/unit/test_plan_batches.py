"""Batches from each device's throughput curve (its knee), hybrid push sizes, and device kinds that
bench noise does not split: examples, then properties with +-20% jitter on every profile."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hgcli.plan.cost import KNEE_TOLERANCE, MAX_PUSH_GLOBAL_BATCHES
from hgcli.plan.batches import knee
from hgcli.plan.devices import usable_devices
from hgcli.plan.kinds import find_kinds
from hgcli.plan.placement import make_plan
from hgcli.schema.stages import (
    ExchangeProfile, GpuInfo, Inventory, JobSpec, Measurement, ModelSpec, NodeInfo, Plan, Profiles, StepSample,
    Strategy, DeviceProfile,
)

from tests.unit.plan_clusters import A100, T4, Kind, cluster, link, measured
from tests.unit.test_plan import capacity, check_plan, clusters

EXAMPLE = ModelSpec("example", 5514)


def spread(low: float, median: float, high: float) -> Measurement:
    return Measurement(median=median, min=low, max=high, repeats=7)


def jittered(profiles: Profiles, factors: list[float], widen: float = 0.0) -> Profiles:
    """Every step time of device i times factors[i] (a bench on another node, or minutes later); the
    slowest repeat also ``widen`` further up (the spread of the repeats)."""
    devices = []
    for p, f in zip(profiles.devices, factors):
        steps = tuple(dataclasses.replace(s, seconds=Measurement(
            median=s.seconds.median * f, min=s.seconds.min * f, max=s.seconds.max * f * (1 + widen),
            repeats=s.seconds.repeats)) for s in p.steps)
        devices.append(dataclasses.replace(p, steps=steps))
    return dataclasses.replace(profiles, devices=tuple(devices))


def batches(plan: Plan) -> list[int]:
    return [r.batch_size for r in plan.workers]


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------

# A quick bench of the default emulated cluster (2 x speed 1, 2 x speed 0.25 on one node) with the
# example model, on a 2-core CPU shared with other jobs: (batch, fastest, median, slowest) in ms.
# Every step is overhead: from batch 4 to 256 the time barely moves, and batch 16 was faster than 4.
QUICK_STEPS = {1.0: [(4, 0.4168, 0.4885, 0.9003), (16, 0.3946, 0.4106, 0.5422),
                     (64, 0.435, 0.4888, 0.5804), (256, 0.5785, 0.6889, 1.3229)],
               0.25: [(4, 2.2589, 2.8496, 2.9952), (16, 1.3865, 1.9498, 2.086),
                      (64, 2.8476, 3.0157, 3.3609), (256, 3.1795, 3.6884, 3.7766)]}
QUICK_TFLOPS = {1.0: 0.0944, 0.25: 0.0212}


def quick_default_cluster() -> tuple[Inventory, Profiles]:
    inventory, profiles = cluster([[A100, A100, T4, T4]], model=EXAMPLE, names=["local"],
                                  links=(link("local", "local", 0.96, 0.00028),))
    devices = tuple(dataclasses.replace(
        p, steps=tuple(StepSample(b, spread(lo / 1e3, med / 1e3, hi / 1e3), 1) for b, lo, med, hi in QUICK_STEPS[p.speed]),
        matmul_tflops={"fp32": measured(QUICK_TFLOPS[p.speed])}) for p in profiles.devices)
    nodes = tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes)
    return dataclasses.replace(inventory, nodes=nodes), dataclasses.replace(profiles, devices=devices)


def test_overhead_bound_steps_give_slow_devices_their_share_not_one_sample():
    """On main this profile planned the slow devices at batch 1 (x 64 accumulated under hybrid)
    against 63 for the fast ones: their fixed cost alone outlasts a fast step, so equal step times
    gave them the least possible. Their samples/s grows with the batch as fast as anyone's, so they
    get a share by speed; the global batch holds everyone below the knee, and the reason says so."""
    inventory, profiles = quick_default_cluster()
    for strategy in (Strategy.AUTO, Strategy.ALLREDUCE, Strategy.HYBRID, Strategy.PS):
        plan = make_plan(inventory, profiles, JobSpec(strategy=strategy, global_batch=128))
        fast, _, slow, _ = b = batches(plan)
        assert sum(b) == 128 and b[0] == b[1] and b[2] == b[3]
        # by measured samples/s at the largest benched batch (6.5x), not 1 sample
        assert 6 <= slow <= 128 / (2 * (1 + 6.5)) * 1.5 and fast < 63
        assert "global batch 128 holds 4 of 4 devices below their knee" in plan.reason
        for g in plan.groups:
            assert all(plan.rank(r).batch_size > 1 for r in g.ranks)


def test_flat_steps_split_the_global_batch_by_speed():
    """A step that takes as long at every batch benched (a small model: all fixed cost) is priced
    per sample from the matmul rate; the split then follows speed: 51/51/13/13 for speeds 1 and
    0.25, where equal step times gave 63/63/1/1."""
    flat_fast = dataclasses.replace(A100, a=0.00025, c=0.0, per_sample_mib=0.01)
    flat_slow = dataclasses.replace(T4, a=0.00025, c=0.0, per_sample_mib=0.01)
    inventory, profiles = cluster([[flat_fast, flat_fast, flat_slow, flat_slow]], model=EXAMPLE)
    profiles = dataclasses.replace(profiles, devices=tuple(
        dataclasses.replace(p, matmul_tflops={"fp32": measured(0.1 * p.speed)}) for p in profiles.devices))
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.ALLREDUCE, global_batch=128))
    assert batches(plan) == [51, 51, 13, 13]
    assert "below their knee" in plan.reason


def test_a_large_global_batch_puts_every_device_past_its_knee_split_by_speed():
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    devices, _, _ = usable_devices(inventory, profiles, 4e6)
    knees = [knee(d) for d in devices]
    assert knees == [130, 130, 103, 103]
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.ALLREDUCE, global_batch=2000))
    b = batches(plan)
    assert all(x >= k for x, k in zip(b, knees)) and "knee" not in plan.reason
    # proportional to samples/s at the knee, within the tolerance (past the knee both are close)
    share = A100.seconds(130) / 130 / (T4.seconds(103) / 103)
    assert abs(b[0] / b[2] / (1 / share) - 1) <= KNEE_TOLERANCE * 2
    steps = [A100.seconds(b[0]), T4.seconds(b[2])]
    assert max(steps) / min(steps) <= 1 + 2 * KNEE_TOLERANCE


def test_the_knee_is_measured_against_the_best_the_memory_allows():
    small = dataclasses.replace(A100, name="A100-small", memory_mib=math.ceil((600 + 40 * 50) / 0.9))
    inventory, profiles = cluster([[small], [A100]])
    (capped, roomy), _, _ = usable_devices(inventory, profiles, 4e6)
    assert capped.cap == 50
    k = knee(capped)
    assert capped.rate(k) >= (1 - KNEE_TOLERANCE) * capped.rate(50) > capped.rate(k - 1)
    assert k < knee(roomy) < roomy.cap                                 # a smaller best, an earlier knee


def exchange(round_trip: float) -> ExchangeProfile:
    return ExchangeProfile(bytes=4_000_000, round_trip_s=measured(round_trip), latency_s=measured(0.0005),
                           service_s=measured(0.0002))


def test_hybrid_groups_push_every_step_unless_the_exchange_is_dear():
    """Every push is one update of the PS's optimizer: a group pushes its step's batch when the
    exchange is cheap (as many updates as DDP's steps), and accumulates for throughput only when the
    exchange would otherwise cost more than KNEE_TOLERANCE of its samples/s, never past one global
    batch (MAX_PUSH_GLOBAL_BATCHES: larger pushes cost accuracy, measured end to end)."""
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    job = JobSpec(strategy=Strategy.HYBRID, global_batch=256)

    def plan_with(round_trip: float) -> Plan:
        devices = tuple(dataclasses.replace(p, exchange=exchange(round_trip)) for p in profiles.devices)
        return make_plan(inventory, dataclasses.replace(profiles, devices=devices), job)

    cheap, dear = plan_with(0.001), plan_with(0.2)
    assert [g.accumulate for g in cheap.groups] == [1, 1]
    for g in dear.groups:
        step = sum(dear.rank(r).batch_size for r in g.ranks)
        assert 1 <= g.accumulate <= math.ceil(MAX_PUSH_GLOBAL_BATCHES * 256 / step)
    # a 200 ms push per ~60 ms step wants large pushes: each group accumulates to the first push of
    # a global batch (212 x 2, 44 x 6) and no further
    assert [g.accumulate for g in dear.groups] == [2, 6]
    assert MAX_PUSH_GLOBAL_BATCHES == 1


def test_a_low_staleness_bound_is_kept_by_pushing_larger_or_waiting():
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    free = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=256))
    tight = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=256, staleness=1))
    assert free.staleness_bound > 1 and tight.staleness_bound == 1
    # S = 1 with two groups: the fast one may push once per push of the slow one, so it pushes larger
    assert tight.groups[0].accumulate > free.groups[0].accumulate
    assert tight.predicted_samples_per_s["hybrid"] <= free.predicted_samples_per_s["hybrid"]
    ps_free = make_plan(inventory, profiles, JobSpec(strategy=Strategy.PS, global_batch=256))
    ps_tight = make_plan(inventory, profiles, JobSpec(strategy=Strategy.PS, global_batch=256, staleness=3))
    # every ps worker pushes each step: the fast ones wait for the slow ones to stay within S, which
    # slows their own steps; the run's rate is the slowest worker's steps either way (equal steps
    # per epoch), so the fast ones only wait sooner
    fast = [str(g.id) for g in ps_free.groups if ps_free.rank(g.ranks[0]).speed == 1.0]
    assert fast and all(ps_tight.predicted_group_samples_per_s[g] < ps_free.predicted_group_samples_per_s[g]
                        for g in fast)
    assert ps_tight.predicted_samples_per_s["ps"] == pytest.approx(ps_free.predicted_samples_per_s["ps"])


# ---------------------------------------------------------------------------------------------
# Kinds
# ---------------------------------------------------------------------------------------------

def test_the_homogeneous_cluster_of_three_hosts_is_one_allreduce_group_with_equal_batches():
    """Six emulated A100 at speed 1 on three hosts, each host benched on its own: one host's quick
    bench measured 0.36 ms a step, another's 0.44 ms (noise). On main: ps with 6 groups, two
    devices at batch 1, '2 speed classes'."""
    flat = dataclasses.replace(A100, a=0.0003, c=0.0, per_sample_mib=0.01)
    inventory, profiles = cluster([[flat, flat]] * 3, model=EXAMPLE)
    factors = [0.36 / 0.3] * 2 + [0.44 / 0.3] * 2 + [0.40 / 0.3] * 2
    profiles = jittered(profiles, factors, widen=0.2)
    plan = make_plan(inventory, profiles, JobSpec(global_batch=240))
    assert plan.strategy is Strategy.ALLREDUCE and len(plan.groups) == 1 and not plan.ps_shards
    assert batches(plan) == [40] * 6
    assert "homogeneous" in plan.reason


def test_a_device_measured_four_times_slower_is_its_own_kind():
    inventory, profiles = cluster([[A100, A100], [A100, A100]])
    slow_node = jittered(profiles, [1.0, 1.0, 4.0, 4.0], widen=0.3)
    devices, _, _ = usable_devices(inventory, slow_node, 4e6)
    assert find_kinds(devices, list(slow_node.devices)) == [[0, 1], [2, 3]]
    plan = make_plan(inventory, slow_node, JobSpec(global_batch=256))
    assert "homogeneous" not in plan.reason
    assert batches(plan)[0] > 2 * batches(plan)[2]


def test_kinds_need_the_same_name_memory_and_declared_speed():
    other = dataclasses.replace(A100, name="A100-80GB", memory_mib=81920)
    inventory, profiles = cluster([[A100, other, dataclasses.replace(A100, speed=0.9)]])
    devices, _, _ = usable_devices(inventory, profiles, 4e6)
    assert find_kinds(devices, list(profiles.devices)) == [[0], [1], [2]]


def global_batch_for(devices: list[Kind], pick: float) -> int:
    n = len(devices)
    top = min(capacity(devices) - n, 64 * n)
    assume(top >= n)
    return n + round(pick * (top - n))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=clusters(homogeneous=True), pick=st.floats(0.0, 1.0), widen=st.floats(0.0, 0.3),
       jitter=st.lists(st.floats(0.8, 1.2), min_size=24, max_size=24))
def test_jitter_never_makes_a_homogeneous_cluster_anything_but_one_allreduce_group(data, pick, widen, jitter):
    (inventory, profiles), devices, nodes = data
    global_batch = global_batch_for(devices, pick)
    noisy = jittered(profiles, jitter, widen)
    plan = make_plan(inventory, noisy, JobSpec(global_batch=global_batch))
    check_plan(plan, nodes, global_batch)
    assert plan.strategy is Strategy.ALLREDUCE and len(plan.groups) == 1 and not plan.ps_shards
    assert "homogeneous" in plan.reason
    assert max(batches(plan)) - min(batches(plan)) <= 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=clusters(), pick=st.floats(0.0, 1.0), widen=st.floats(0.0, 0.3),
       jitter=st.lists(st.floats(0.8, 1.2), min_size=24, max_size=24),
       strategy=st.sampled_from([Strategy.AUTO, Strategy.HYBRID]))
def test_jitter_alone_never_splits_devices_of_one_kind(data, pick, widen, jitter, strategy):
    (inventory, profiles), devices, nodes = data
    global_batch = global_batch_for(devices, pick)
    plan = make_plan(inventory, jittered(profiles, jitter, widen), JobSpec(strategy=strategy, global_batch=global_batch))
    check_plan(plan, nodes, global_batch)
    by_kind: dict[str, list[int]] = {}
    group_of: dict[tuple[str, str], set[int]] = {}
    for r in plan.workers:
        name = nodes[int(r.node[1:])][int(r.device[3:])].name
        by_kind.setdefault(name, []).append(r.batch_size)
        group_of.setdefault((name, r.node), set()).add(r.group)
    assert all(max(b) - min(b) <= 1 for b in by_kind.values())     # one kind, one batch
    assert all(len(g) == 1 for g in group_of.values())               # and one group on a node


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=clusters(homogeneous=True), pick=st.floats(0.0, 1.0), widen=st.floats(0.0, 0.3),
       jitter=st.lists(st.floats(0.8, 1.2), min_size=24, max_size=24))
def test_a_clear_four_times_difference_still_splits_one_model(data, pick, widen, jitter):
    (inventory, profiles), devices, nodes = data
    assume(len(devices) >= 2)
    global_batch = global_batch_for(devices, pick)
    # the second half of the devices (in profile order) measured 4x slower, on top of the jitter
    half = len(devices) // 2
    factors = [f * (4.0 if i >= half else 1.0) for i, f in enumerate(jitter)]
    noisy = jittered(profiles, factors, widen)
    usable, _, _ = usable_devices(inventory, noisy, 4e6)
    slow = {(p.node, p.device) for p in noisy.devices[half:]}
    node_names = [n.name for n in inventory.nodes]
    kinds = find_kinds(usable, [next(p for p in noisy.devices if (p.node, p.device) == (node_names[d.node], d.device))
                            for d in usable])
    assert len(kinds) == 2
    for kind in kinds:
        assert len({(node_names[usable[i].node], usable[i].device) in slow for i in kind}) == 1
    plan = make_plan(inventory, noisy, JobSpec(strategy=Strategy.HYBRID, global_batch=global_batch))
    for g in plan.groups:
        assert len({(plan.rank(r).node, plan.rank(r).device) in slow for r in g.ranks}) == 1


def test_groups_whose_steps_are_shorter_wait_for_the_slowest_so_the_run_is_priced_by_it():
    """Every worker runs the same number of steps per epoch: where the slow devices' fixed cost alone
    outlasts a fast step (the quick MLP profile), the fast group waits at the end. The run's
    prediction is every group's samples per step over the slowest group's step; each group's own
    rate while it runs is in the plan for the launch summary."""
    inventory, profiles = quick_default_cluster()
    hybrid = make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=128, model=EXAMPLE))
    assert sorted(hybrid.predicted_group_samples_per_s) == ["0", "1"]
    # ps: every device its own group, every worker pushes each step
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.PS, global_batch=128, model=EXAMPLE))
    own = plan.predicted_group_samples_per_s
    assert sorted(own) == [str(g.id) for g in plan.groups] and len(own) == 4
    samples = {str(g.id): sum(plan.rank(r).batch_size for r in g.ranks) for g in plan.groups}
    step = {g: samples[g] / own[g] for g in own}
    assert max(step.values()) > 1.4 * min(step.values())        # the steps cannot be equalized here
    whole = plan.predicted_samples_per_s["ps"]
    assert whole == pytest.approx(sum(samples.values()) / max(step.values()))
    assert whole < 0.75 * sum(own.values())                      # not every group busy throughout
    allreduce = make_plan(inventory, profiles, JobSpec(strategy=Strategy.ALLREDUCE, global_batch=128, model=EXAMPLE))
    assert allreduce.predicted_group_samples_per_s == {"0": allreduce.predicted_samples_per_s["allreduce"]}


def test_emulated_devices_that_crowd_their_nodes_cores_are_named_and_small_ones_are_not():
    from hgcli.plan.contention import contention_note

    inventory, profiles = quick_default_cluster()          # speeds 1, 1, 0.25, 0.25 on 2 cores
    plan = make_plan(inventory, profiles, JobSpec(global_batch=128, model=EXAMPLE))
    note = contention_note(plan, inventory)
    assert note is not None and "local ask 2.5 of its 2 cores" in note
    slower = dataclasses.replace(plan, ranks=tuple(dataclasses.replace(r, speed=r.speed * 0.4) for r in plan.ranks))
    assert contention_note(slower, inventory) is None       # 1.0 of 2 cores: a small share
    many = dataclasses.replace(inventory, nodes=tuple(dataclasses.replace(n, cpu_cores=16) for n in inventory.nodes))
    assert contention_note(plan, many) is None
