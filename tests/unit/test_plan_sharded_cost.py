"""The cost model of sharded (fsdp) groups (docs/planning.md, "Sharded groups"): their gathers and
reduce-scatter against DDP's all-reduce, offload's host link, micro-batches' gathers, and auto's choice
between DDP on the devices that hold a replica and sharding over more, by cost. Synthetic profiles
(plan_clusters.py) of real (not emulated) devices, so no CPU crowding or measured group step enters and
every figure is checked against arithmetic done here."""
from __future__ import annotations

import dataclasses
from itertools import combinations

import pytest

from hgcli.plan.batches import assign_batches
from hgcli.plan.cost import CostModel
from hgcli.plan.devices import usable_devices
from hgcli.plan.memory import Layout
from hgcli.plan.network import Network
from hgcli.plan.placement import make_plan
from hgcli.plan.sharding import CPU_OPTIMIZER_GBS, HOST_LINK_GBS, gathers_per_update, units_of
from hgcli.schema.stages import Engine, GroupSyncProfile, JobSpec, ModelSpec, Strategy
from tests.unit.plan_clusters import Kind, cluster, link, measured
from tests.unit.test_plan_memory import BIG, MODEL, SMALL, with_model

GPU = Kind("real GPU", 1.0, 40960, emulated=False)
BW, LAT = 1e9, 1e-4


def _on_own_nodes(count: int, parameters: int):
    links = tuple(link(i, j, BW / 1e9, LAT) for i, j in combinations(range(count), 2))
    return cluster([[GPU] for _ in range(count)], links=links, model=ModelSpec("m", parameters))


def _seconds(count: int, parameters: int, engine: Engine) -> float:
    """Seconds per step the all-reduce plan of ``count`` GPUs on ``engine`` predicts (global batch 256)."""
    plan = make_plan(*_on_own_nodes(count, parameters),
                     JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256, engine=engine))
    assert {g.engine for g in plan.groups} == {engine}
    return 256 / plan.predicted_samples_per_s[Strategy.ALLREDUCE]


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("parameters", [1_000_000, 4_000_000])
def test_fsdp_is_priced_slower_than_ddp_by_its_extra_gather(count, parameters):
    """One update of an fsdp group: two all-gathers and a reduce-scatter, 3 (n-1)/n M over the ring
    with 3 (n-1) hops of latency per unit; DDP's all-reduce is 2 (n-1)/n M and 2 (n-1) hops. Same
    devices, same batches: the step differs by one gather, growing with the parameters and the group."""
    extra = _seconds(count, parameters, Engine.FSDP) - _seconds(count, parameters, Engine.DDP)
    m = 4.0 * parameters
    assert extra == pytest.approx((count - 1) / count * m / BW + (count - 1) * LAT, rel=1e-6)


def _model(layout: Layout, micro: tuple[int, ...] = (1, 1), parameters: int = 2_000_000) -> CostModel:
    inventory, profiles = _on_own_nodes(2, parameters)
    names = [n.name for n in inventory.nodes]
    devices, _, _ = usable_devices(inventory, profiles, 4.0 * parameters)
    devices = [dataclasses.replace(d, micro=m) for d, m in zip(devices, micro)]
    _, batches = assign_batches(devices, 256, names)
    return CostModel(devices, batches, Network(names, profiles.links), 4.0 * parameters, 256, inventory,
                     JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256), layout=layout)


def _step(model: CostModel) -> float:
    return 256 / model.allreduce().samples_per_s


def test_offload_adds_the_shards_trips_over_the_host_link_and_the_cpu_optimizer():
    m = 8e6
    sharded, offloaded = _model(Layout(Engine.FSDP, 2)), _model(Layout(Engine.FSDP, 2, offload=True))
    host = 3 * (m / 2) / (HOST_LINK_GBS * 1e9) + (m / 2) / (CPU_OPTIMIZER_GBS * 1e9)
    assert _step(offloaded) - _step(sharded) == pytest.approx(host, rel=1e-6)
    assert _step(sharded) > _step(_model(Layout(Engine.DDP)))
    assert "one fsdp+offload all-reduce group of 2" == offloaded.allreduce().summary


