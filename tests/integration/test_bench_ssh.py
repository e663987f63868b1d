"""``hgtrain bench`` against real sshd test hosts (tests/sshhosts.py): emulated devices declared in the
cluster file, the gloo link benchmark between two hosts on distinct loopback addresses, and a host
whose sshd is stopped while its device is being measured.

Everything crosses the SSH transport: the package is shipped to each host's own HOME, the node
programs run from there, the probe runs when no inventory is stored.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hgcli.bench.cluster import BenchEvent, bench_cluster
from hgcli.config.cluster import load_cluster
from hgcli.schema.stages import Profiles, from_dict
from hgcli.probe.inventory import probe_cluster
from hgcli.bench.profiles import load_profiles
from tests.bench_inventory import store_inventory
from tests.sshhosts import REPO, TestHosts

pytestmark = [pytest.mark.sshd, pytest.mark.slow]

SPEC = "mlp@8"
# node name -> (devices, speeds, memory MiB): two speed classes on host1, a third speed on host2.
EMULATE = {
    "host1": (("NVIDIA A100-SXM4-40GB", "Tesla T4"), (1.0, 0.25), (40960, 15360)),
    "host2": (("Tesla V100-SXM2-16GB",), (0.5,), (16384,)),
}


def cluster_file(path: Path, hosts: TestHosts, only: tuple[str, ...] = ()) -> Path:
    """The hosts (``only`` those named, when given) as a cluster file."""
    lines = ["[ssh]", f'known_hosts = "{hosts.known_hosts}"', f'config = "{hosts.root / "no-ssh-config"}"',
             "connect_timeout = 30", ""]
    for h in hosts.hosts:
        if only and h.name not in only:
            continue
        devices, speeds, memory = EMULATE[h.name]
        lines += ["[[nodes]]", f'name = "{h.name}"', f'host = "{h.address}"', f"port = {h.port}",
                  'user = "root"', f'identity_file = "{hosts.client_key}"',
                  # The test hosts' /usr/bin/python3 has no torch (sshhosts.py), so the nodes run the
                  # interpreter of this test process, which has it. The package still comes from
                  # what hgtrain ships: sshd gives sessions no PYTHONPATH of ours.
                  f'python = "{sys.executable}"',
                  f"emulate = {{ devices = {json.dumps(list(devices))}, speed = {list(speeds)}, "
                  f"memory_mib = {list(memory)} }}", ""]
    path.write_text("\n".join(lines))
    return path


def run_bench(path: Path, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HGTRAIN_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "hgcli", "bench", "-c", str(path), "--json", "--quick",
                           "--model", SPEC], capture_output=True, text=True, env=env, timeout=600,
                          stdin=subprocess.DEVNULL, start_new_session=True)


def test_cli_bench_over_ssh_emulated_devices_and_gloo_link(make_hosts, tmp_path):
    hosts = make_hosts(2)
    path = cluster_file(tmp_path / "cluster.toml", hosts)
    proc = run_bench(path, tmp_path / "state")
    assert proc.returncode == 0, proc.stderr
    profiles = from_dict(Profiles, json.loads(proc.stdout))

    by_device = {(d.node, d.device): d for d in profiles.devices}
    assert list(by_device) == [("host1", "gpu0"), ("host1", "gpu1"), ("host2", "gpu0")]
    for (node, device), d in by_device.items():
        index = int(device[3:])
        names, speeds, memory = EMULATE[node]
        assert d.error is None, d.error
        assert d.emulated and (d.name, d.speed, d.memory_total_mib) == (names[index], speeds[index], memory[index])
        assert d.torch_version == torch.__version__          # measured by the python the cluster file named
        assert d.matmul_tflops["fp32"].median > 0 and [s.batch_size for s in d.steps] == [8]

    # host1's CPU is measured once per declared speed (pausing like the emulator at that speed), each
    # measurement scaled by its speed: the rates are in about the declared ratio 1 : 0.25, up to the
    # load the CPU saw during each of the two measurements. The fastest repeats (max rate), because
    # load only ever slows a repeat: the medians once came out 0.081 while host2 benched alongside.
    a100, t4 = by_device["host1", "gpu0"], by_device["host1", "gpu1"]
    assert 0.125 < t4.matmul_tflops["fp32"].max / a100.matmul_tflops["fp32"].max < 0.5
    assert t4.exchange is not None and t4.exchange.service_s.median > 0    # the node's PS push, measured

    # Between the two hosts (distinct loopback addresses), then inside host1, whose two emulated
    # devices exchange through gloo on that host.
    assert [(link.a, link.b, link.backend, link.error) for link in profiles.links] == [
        ("host1", "host2", "gloo", None), ("host1", "host1", "gloo", None)]
    assert all(link.bandwidth_gbs.median > 0 and link.latency_s.median > 0 for link in profiles.links)
    assert profiles.model.name == SPEC and profiles.model.parameters == 669706

    # Stored for plan, and the package really was shipped to each host's own HOME.
    for h in hosts.hosts:
        assert list((h.home / ".cache" / "hgtrain").glob("pkg-*/hgcli/node/bench/main.py"))


def test_sshd_stopped_while_benching_is_that_nodes_error(make_hosts, tmp_path):
    hosts = make_hosts(2)
    cluster = load_cluster(cluster_file(tmp_path / "cluster.toml", hosts))
    inventory = probe_cluster(cluster)
    assert all(n.ok for n in inventory.nodes), [n.error for n in inventory.nodes]

    stopped: list[str] = []

    def on_event(event: BenchEvent) -> None:
        # host2's bench program is running on the node (it reported a stage): kill its sshd and every
        # session under it, bench process included, as a host going down would.
        if event.subject == "host2" and event.stage.startswith("matmul") and not stopped:
            hosts[1].stop()
            stopped.append(event.stage)

    profiles = bench_cluster(cluster, inventory, quick=True, model_spec=SPEC, on_event=on_event)
    assert stopped
    by_device = {(d.node, d.device): d for d in profiles.devices}
    host2 = by_device["host2", "gpu0"]
    assert host2.error and "connection to the node lost" in host2.error and "Traceback" not in host2.error
    for device in ("gpu0", "gpu1"):                   # the other node's profiles are intact
        d = by_device["host1", device]
        assert d.error is None and d.steps and d.matmul_tflops["fp32"].median > 0
    between, inside = profiles.links
    assert between.error and between.error.startswith("host2: connection refused")
    assert (inside.a, inside.b, inside.error) == ("host1", "host1", None)
    assert load_profiles(cluster.fingerprint()) == profiles

    # The CLI, host2 still down, on a cluster of host2 alone (host1's devices are benched above)
    # whose stored inventory is host2's from the probe above: the inventory says host2 was
    # reachable, so bench tries it and reports the connection failure as host2's error, with exit 4.
    alone = load_cluster(cluster_file(tmp_path / "host2.toml", hosts, only=("host2",)))
    store_inventory(dataclasses.replace(inventory, cluster=alone.fingerprint(),
                                        nodes=tuple(n for n in inventory.nodes if n.name == "host2")))
    proc = run_bench(tmp_path / "host2.toml", Path(os.environ["HGTRAIN_STATE_DIR"]))
    assert proc.returncode == 4, proc.stderr
    assert "Traceback" not in proc.stderr and "failed" in proc.stderr
    again = from_dict(Profiles, json.loads(proc.stdout))
    assert [(d.node, d.device) for d in again.devices if d.error] == [("host2", "gpu0")]
    assert f"connection refused by {hosts[1].address}" in again.devices[0].error
