"""``hgtrain probe`` against real sshd test hosts with fake nvidia-smi scenarios.

Depends on the node probe (hgcli/node/probe.py) and the fake nvidia-smi (tests/fakes/nvidia-smi)
from the config/probe branch for the GPU contents it asserts.
"""
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hgcli.schema.stages import Cluster, EmulateSpec
from hgcli.probe.inventory import inventory_path, load_inventory, probe_cluster
from tests.conftest import require_sshd
from tests.sshhosts import REPO, start_hosts
from tests.strictjson import loads as strict_json

pytestmark = pytest.mark.sshd

# One scenario per host; None = no nvidia-smi on that host (a CPU-only node).
SCENARIOS = ["a100x2", "mixed", None, "exit9", "exit18", "garbage", "na-fields"]
NOISE_OUT = 'Welcome to node1! {"type": "probe"} \x1ehgtrain not-json'
NOISE_ERR = "bash: warning: setlocale: LC_ALL: cannot change locale"
EMULATE = EmulateSpec(devices=("NVIDIA A100-SXM4-40GB", "Tesla T4"), speed=(1.0, 0.25), memory_mib=(40960, 15360))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    require_sshd()
    hosts = start_hosts(tmp_path_factory.mktemp("probe-hosts"), len(SCENARIOS))
    try:
        for host, scenario in zip(hosts, SCENARIOS):
            host.set_gpus(scenario)
        hosts[0].set_rc_noise(NOISE_OUT, NOISE_ERR)   # login-shell noise on stdout and stderr
        yield hosts
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()


@pytest.fixture(scope="module")
def cluster(hosts) -> Cluster:
    emulated = hosts.nodes([hosts[2]])[0]
    emulated = dataclasses.replace(emulated, name="emu", emulate=EMULATE)
    return Cluster(nodes=(*hosts.nodes(), emulated), ssh=hosts.ssh_settings())


@pytest.fixture(scope="module")
def inventory(cluster):
    return probe_cluster(cluster)


def by_name(inventory):
    return {n.name: n for n in inventory.nodes}


def test_gpu_models_per_node(inventory):
    nodes = by_name(inventory)
    a100 = nodes["host1"]
    assert a100.ok, a100.error
    assert [g.index for g in a100.gpus] == [0, 1]
    assert all("A100" in g.name and g.memory_total_mib for g in a100.gpus)
    mixed = nodes["host2"]
    assert mixed.ok, mixed.error
    assert len({g.name for g in mixed.gpus}) >= 2
    assert not any(g.emulated for g in a100.gpus + mixed.gpus)


