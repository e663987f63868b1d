"""probe -> bench -> plan in one call (`hgtrain plan` on a fresh cluster), and reuse of what is stored.

Real probes and quick benches of this machine through the local transport; which stages ran is read
from the ``on_stage`` events the plan command shows on stderr.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from hgcli import state
from hgcli.cli import main
from hgcli.config.cluster import default_cluster, load_cluster
from hgcli.schema.stages import PLAN_NEEDS, Inventory, JobSpec, NodeInfo, Plan, Profiles, PythonRuntime, Strategy, from_dict, to_dict
from hgcli.errors import NodePythonError
from hgcli.plan.pipeline import (INVENTORY_MAX_AGE_S, inventory_unusable, prepare_plan, profiles_unusable,
                                 refuse_before_bench, refuse_unrunnable, runtime_problems)
from hgcli.bench.profiles import load_profiles, store_profiles
from tests.strictjson import loads as strict_json

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_batch_size_bench(monkeypatch):
    """The benches these tests cause time the default model at one batch size: what is tested is which
    stages run and what is stored or reused, not the step curve (the four quick sizes of the default
    bench, each test's one to three benches, took minutes on a loaded machine). The CLI bench with
    the default sizes is tested in tests/integration/test_bench_local.py."""
    from hgcli.node.bench import modelspec

    monkeypatch.setattr(modelspec, "DEFAULT_SPEC", "example@8")


@pytest.fixture
def one_node(tmp_path):
    """A cluster of this machine's CPU alone: one device bench, no group, together or link bench (the
    embedded cluster's four emulated devices take all of those). Which stages run and what is stored do
    not depend on the cluster; the embedded one is planned in tests/launch/test_launch_training.py."""
    path = tmp_path / "cluster.toml"
    path.write_text('[[nodes]]\nname = "local"\nhost = "localhost"\n')
    return path


class Stages:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, stage: str, message: str) -> None:
        self.events.append((stage, message))

    def said(self, stage: str, start: str) -> bool:
        return any(s == stage and m.startswith(start) for s, m in self.events)


def test_fresh_cluster_in_one_step_then_reuse_then_stale_profiles_rebenched(one_node):
    cluster = load_cluster(one_node)
    first = Stages()
    plan = prepare_plan(cluster, JobSpec(), quick=True, on_stage=first)
    assert first.said("probe", "probing") and first.said("bench", "benching (quick): no stored profiles")
    assert [s for s, _ in first.events][-1] == "plan"
    assert plan.cluster == cluster.fingerprint() and plan.world_size >= 1
    measured_at = load_profiles(cluster.fingerprint()).measured_at

    second = Stages()
    again = prepare_plan(cluster, JobSpec(), quick=True, on_stage=second)
    assert second.said("probe", "using stored inventory") and second.said("bench", "using stored profiles")
    assert not second.said("probe", "probing") and not second.said("bench", "benching")
    assert load_profiles(cluster.fingerprint()).measured_at == measured_at          # not benched again
    assert to_dict(again) == to_dict(plan)

    # The stored profiles were measured under another torch than the one probed now: stale, benched again.
    profiles = load_profiles(cluster.fingerprint())
    first_device = dataclasses.replace(profiles.devices[0], torch_version="1.0.0")
    store_profiles(dataclasses.replace(profiles, devices=(first_device, *profiles.devices[1:])))
    third = Stages()
    prepare_plan(cluster, JobSpec(), quick=True, on_stage=third)
    assert third.said("probe", "using stored inventory")
    assert third.said("bench", "benching (quick): stored profiles are stale")
    assert load_profiles(cluster.fingerprint()).measured_at > measured_at


def test_plan_command_shows_stages_on_stderr_and_only_json_on_stdout(one_node, capsys):
    assert main(["plan", "-c", str(one_node), "--json"]) == 0
    out, err = capsys.readouterr()
    plan = from_dict(Plan, strict_json(out))
    assert plan.cluster == load_cluster(one_node).fingerprint()
    assert err == ""                     # --json: nothing but the plan, stages are human output
    assert main(["plan", "-c", str(one_node)]) == 0
    out, err = capsys.readouterr()
    assert "probe  using stored inventory" in err and "bench  using stored profiles" in err
    assert "plan   allreduce" in err or "plan   hybrid" in err or "plan   ps" in err
    assert "why:" in out


def test_corrupt_stored_profiles_are_benched_again(one_node):
    cluster = load_cluster(one_node)
    prepare_plan(cluster, JobSpec(), quick=True)
    path = state.cluster_dir(cluster.fingerprint()) / "profiles.json"
    path.write_text('{"cluster": 3}')
    stages = Stages()
    prepare_plan(cluster, JobSpec(), quick=True, on_stage=stages)
    assert stages.said("bench", "benching (quick): stored profiles unreadable")
    assert from_dict(Profiles, json.loads(path.read_text())).cluster == cluster.fingerprint()


def test_failed_node_is_refused_with_exit_4_unless_skipped(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    # Node c is on a port where nothing listens: a real refused connection.
    path.write_text('[[nodes]]\nname = "a"\nhost = "localhost"\n\n'
                    '[[nodes]]\nname = "c"\nhost = "127.0.0.1"\nport = 1\n')
    assert main(["plan", "-c", str(path), "--json"]) == 4
    captured = capsys.readouterr()
    assert captured.out == "" and "probe failed on 1 node(s): c (" in captured.err
    assert "--skip-failed" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert main(["plan", "-c", str(path), "--json", "--skip-failed"]) == 0
    plan = from_dict(Plan, strict_json(capsys.readouterr().out))
    assert {r.node for r in plan.ranks} == {"a"} and "c" in plan.reason


EVERYTHING = PythonRuntime("/venv/bin/python", torch=True, gloo=True, rpc=True, numpy=True)
NO_NUMPY = dataclasses.replace(EVERYTHING, numpy=False, why={"numpy": "ModuleNotFoundError: No module named 'numpy'"})


def _inventory(cluster, *, age: float = 0.0, failed: bool = False,
               runtime: PythonRuntime | None = EVERYTHING) -> Inventory:
    nodes = (NodeInfo(name="local", host="localhost", ok=not failed, error="down" if failed else None,
                      runtime=None if failed else runtime),)
    return Inventory(cluster=cluster.fingerprint(), nodes=nodes, probed_at=time.time() - age)


def test_inventory_reuse_rules():
    cluster = default_cluster()
    assert inventory_unusable(None, cluster, skip_failed=False) == "no stored inventory"
    assert inventory_unusable(_inventory(cluster), cluster, skip_failed=False) is None
    assert "old" in inventory_unusable(_inventory(cluster, age=INVENTORY_MAX_AGE_S + 60), cluster, skip_failed=False)
    other = dataclasses.replace(_inventory(cluster), cluster="another")
    assert "of cluster another" in inventory_unusable(other, cluster, skip_failed=False)
    assert "failed nodes: local" in inventory_unusable(_inventory(cluster, failed=True), cluster, skip_failed=False)
    assert inventory_unusable(_inventory(cluster, failed=True), cluster, skip_failed=True) is None
    # Stored by an older hgtrain (no Python checks): reused, unknown refuses nothing. A node lacked a
    # module: probed again, as it may have been installed since; a refusal is always of fresh checks.
    assert inventory_unusable(_inventory(cluster, runtime=None), cluster, skip_failed=False) is None
    lacked = inventory_unusable(_inventory(cluster, runtime=NO_NUMPY), cluster, skip_failed=False)
    assert lacked == "the Python of local lacked modules (installed since?)"


def _plan_on(*nodes: str, ps: bool) -> Plan:
    from hgcli.local.plans import emulated_plan

    if ps:
        return emulated_plan([[1.0], [0.5]], [[8], [4]], n_ps=1, staleness_bound=1, nodes=[[nodes[0]], [nodes[1]]],
                             ps_node=nodes[-1])
    return emulated_plan([[1.0, 0.5]], [[8, 4]], nodes=[list(nodes[:2])])


def _nodes(**runtimes: PythonRuntime | None) -> Inventory:
    return Inventory(cluster="fp", nodes=tuple(NodeInfo(name=n, host=n, ok=True, runtime=r) for n, r in runtimes.items()))


def test_a_plan_is_refused_when_a_ranks_node_lacks_what_the_plan_imports():
    inventory = _nodes(a=EVERYTHING, b=NO_NUMPY, c=None)
    refuse_unrunnable(_plan_on("a", "b", ps=False), inventory)     # all-reduce ranks need no numpy
    refuse_unrunnable(_plan_on("a", "c", "c", ps=True), inventory)   # c: not checked, not refused
    with pytest.raises(NodePythonError) as caught:
        refuse_unrunnable(_plan_on("a", "b", "a", ps=True), inventory)   # b hosts a worker of a PS plan
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert message.startswith("the hybrid plan's ranks cannot run: node b: its Python /venv/bin/python lacks "
                              "numpy, which torch.distributed.rpc needs"), message
    assert "'/venv/bin/python -m pip install numpy' on b" in message and "No module named 'numpy'" in message
    no_torch = PythonRuntime("/usr/bin/python3", torch=False, gloo=False, rpc=False, numpy=False)
    with pytest.raises(NodePythonError, match="node b: its Python /usr/bin/python3 lacks torch"):
        refuse_unrunnable(_plan_on("a", "b", ps=False), _nodes(a=EVERYTHING, b=no_torch))
    assert runtime_problems(_nodes(a=EVERYTHING, b=no_torch), ["a"], PLAN_NEEDS[Strategy.HYBRID]) == []


def test_a_ps_strategy_no_node_can_run_is_refused_before_the_bench():
    nowhere = _nodes(a=NO_NUMPY, b=NO_NUMPY)
    for strategy in (Strategy.HYBRID, Strategy.PS):
        with pytest.raises(NodePythonError) as caught:
            refuse_before_bench(strategy, nowhere)
        message = str(caught.value)
        assert message.startswith(f"the {strategy.value} plan's ranks cannot run: node a: ") and "; node b: " in message
    for strategy in (Strategy.AUTO, Strategy.ALLREDUCE):     # all-reduce ranks need no numpy
        refuse_before_bench(strategy, nowhere)
    # one node can: the plan decides where its ranks go (refuse_unrunnable checks them); unknown is not missing
    refuse_before_bench(Strategy.HYBRID, _nodes(a=EVERYTHING, b=NO_NUMPY))
    refuse_before_bench(Strategy.HYBRID, _nodes(a=None, b=NO_NUMPY))


def test_profiles_with_a_failed_device_are_benched_again_unless_skipped(tmp_path):
    from hgcli.schema.stages import DeviceProfile, GpuInfo

    cluster = default_cluster()
    inventory = Inventory(cluster=cluster.fingerprint(), nodes=(
        NodeInfo(name="local", host="localhost", ok=True, gpus=(GpuInfo(0, "Tesla T4"),)),))
    broken = Profiles(cluster=cluster.fingerprint(), devices=(
        DeviceProfile(node="local", device="gpu0", name="Tesla T4", emulated=True, speed=1.0, memory_total_mib=1,
                      error="out of memory at batch 8"),))
    assert "failed devices: gpu0@local (out of memory" in profiles_unusable(broken, inventory, skip_failed=False)
    assert profiles_unusable(broken, inventory, skip_failed=True) is None
    assert profiles_unusable(None, inventory, skip_failed=False) == "no stored profiles"
