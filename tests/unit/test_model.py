"""The JSON contract between stages: every value round-trips, and bad shapes are clear errors."""
import json

import pytest

from hgcli.schema.stages import (
    Cluster, Device, EmulateSpec, GpuInfo, GroupPlan, HostKeyPolicy, Ideal, Inventory, NodeInfo, NodeSpec, Plan,
    RankPlan, Role, SshSettings, Strategy, Wire, from_dict, to_dict,
)
from hgcli.node import frames


def sample_plan() -> Plan:
    return Plan(
        strategy=Strategy.HYBRID, world_size=3,
        groups=(GroupPlan(id=0, ranks=(0, 1)),),
        ranks=(RankPlan(0, Role.WORKER, "a", "gpu0", 0, 32), RankPlan(1, Role.WORKER, "a", "gpu1", 0, 32),
               RankPlan(2, Role.PS, "a", "cpu")),
        predicted_samples_per_s={"allreduce": 1.0, "hybrid": 2.0, "ps": 0.5, "ideal": 2.5},
        global_batch=64, cluster="abc", ps_shards=(2,),
    )


def test_plan_round_trips_through_json():
    plan = sample_plan()
    again = from_dict(Plan, json.loads(json.dumps(to_dict(plan))))
    assert again == plan
    assert to_dict(plan)["ranks"][2]["role"] == "ps"
    assert to_dict(plan)["ranks"][2]["group"] is None


def test_inventory_round_trips_and_splits_failed_nodes():
    inv = Inventory(cluster="x", nodes=(
        NodeInfo("a", "h1", True, gpus=(GpuInfo(0, "Tesla T4", emulated=True, speed=0.25),)),
        NodeInfo("b", "h2", False, error="connection refused"),
    ))
    assert from_dict(Inventory, to_dict(inv)) == inv
    assert [n.name for n in inv.failed] == ["b"]
    assert [n.name for n in inv.succeeded] == ["a"]


def test_cluster_fingerprint_changes_with_nodes():
    a = Cluster(nodes=(NodeSpec("n1", "h1"),), ssh=SshSettings(strict_host_key_checking=HostKeyPolicy.NO))
    b = Cluster(nodes=(NodeSpec("n1", "h1", emulate=EmulateSpec(("X",), (1.0,), (100,))),))
    assert a.fingerprint() != b.fingerprint()
    assert from_dict(Cluster, to_dict(a)) == a


@pytest.mark.parametrize("bad, message", [
    ({"strategy": "fastest"}, "is not one of"),
    ({"world_size": "3"}, "expected an integer"),
    ({"ranks": None}, "expected a list"),
    ({"reason": None}, "expected str"),
    ({"wire": "fp8"}, "is not one of 'fp32', 'bf16'"),
    ({"predicted_samples_per_s": {"fastest": 1.0}}, "predicted_samples_per_s key 'fastest'"),
    ({"ranks": [{"rank": 0, "role": "worker", "node": "a", "device": "gpuX"}]}, "device must be gpuN"),
])
def test_bad_plan_shapes_are_named(bad, message):
    data = {**to_dict(sample_plan()), **bad}
    with pytest.raises(ValueError, match=message):
        from_dict(Plan, data)


def test_frames_skip_login_noise():
    line = frames.encode({"type": "probe", "ok": True})
    assert frames.decode("Welcome to Ubuntu\n") is None
    assert frames.decode("motd" + line) == {"type": "probe", "ok": True}
    assert frames.decode(frames.MARKER + "{broken") is None


def test_fanout_reports_every_node_and_keeps_order():
    from hgcli.errors import RemoteError
    from hgcli.remote.fanout import fanout

    nodes = [NodeSpec(f"n{i}", f"h{i}") for i in range(5)]

    def fn(node):
        if node.name == "n2":
            raise RemoteError(node.host, "connection refused")
        return node.name.upper()

    result = fanout(nodes, fn, max_parallel=2)
    assert [r.node.name for r in result.results] == [n.name for n in nodes]
    assert [r.value for r in result.succeeded] == ["N0", "N1", "N3", "N4"]
    assert [(r.node.name, r.error) for r in result.failed] == [("n2", "connection refused")]


def test_local_transport_runs_node_module():
    from hgcli.remote.local import LocalTransport
    from hgcli.remote.transport import node_module_argv

    t = LocalTransport(NodeSpec("local", "localhost"))
    argv, env = node_module_argv(t, "frames")
    done = t.run(argv, env=env, timeout=30)
    assert done.exit_code == 0


def test_a_plan_file_of_an_older_version_reads_into_typed_values_and_writes_back_the_same_json():
    """Plan files keep their JSON: strategy names and "ideal" as keys, devices and the wire format as
    strings; read, they are members and values, and the stage value is frozen all the way down."""
    stored = {**to_dict(sample_plan()), "wire": "bf16", "predicted_group_samples_per_s": {"0": 2.0}}
    del stored["overlap"], stored["fitted_to"]            # written before these existed
    text = json.dumps(stored)
    plan = from_dict(Plan, json.loads(text))
    assert plan.wire is Wire.BF16 and plan.wire.bytes == 2
    assert plan.predicted(Strategy.HYBRID) == 2.0 and plan.predicted() == 2.0 and plan.ideal_samples_per_s == 2.5
    assert set(plan.predicted_samples_per_s) == {Strategy.ALLREDUCE, Strategy.HYBRID, Strategy.PS, Ideal.IDEAL}
    assert all(type(k) in (Strategy, Ideal) for k in plan.predicted_samples_per_s)
    assert [type(r.device) for r in plan.ranks] == [Device] * 3
    assert [(r.device.gpu_index, r.device.is_gpu) for r in plan.ranks] == [(0, True), (1, True), (None, False)]
    with pytest.raises(TypeError):
        plan.predicted_samples_per_s[Strategy.PS] = 9.0    # type: ignore[index]
    written = to_dict(plan)
    assert written == {**stored, "overlap": False, "fitted_to": None}
    assert json.dumps(written["predicted_samples_per_s"]) == json.dumps(stored["predicted_samples_per_s"])


def test_stage_values_made_in_code_are_typed_once_on_construction():
    plan = sample_plan()   # built with plain strings, as hand-made plans and older callers do
    assert plan.ranks[0].device == "gpu0" and isinstance(plan.ranks[0].device, Device)
    assert all(type(k) in (Strategy, Ideal) for k in plan.predicted_samples_per_s)
    assert Plan(**{**plan.__dict__, "wire": "bf16"}).wire is Wire.BF16
    with pytest.raises(ValueError, match="wire format must be one of fp32, bf16, got 'fp8'"):
        Wire("fp8")
    with pytest.raises(ValueError, match="device must be gpuN"):
        Device("gpu")