def test_node_runs_its_own_python_not_the_controllers(inventory):
    # The test hosts' PATH leads to /usr/bin/python3, which has neither hgcli nor torch: the probe
    # could only run from the shipped package, and must report torch as absent.
    node = by_name(inventory)["host2"]
    expected = subprocess.run(["/usr/bin/python3", "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert node.python_version == expected
    assert node.torch_version is None
    # ... and that its Python can run no plan, saying why
    assert node.runtime.executable == "/usr/bin/python3"
    assert (node.runtime.torch, node.runtime.numpy, node.runtime.why["torch"]) == (False, False, "torch is not installed")


def test_cpu_only_node_is_not_an_error(inventory):
    node = by_name(inventory)["host3"]
    assert node.ok and node.error is None
    assert node.gpus == ()


def test_unsupported_fields_become_null(inventory):
    node = by_name(inventory)["host7"]
    assert node.ok, node.error
    assert node.gpus and any(g.uuid is None or g.compute_capability is None for g in node.gpus)


@pytest.mark.parametrize("name", ["host4", "host5", "host6"])
def test_failing_nvidia_smi_is_that_nodes_error(inventory, name):
    node = by_name(inventory)[name]
    assert not node.ok
    assert node.error and "Traceback" not in node.error
    assert node.gpus == ()


def test_emulated_devices_are_marked(inventory):
    node = by_name(inventory)["emu"]
    assert node.ok and node.emulated
    assert [g.name for g in node.gpus] == list(EMULATE.devices)
    assert all(g.emulated for g in node.gpus)
    assert [g.speed for g in node.gpus] == list(EMULATE.speed)


def test_login_shell_noise_does_not_confuse_probe(inventory):
    node = by_name(inventory)["host1"]
    assert node.ok, node.error
    assert node.name == "host1" and len(node.gpus) == 2


def test_inventory_is_cached_private(hosts):
    cluster = Cluster(nodes=hosts.nodes([hosts[2]]), ssh=hosts.ssh_settings())
    inventory = probe_cluster(cluster)
    path = inventory_path(cluster.fingerprint())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_inventory(cluster) == inventory


def test_elapsed_time_filled(inventory):
    assert all(n.elapsed_s is not None and n.elapsed_s >= 0 for n in inventory.nodes)


def cluster_file(path: Path, hosts, nodes, *, policy: str = "yes", known_hosts: Path | None = None) -> Path:
    lines = ["[ssh]", f'known_hosts = "{known_hosts or hosts.known_hosts}"',
             f'strict_host_key_checking = "{policy}"', "connect_timeout = 30.0", ""]
    for host in nodes:
        lines += ["[[nodes]]", f'name = "{host.name}"', f'host = "{host.address}"', f"port = {host.port}",
                  'user = "root"', f'identity_file = "{hosts.client_key}"', ""]
    path.write_text("\n".join(lines))
    return path


def run_cli(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HGTRAIN_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "hgcli", *args], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL, start_new_session=True)


def test_cli_json_end_to_end_with_failures(hosts, tmp_path):
    path = cluster_file(tmp_path / "cluster.toml", hosts, hosts.hosts)
    proc = run_cli("probe", "--json", "-c", str(path), state_dir=tmp_path / "state")
    assert proc.returncode == 4, proc.stderr
    data = strict_json(proc.stdout)            # only JSON on stdout, even with failed nodes
    nodes = {n["name"]: n for n in data["nodes"]}
    assert list(nodes) == [h.name for h in hosts]
    for node in nodes.values():
        assert {"name", "host", "ok", "error", "emulated", "gpus"} <= set(node)
        for gpu in node["gpus"]:
            assert {"index", "name", "uuid", "memory_total_mib", "compute_capability"} <= set(gpu)
    assert [n for n in nodes if not nodes[n]["ok"]] == ["host4", "host5", "host6"]
    assert all(nodes[n]["error"] is None for n in ("host1", "host2", "host3", "host7"))
    assert "host4" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "state" / "clusters" / data["cluster"] / "inventory.json").exists()


def test_cli_human_output_all_healthy(hosts, tmp_path):
    path = cluster_file(tmp_path / "cluster.toml", hosts, [hosts[0], hosts[2]])
    proc = run_cli("probe", "-c", str(path), state_dir=tmp_path / "state")
    assert proc.returncode == 0, proc.stderr
    assert "host1" in proc.stdout and "A100" in proc.stdout
    assert "CPU only" in proc.stdout
    assert "2/2 node(s) answered" in proc.stdout


def test_cli_accept_new_from_cluster_file(hosts, tmp_path):
    known = tmp_path / "known_hosts"
    path = cluster_file(tmp_path / "cluster.toml", hosts, [hosts[1]], policy="accept-new", known_hosts=known)
    assert run_cli("probe", "--json", "-c", str(path), state_dir=tmp_path / "state").returncode == 0
    assert hosts[1].known_hosts_line in known.read_text()


def test_unreachable_node_does_not_hide_healthy_ones(hosts):
    dead = dataclasses.replace(hosts.nodes([hosts[1]])[0], name="dead", port=1)
    inventory = probe_cluster(Cluster(nodes=(hosts.nodes([hosts[1]])[0], dead),
                                      ssh=dataclasses.replace(hosts.ssh_settings(), connect_timeout=5.0)))
    nodes = by_name(inventory)
    assert nodes["host2"].ok and not nodes["dead"].ok
    assert "refused" in nodes["dead"].error
    assert [n.name for n in inventory.failed] == ["dead"]
