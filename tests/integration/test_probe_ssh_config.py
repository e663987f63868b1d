"""An ~/.ssh/config alias with ProxyJump, end to end: cluster file -> config merge -> jump -> probe.

The cluster file names only the alias; HostName, Port, User, IdentityFile and the jump host come
from the ssh config, as they do for a user whose GPU nodes sit behind a bastion.
"""
import json
import subprocess
import sys
import time


def test_ssh_config_alias_with_proxyjump_through_a_test_host(make_hosts, tmp_path):
    hosts = make_hosts(2, extra_config={0: ("LogLevel DEBUG1",)})
    jump, target = hosts[0], hosts[1]
    target.set_gpus("a100x2")
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host bastion\n  HostName {jump.address}\n  Port {jump.port}\n  User root\n"
        f"  IdentityFile {hosts.client_key}\n\n"
        f"Host gpu-a\n  HostName {target.address}\n  Port {target.port}\n  User root\n"
        f"  IdentityFile {hosts.client_key}\n  ProxyJump bastion\n")
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'[ssh]\nconfig = "{ssh_config}"\nknown_hosts = "{hosts.known_hosts}"\n\n'
        '[[nodes]]\nhost = "gpu-a"\n')
    cluster.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "hgcli", "probe", "-c", str(cluster), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (node,) = json.loads(done.stdout)["nodes"]
    assert node["name"] == "gpu-a" and node["ok"]
    assert [g["name"] for g in node["gpus"]] == ["NVIDIA A100-SXM4-40GB"] * 2
    # The bastion's sshd really opened the tunnel to the target.
    wanted = f"target {target.address} port {target.port}"
    deadline = time.monotonic() + 10
    while wanted not in jump.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wanted in jump.log.read_text()