def test_micro_batches_gather_as_the_runtime_does():
    """m micro-batches on every member: m + 1 gathers (every backward gathers again); members of
    different m: one gather per update (resharding after forward off); one reduce-scatter always."""
    assert [gathers_per_update(m) for m in ([1, 1], [3, 3], [1, 3], [])] == [2, 4, 1, 2]
    m = 8e6
    one = _step(_model(Layout(Engine.FSDP, 2)))
    assert _step(_model(Layout(Engine.FSDP, 2), (3, 3))) - one == pytest.approx(2 * (m / 2 / BW + LAT), rel=1e-6)
    assert one - _step(_model(Layout(Engine.FSDP, 2), (1, 3))) == pytest.approx(m / 2 / BW + LAT, rel=1e-6)


def test_units_are_the_parameters_over_the_largest_unit():
    assert units_of(dataclasses.replace(MODEL, parameter_bytes=20_000, largest_unit_bytes=1_000)) == 20
    assert units_of(dataclasses.replace(MODEL, parameter_bytes=20_001, largest_unit_bytes=1_000)) == 21
    assert units_of(None) == 1
    assert units_of(dataclasses.replace(MODEL, largest_unit_bytes=0)) == 1


def _mixed(gbs: float):
    """Two large devices (each holds a replica) on n0, two small ones (they do not) on n1."""
    big, small = (dataclasses.replace(k, emulated=False) for k in (BIG, SMALL))
    inventory, profiles = cluster([[big, big], [small, small]], links=(link(0, 1, gbs),))
    return inventory, with_model(profiles)


def _plans(gbs: float):
    inventory, profiles = _mixed(gbs)
    return [make_plan(inventory, profiles, JobSpec(global_batch=1024, engine=e)) for e in (None, Engine.DDP, Engine.FSDP)]


def test_auto_keeps_ddp_on_the_large_devices_where_sharding_over_all_is_predicted_slower():
    """Over a slow link between the nodes, gathering every unit each step costs more than the small
    devices add: auto plans what --engine ddp plans (the large devices alone), not what fsdp plans."""
    auto, ddp, fsdp = _plans(0.001)
    assert [(r.node, r.device) for r in ddp.workers] == [("n0", "gpu0"), ("n0", "gpu1")]
    assert len(fsdp.workers) == 4 and ddp.predicted_samples_per_s["allreduce"] > fsdp.predicted_samples_per_s["allreduce"]
    assert auto.workers == ddp.workers and [g.engine for g in auto.groups] == [Engine.DDP]
    assert auto.predicted_samples_per_s == ddp.predicted_samples_per_s
    assert "not used: gpu0@n1 (holds no DDP replica; the plan without it was predicted faster)" in auto.reason
    assert "; engine by cost: ddp on 2 device(s)" in auto.reason and "chosen over fsdp on 4 device(s)" in auto.reason


def test_auto_shards_over_every_device_where_that_is_predicted_faster():
    auto, ddp, fsdp = _plans(10.0)
    assert fsdp.predicted_samples_per_s["allreduce"] > 1.01 * ddp.predicted_samples_per_s["allreduce"]
    assert auto.workers == fsdp.workers and [g.engine for g in auto.groups] == [Engine.FSDP]
    assert auto.predicted_samples_per_s == fsdp.predicted_samples_per_s
    assert "; engine by cost: fsdp on 4 device(s)" in auto.reason and "chosen over ddp on 2 device(s)" in auto.reason


def test_a_measured_ddp_step_prices_each_collective_of_a_sharded_update():
    """Four emulated devices of one node whose DDP step the bench measured: what the measurement holds
    beyond its ring's bytes is paid per collective, three for one unit's update (two gathers and a
    reduce-scatter) against DDP's one bucket; the bytes are the sharded traffic's."""
    emu = dataclasses.replace(GPU, emulated=True)
    inventory, profiles = cluster([[emu] * 4], model=ModelSpec("m", 1_000_000))
    sync = GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.03, seconds=measured(0.020))
    profiles = dataclasses.replace(profiles, devices=tuple(dataclasses.replace(p, group_sync=sync)
                                                           for p in profiles.devices))
    seconds = {e: 256 / make_plan(inventory, profiles, JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256,
                                                               engine=e)).predicted_samples_per_s["allreduce"]
               for e in (Engine.DDP, Engine.FSDP)}
    bw = Network(["n0"], profiles.links).link(0, 0)[0]
    fixed = 0.020 - 1.5 * 4e6 / bw
    assert seconds[Engine.FSDP] - seconds[Engine.DDP] == pytest.approx(2 * fixed + 0.75 * 4e6 / bw, rel=1e-6)
