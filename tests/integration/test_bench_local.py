"""hgtrain bench end to end on local nodes: real node processes, real torch, real gloo links.

Remote nodes take the same path through the SSH transport; only open_transport differs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.strictjson import loads as strict_json
from hgcli.bench.cluster import NODE_DEVICE, bench_cluster
from hgcli.cli import main
from hgcli.config.cluster import default_cluster, load_cluster
from hgcli.schema.stages import Inventory, Profiles, from_dict
from hgcli.bench.profiles import load_profiles, profile_is_stale
from tests.bench_inventory import inventory_of, store_inventory

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

CLUSTER_TOML = """
[[nodes]]
name = "a"
host = "localhost"
emulate = { devices = ["Tesla T4", "Tesla T4"], speed = [0.5, 0.5], memory_mib = [15360, 4] }

[[nodes]]
name = "b"
host = "localhost"
"""


@pytest.fixture
def two_nodes(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    cluster = load_cluster(path)
    store_inventory(inventory_of(cluster))
    return path, cluster


def test_cli_bench_json_reports_a_failed_device_and_still_stores_everything(two_nodes, capsys):
    path, cluster = two_nodes
    # mlp: big enough that a step overflows gpu1's 4 MiB (the bundled example's model would fit).
    assert main(["bench", "-c", str(path), "--json", "--quick", "--model", "mlp"]) == 4
    out, err = capsys.readouterr()
    profiles = from_dict(Profiles, strict_json(out))          # stdout is only the JSON
    assert "1 of 3 devices and 0 of 2 links failed" in err
    by_device = {(d.node, d.device): d for d in profiles.devices}
    assert list(by_device) == [("a", "gpu0"), ("a", "gpu1"), ("b", "cpu")]
    oom = by_device["a", "gpu1"]
    assert oom.emulated and oom.error.startswith("out of memory at batch 4")   # the smallest quick size
    for key in (("a", "gpu0"), ("b", "cpu")):
        d = by_device[key]
        assert d.error is None and d.matmul_tflops["fp32"].median > 0 and len(d.steps) == 4   # quick: 4, 16, 64, 256
    assert by_device["a", "gpu0"].emulated and by_device["a", "gpu0"].speed == 0.5
    assert not by_device["b", "cpu"].emulated
    # node a's two emulated devices: their synchronous step measured once, on both profiles
    sync = by_device["a", "gpu0"].group_sync
    assert sync is not None and sync.ranks == 2 and sync.seconds.median >= 0
    assert by_device["a", "gpu1"].group_sync == sync and by_device["b", "cpu"].group_sync is None
    # a<->b between the nodes, then a<->a: node a's two emulated devices exchange through gloo on it
    assert [(link.a, link.b, link.backend, link.error) for link in profiles.links] == [
        ("a", "b", "gloo", None), ("a", "a", "gloo", None)]
    assert all(link.bandwidth_gbs.median > 0 and link.latency_s.median > 0 for link in profiles.links)
    assert profiles.model.name == "mlp" and profiles.model.parameters == 669706
    assert load_profiles(cluster.fingerprint()) == profiles
    assert profile_is_stale(profiles, inventory_of(cluster)) is None


def test_devices_of_a_node_run_in_turn_and_unreachable_nodes_are_listed(two_nodes):
    _, cluster = two_nodes
    inventory = inventory_of(cluster)
    b_down = Inventory(cluster=inventory.cluster, nodes=(
        inventory.nodes[0], from_dict(type(inventory.nodes[1]), {"name": "b", "host": "localhost", "ok": False,
                                                                  "error": "connection refused"})))
    events = []
    profiles = bench_cluster(cluster, b_down, quick=True, model_spec="mlp@8", on_event=events.append)
    a_starts = [e.device for e in events if e.subject == "a" and e.stage == "starting"]
    # Both emulated devices of node a share its CPU: measured once, each derived from that.
    assert len(a_starts) == 1
    gpu0, gpu1 = profiles.devices[:2]
    assert [s.batch_size for s in gpu0.steps] == [8]
    assert gpu0.matmul_tflops == gpu1.matmul_tflops          # same declared speed, same base
    assert gpu1.error.startswith("out of memory at batch 8") and gpu1.memory_total_mib == 4
    node_b = [d for d in profiles.devices if d.node == "b"]
    assert [(d.device, d.error) for d in node_b] == [(NODE_DEVICE, "not probed: connection refused")]
    # no link to a node that is down; node a's own (its two emulated devices) is measured
    assert [(link.a, link.b, link.error) for link in profiles.links] == [("a", "a", None)]


@pytest.mark.timeout(900)   # the suite's one bench of the embedded cluster at every quick size
def test_cli_bench_default_local_cluster_quick(embedded_cluster_benched):
    """``hgtrain probe`` then ``bench --json --quick`` with no cluster file (conftest.py: run once,
    and also the stored profiles of the clean venv's main job)."""
    cluster = default_cluster()
    profiles = from_dict(Profiles, strict_json(embedded_cluster_benched.stdout))
    assert profiles.cluster == cluster.fingerprint()
    assert profiles.model.name == "example"     # the default: what the main job trains
    assert all(d.error is None and d.steps for d in profiles.devices)
    if cluster.nodes[0].emulate is not None:
        assert [d.name for d in profiles.devices] == list(cluster.nodes[0].emulate.devices)
        assert all(d.emulated for d in profiles.devices)
        # and benched together, as the main job trains them (docs/bench.md, "Devices together")
        assert all(d.together is not None and d.together.devices == len(profiles.devices) and d.together.steps
                   for d in profiles.devices)
        # the node's PS exchange, timed once (the embedded cluster declares two speeds) and on every profile
        assert profiles.devices[0].exchange is not None
        assert all(d.exchange == profiles.devices[0].exchange for d in profiles.devices)


# The controller itself must run without torch (a laptop driving remote GPU nodes): block the import
# in the controller process only; node programs are separate processes and import it as they must.
NO_TORCH_CONTROLLER = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the controller")
sys.meta_path.insert(0, NoTorch())
from hgcli.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_cli_bench_human_output_without_torch_in_the_controller(two_nodes):
    """Also the bench of $HGTRAIN_BENCH_MODEL when no --model is given (its refusal of a malformed
    value is tested below): one bench of the cluster serves both."""
    path, cluster = two_nodes
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_CONTROLLER, "bench", "-c", str(path), "--quick"],
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "HGTRAIN_BENCH_MODEL": "mlp@8"})
    assert proc.returncode == 4, proc.stderr
    assert "EMULATED x0.5" in proc.stdout and "out of memory at batch 8" in proc.stdout and "Links" in proc.stdout
    assert "hgtrain: error: 1 of 3 devices" in proc.stderr
    profiles = load_profiles(cluster.fingerprint())
    assert profiles.model is not None and profiles.model.parameters == 669_706     # the mlp, not the example
    assert {tuple(s.batch_size for s in d.steps) for d in profiles.devices if d.error is None} == {(8,)}


def test_malformed_model_spec_is_a_usage_error_before_any_node_runs(two_nodes, capsys):
    path, cluster = two_nodes
    assert main(["bench", "-c", str(path), "--model", "resnet50"]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err
    assert load_profiles(cluster.fingerprint()) is None


def test_hgtrain_bench_model_sets_the_model_when_no_model_is_given(two_nodes, capsys, monkeypatch):
    """$HGTRAIN_BENCH_MODEL is the default --model (and what plan and launch bench with); a
    malformed value is a usage error naming the variable, before any node runs. (A valid value's
    bench is checked in the no-torch controller test above, which benches with it.)"""
    path, cluster = two_nodes
    monkeypatch.setenv("HGTRAIN_BENCH_MODEL", "resnet50")
    assert main(["bench", "-c", str(path), "--quick"]) == 2
    assert "HGTRAIN_BENCH_MODEL: " in capsys.readouterr().err
    assert load_profiles(cluster.fingerprint()) is None
