"""Cluster files, hostfiles and Slurm lists -> Cluster; every bad input names file:LINE and the key."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgcli.config.cluster import (
    DEFAULT_EMULATION, cluster_from_slurm, sized_to_cores, default_cluster, load_cluster, load_hostfile, load_node_source,
)
from hgcli.errors import EXIT_USAGE, ConfigError
from hgcli.schema.stages import EmulateSpec, HostKeyPolicy
from hgcli.config.nodelists import expand_nodelist
from hgcli.config.tomllines import TomlLines

ROOT_DIR = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_user_ssh_config(tmp_path, monkeypatch):
    """The user's own ~/.ssh/config must not leak into these tests."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    return home


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    os.chmod(path, mode)
    return path


FULL = """
    # every key once
    [ssh]
    known_hosts = "keys/known_hosts"
    strict_host_key_checking = "accept-new"
    connect_timeout = 7.5
    config = "ssh_config"

    [defaults]
    user = "alice"
    python = "/opt/venv/bin/python"
    identity_file = "keys/id_ed25519"

    [[nodes]]
    host = "10.0.0.1"
    name = "a100-box"
    port = 2222
    gpus = [0, 2]

    [[nodes]]
    host = "workstation"
    user = "bob"
    emulate = { devices = ["NVIDIA A100-SXM4-40GB", "Tesla T4"], speed = [1.0, 0.25], memory_mib = [40960, 15360] }

    [[nodes]]
    host = "localhost"
    name = "local"
    """


def test_full_file(tmp_path):
    path = write(tmp_path / "cluster.toml", FULL)
    cluster = load_cluster(path)
    assert cluster.source == str(path)
    assert cluster.ssh.strict_host_key_checking is HostKeyPolicy.ACCEPT_NEW
    assert cluster.ssh.connect_timeout == 7.5
    # Paths are relative to the cluster file, not to the current directory.
    assert cluster.ssh.known_hosts == str(tmp_path / "keys" / "known_hosts")
    assert cluster.ssh.config == str(tmp_path / "ssh_config")
    a, ws, local = cluster.nodes
    assert (a.name, a.host, a.port, a.user, a.gpus) == ("a100-box", "10.0.0.1", 2222, "alice", (0, 2))
    assert a.python == "/opt/venv/bin/python"
    assert a.identity_file == str(tmp_path / "keys" / "id_ed25519")
    assert a.source == f"{path}:13"
    assert (ws.name, ws.user, ws.gpus) == ("workstation", "bob", None)      # name defaults to host
    assert ws.emulate == EmulateSpec(devices=("NVIDIA A100-SXM4-40GB", "Tesla T4"), speed=(1.0, 0.25),
                                     memory_mib=(40960, 15360))
    assert local.is_local and local.port == 22


def test_emulate_as_subtable_and_defaults(tmp_path):
    path = write(tmp_path / "c.toml", """
        [defaults]
        gpus = [1]
        [defaults.emulate]
        devices = ["Tesla T4", "Tesla T4"]
        speed = [0.25, 0.25]
        memory_mib = [15360, 15360]

        [[nodes]]
        host = "n1"

        [[nodes]]
        host = "n2"
        gpus = [0, 1]
        """)
    n1, n2 = load_cluster(path).nodes
    assert n1.emulate == n2.emulate and n1.emulate.devices == ("Tesla T4", "Tesla T4")
    assert n1.gpus == (1,) and n2.gpus == (0, 1)


BAD_FILES = [
    # (text, line, words the message must contain)
    ('[[nodes]]\nhost = "a"\nprot = 22\n', 3, ["unknown key 'prot'", "did you mean 'port'"]),
    ('[shh]\nconfig = "x"\n', 1, ["unknown key 'shh'", "did you mean 'ssh'"]),
    ('[ssh]\nknown_host = "x"\n', 2, ["unknown key 'known_host'", "'known_hosts'"]),
    ('[[nodes]]\nhost = "a"\nzzz = 1\n', 3, ["unknown key 'zzz'", "known keys: host, name"]),
    ('[[nodes]]\nhost = "a"\nemulate = { devices = ["A"], sped = [1.0], memory_mib = [1] }\n', 3,
     ["unknown key 'sped'", "did you mean 'speed'"]),
    ('[[nodes]]\nhost = "a"\n\n[[nodes]]\nhost = "b"\nport = "22"\n', 6, ["nodes[1].port", "integer", '"22"']),
    ('[[nodes]]\nhost = "a"\nport = 70000\n', 3, ["nodes[0].port", "1 to 65535", "70000"]),
    ('[[nodes]]\nhost = "a"\ngpus = "0,1"\n', 3, ["nodes[0].gpus", "expected a list"]),
    ('[[nodes]]\nhost = "a"\ngpus = [0, true]\n', 3, ["nodes[0].gpus", "true"]),
    ('[[nodes]]\nhost = "a"\ngpus = [1, 1]\n', 3, ["nodes[0].gpus", "twice"]),
    ('[[nodes]]\nhost = 5\n', 2, ["nodes[0].host", "string"]),
    ('[[nodes]]\nhost = "-oProxyCommand=sh"\n', 2, ["nodes[0].host", "not a host name"]),
    ('[[nodes]]\nhost = "a"\nname = "my node"\n', 3, ["nodes[0].name", "not a valid node name"]),
    # The node agent's own pattern, checked at load: these used to fail later, on the node.
    ('[[nodes]]\nhost = "a"\nname = "-x"\n', 3, ["nodes[0].name", "'-x' is not a valid node name"]),
    ('[[nodes]]\nhost = "a"\nname = "gpu:1"\n', 3, ["nodes[0].name", "'gpu:1'"]),
    ('[[nodes]]\nhost = "a"\nname = "über"\n', 3, ["nodes[0].name", "'über'"]),
    ('[[nodes]]\nhost = "a"\n\n[[nodes]]\nhost = "gpu:1"\n', 4, ["node name 'gpu:1'", "give the node a name"]),
    ('[[nodes]]\nhost = "a"\nuser = ""\n', 3, ["nodes[0].user", "non-empty"]),
    ('[[nodes]]\nhost = "a"\n\n[[nodes]]\nhost = "b"\nname = "a"\n', 4, ["duplicate node name 'a'", ":1"]),
    ('[[nodes]]\nhost = "a"\n\n# second\n[[nodes]]\nname = "b"\n', 5, ["nodes[1]", "missing required key 'host'"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A", "B"]\nspeed = [1.0]\nmemory_mib = [1, 2]\n', 5,
     ["nodes[0].emulate.speed", "has 1 entry for 2 devices"]),
    ('[[nodes]]\nhost = "a"\nemulate = { devices = ["A", "B"], speed = [1.0, 1.0], memory_mib = [1] }\n', 3,
     ["nodes[0].emulate.memory_mib", "has 1 entry for 2 devices"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A"]\nspeed = [0]\nmemory_mib = [1]\n', 5,
     ["nodes[0].emulate.speed", "greater than 0", "got 0"]),
    ('[[nodes]]\nhost = "a"\nemulate = { devices = ["A"], speed = [-1.5], memory_mib = [1] }\n', 3,
     ["emulate.speed", "greater than 0", "-1.5"]),
    ('[[nodes]]\nhost = "a"\nemulate = { devices = ["A"], memory_mib = [1] }\n', 3, ["missing key 'speed'"]),
    ('[[nodes]]\nhost = "a"\nemulate = { devices = [], speed = [], memory_mib = [] }\n', 3,
     ["emulate.devices", "at least one"]),
    ('[[nodes]]\nhost = "a"\ngpus = [2]\nemulate = { devices = ["A"], speed = [1.0], memory_mib = [1] }\n', 3,
     ["nodes[0].gpus", "index 2", "1 emulated devices"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A", "B"]\nspeed = [1.0, 1.0]\nmemory_mib = [1, 2]\n'
     'slowdown = [[2, 10, 4]]\n', 7, ["nodes[0].emulate.slowdown[0]", "device index 2", "0 to 1"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A"]\nspeed = [1.0]\nmemory_mib = [1]\n'
     'slowdown = [[0, 10, 0.5]]\n', 7, ["emulate.slowdown[0]", "FACTOR must be a number >= 1", "0.5"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A"]\nspeed = [1.0]\nmemory_mib = [1]\n'
     'slowdown = [[0, -1, 2]]\n', 7, ["emulate.slowdown[0]", "AFTER_SECONDS must be a number >= 0"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A"]\nspeed = [1.0]\nmemory_mib = [1]\n'
     'slowdown = [0, 10, 2]\n', 7, ["emulate.slowdown[0]", "[DEVICE_INDEX, AFTER_SECONDS, FACTOR]"]),
    ('[[nodes]]\nhost = "a"\n[nodes.emulate]\ndevices = ["A"]\nspeed = [1.0]\nmemory_mib = [1]\n'
     'slowdown = [[true, 10, 2]]\n', 7, ["emulate.slowdown[0]", "[DEVICE_INDEX, AFTER_SECONDS, FACTOR]", "[true, 10, 2]"]),
    ('[ssh]\nstrict_host_key_checking = "maybe"\n[[nodes]]\nhost = "a"\n', 2,
     ["ssh.strict_host_key_checking", "'yes', 'accept-new', 'no'", '"maybe"']),
    ('[ssh]\nstrict_host_key_checking = false\n', 2, ["ssh.strict_host_key_checking", "false"]),
    ('[ssh]\nconnect_timeout = -1\n', 2, ["ssh.connect_timeout", "greater than 0"]),
    ('ssh = 3\n', 1, ["ssh: expected a table"]),
    ('[defaults]\nname = "x"\n', 2, ["'name' cannot be a default"]),
    ('[defaults]\nport = "x"\n', 2, ["defaults.port"]),
    ('nodes = [1, 2]\n', 1, ["nodes[0]", "expected a [[nodes]] table"]),
    ('[ssh]\nconnect_timeout = 5\n', 1, ["no nodes declared"]),
    ('[[nodes]]\nhost = "a"\nport = 22\nport = 23\n', 4, ["TOML syntax error", "line 4"]),
    ('[[nodes]]\nhost = "a\n', 2, ["TOML syntax error"]),
    ('# long arrays do not confuse the line finder\n[[nodes]]\nhost = "a"\n'
     'emulate.devices = [\n  "A",\n  "B",\n]\nemulate.speed = [1.0, 1.0]\nemulate.memory_mib = [1]\n', 9,
     ["nodes[0].emulate.memory_mib", "has 1 entry for 2 devices"]),
]


@pytest.mark.parametrize("text,line,words", BAD_FILES)
def test_bad_file_names_file_line_and_key(tmp_path, text, line, words):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    for word in words:
        assert word in message, message
    assert info.value.exit_code == EXIT_USAGE


def test_world_writable_file_is_refused(tmp_path):
    path = write(tmp_path / "c.toml", '[[nodes]]\nhost = "evil"\n', mode=0o666)
    with pytest.raises(ConfigError, match="world-writable.*chmod go-w"):
        load_cluster(path)
    os.chmod(path, 0o644)
    assert load_cluster(path).nodes[0].host == "evil"


def test_group_writable_or_foreign_cluster_files_and_hostfiles_are_refused(tmp_path):
    """Whoever can write a cluster file or hostfile chooses the hosts and the ``python`` hgtrain runs."""
    path = write(tmp_path / "c.toml", '[[nodes]]\nhost = "evil"\n', mode=0o664)
    with pytest.raises(ConfigError, match="group-writable cluster file.*chmod go-w"):
        load_cluster(path)
    hostfile = write(tmp_path / "hosts", "w1\n", mode=0o660)
    with pytest.raises(ConfigError, match="group-writable hostfile"):
        load_hostfile(hostfile)
    if os.geteuid() == 0:               # only root can give a file away
        os.chmod(path, 0o644)
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError, match=r"cluster file owned by another user \(uid 65534\)"):
            load_cluster(path)


def test_file_in_world_writable_directory_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = write(shared / "c.toml", '[[nodes]]\nhost = "a"\n')
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="world-writable directory"):
        load_cluster(path)
    os.chmod(shared, 0o1777)                       # like /tmp: others cannot replace our file
    assert load_cluster(path).nodes[0].host == "a"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_cluster(tmp_path / "nope.toml")


# ---------------------------------------------------------------------------------------------
# ssh config
# ---------------------------------------------------------------------------------------------

SSH_CONFIG = """
    Host bastion
      HostName 192.0.2.10
      User jumper
      Port 2200
      IdentityFile ~/.ssh/bastion_key

    Host gpu1
      HostName 10.1.0.1
      User trainer
      Port 2022
      IdentityFile ~/.ssh/gpu_key
      ProxyJump bastion

    Host inner
      HostName 10.1.0.9
      ProxyJump gpu1

    Host tunnelled
      HostName 10.1.0.7
      ProxyCommand ssh -W %h:%p bastion

    Host loop1
      ProxyJump loop2
    Host loop2
      ProxyJump loop1
    """


@pytest.fixture
def ssh_config(tmp_path):
    return write(tmp_path / "ssh_config", SSH_CONFIG)


def cluster_with(tmp_path, nodes: str) -> Path:
    return write(tmp_path / "c.toml", '[ssh]\nconfig = "ssh_config"\n\n' + textwrap.dedent(nodes))


def test_ssh_config_alias_is_honoured(tmp_path, ssh_config, no_user_ssh_config):
    node, = load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "gpu1"\n')).nodes
    assert (node.host, node.hostname, node.address, node.port, node.user) == (
        "gpu1", "10.1.0.1", "10.1.0.1", 2022, "trainer")
    assert node.identity_file == str(no_user_ssh_config / ".ssh" / "gpu_key")
    assert node.proxy_jump == "bastion"
    jump = node.jump
    assert (jump.host, jump.hostname, jump.port, jump.user, jump.jump) == (
        "bastion", "192.0.2.10", 2200, "jumper", None)
    assert jump.identity_file == str(no_user_ssh_config / ".ssh" / "bastion_key")


def test_cluster_file_keys_win_over_ssh_config(tmp_path, ssh_config):
    node, = load_cluster(cluster_with(tmp_path, """
        [[nodes]]
        host = "gpu1"
        port = 22
        user = "me"
        identity_file = "/keys/mine"
        proxy_jump = "none"
        """)).nodes
    assert (node.hostname, node.port, node.user, node.identity_file) == ("10.1.0.1", 22, "me", "/keys/mine")
    assert node.proxy_jump is None and node.jump is None


def test_a_host_behind_proxy_command_is_refused_never_reached_directly(tmp_path, ssh_config):
    """ProxyCommand used to be ignored: hgtrain connected to 10.1.0.7 itself, around the bastion."""
    with pytest.raises(ConfigError) as info:
        load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "tunnelled"\n'))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'c.toml'}:4: host 'tunnelled' is reached through ProxyCommand "
                              "'ssh -W 10.1.0.7:22 bastion'"), message
    assert str(ssh_config) in message and "ProxyJump" in message and "proxy_jump" in message
    with pytest.raises(ConfigError, match="host 'tunnelled' is reached through ProxyCommand"):   # as a hop
        load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "a"\nproxy_jump = "tunnelled"\n'))
    # The cluster file's own proxy_jump replaces the ssh config's way there, as ssh -J does.
    node, = load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "tunnelled"\nproxy_jump = "bastion"\n')).nodes
    assert node.jump.host == "bastion" and node.hostname == "10.1.0.7"


def test_defaults_count_as_written_in_the_file(tmp_path, ssh_config):
    path = write(tmp_path / "c.toml", '[ssh]\nconfig = "ssh_config"\n[defaults]\nuser = "ops"\n'
                                      '[[nodes]]\nhost = "gpu1"\n')
    node, = load_cluster(path).nodes
    assert node.user == "ops" and node.port == 2022


def test_proxy_jump_chain_through_aliases(tmp_path, ssh_config):
    # inner -> ProxyJump gpu1, and gpu1 itself sits behind bastion: two hops, each resolved.
    node, = load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "inner"\n')).nodes
    assert node.hostname == "10.1.0.9"
    hop = node.jump
    assert (hop.host, hop.hostname, hop.port, hop.user) == ("gpu1", "10.1.0.1", 2022, "trainer")
    assert (hop.jump.host, hop.jump.hostname, hop.jump.port) == ("bastion", "192.0.2.10", 2200)
    assert hop.jump.jump is None


def test_explicit_proxy_jump_list_with_user_and_port(tmp_path, ssh_config):
    node, = load_cluster(cluster_with(tmp_path, """
        [[nodes]]
        host = "10.9.9.9"
        proxy_jump = "ops@bastion:2222,gpu1"
        """)).nodes
    last = node.jump
    assert last.host == "gpu1" and last.proxy_jump is None          # the list overrides gpu1's own
    first = last.jump
    assert (first.host, first.hostname, first.user, first.port) == ("bastion", "192.0.2.10", "ops", 2222)


def test_proxy_jump_without_ssh_config(tmp_path):
    path = write(tmp_path / "c.toml", '[[nodes]]\nhost = "n"\nproxy_jump = "ssh://u@[2001:db8::1]:2200"\n')
    node, = load_cluster(path).nodes
    assert (node.jump.host, node.jump.user, node.jump.port) == ("2001:db8::1", "u", 2200)


@pytest.mark.parametrize("nodes,words", [
    ('[[nodes]]\nhost = "loop1"\n', ["ProxyJump loops", "loop1 -> loop2 -> loop1"]),
    ('[[nodes]]\nhost = "n"\nproxy_jump = "bastion:99999"\n', ["ProxyJump", "not a port"]),
    ('[[nodes]]\nhost = "n"\nproxy_jump = "a,,b"\n', ["ProxyJump", "not a host name"]),
])
def test_bad_proxy_jump(tmp_path, ssh_config, nodes, words):
    path = cluster_with(tmp_path, nodes)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value).startswith(f"{path}:4: ")
    for word in words:
        assert word in str(info.value)


def test_bad_ssh_config_names_it(tmp_path):
    write(tmp_path / "ssh_config", "Host x\n  Port notaport\n")
    path = cluster_with(tmp_path, '[[nodes]]\nhost = "x"\n')
    with pytest.raises(ConfigError, match=r"ssh_config: host 'x': Port 'notaport'"):
        load_cluster(path)


def test_missing_ssh_config_is_fine_and_paramiko_stays_unimported(tmp_path):
    path = write(tmp_path / "c.toml", '[ssh]\nconfig = "absent"\n[[nodes]]\nhost = "gpu9"\n')
    code = ("import sys; from hgcli.config.cluster import load_cluster; "
            f"c = load_cluster({str(path)!r}); print(c.nodes[0].address, 'paramiko' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}).stdout
    assert out.split() == ["gpu9", "False"]


def test_local_nodes_skip_ssh_config(tmp_path):
    write(tmp_path / "ssh_config", "Host localhost\n  HostName 203.0.113.5\n")
    node, = load_cluster(cluster_with(tmp_path, '[[nodes]]\nhost = "localhost"\n')).nodes
    assert node.is_local and node.hostname is None


# ---------------------------------------------------------------------------------------------
# Hostfiles, Slurm, and choosing the node source
# ---------------------------------------------------------------------------------------------

HOSTFILE = """
    # DeepSpeed-style hostfile
    worker-1 slots=4
    worker-2 slots=2   # the small box

    worker-3
    """


def test_hostfile(tmp_path):
    path = write(tmp_path / "hostfile", HOSTFILE)
    cluster = load_hostfile(path)
    assert [(n.name, n.host, n.slots) for n in cluster.nodes] == [
        ("worker-1", "worker-1", 4), ("worker-2", "worker-2", 2), ("worker-3", "worker-3", None)]
    assert cluster.nodes[1].source == f"{path}:3"
    assert cluster.ssh.strict_host_key_checking is HostKeyPolicy.YES


@pytest.mark.parametrize("text,line,words", [
    ("a slots=4\nb slots=x\n", 2, ["'slots=x'", "host slots=N"]),
    ("a slots=0\n", 1, ["at least 1"]),
    ("a slots=1 slots=2\n", 1, ["twice"]),
    ("a max_slots=8\n", 1, ["'max_slots=8'"]),
    ("a\n# c\na slots=2\n", 3, ["listed twice", "line 1"]),
    ("-oProxyCommand=x\n", 1, ["not a host name"]),
    ("w1\ngpu:1\n", 2, ["node name 'gpu:1'"]),
])
def test_bad_hostfile(tmp_path, text, line, words):
    path = write(tmp_path / "hostfile", text)
    with pytest.raises(ConfigError) as info:
        load_hostfile(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    for word in words:
        assert word in str(info.value)


def test_empty_and_world_writable_hostfiles(tmp_path):
    with pytest.raises(ConfigError, match="lists no hosts"):
        load_hostfile(write(tmp_path / "empty", "# nothing\n\n"))
    with pytest.raises(ConfigError, match="world-writable hostfile"):
        load_hostfile(write(tmp_path / "open", "a\n", mode=0o646))


def test_hostfile_key_in_cluster_file_gets_defaults(tmp_path):
    write(tmp_path / "hosts", "w1 slots=2\n")
    path = write(tmp_path / "c.toml", 'hostfile = "hosts"\n[defaults]\nuser = "u"\n[[nodes]]\nhost = "w2"\n')
    assert [(n.name, n.user, n.slots) for n in load_cluster(path).nodes] == [("w1", "u", 2), ("w2", "u", None)]


def test_hostfile_and_cluster_file_node_clash(tmp_path):
    write(tmp_path / "hosts", "w1\n")
    path = write(tmp_path / "c.toml", 'hostfile = "hosts"\n[[nodes]]\nhost = "w1"\n')
    with pytest.raises(ConfigError, match=r"c.toml:2: duplicate node name 'w1' \(first declared at .*hosts:1\)"):
        load_cluster(path)


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[1-2],b[3]", ["a1", "a2", "b3"]),
    ("node001", ["node001"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x-[1,3]-y", ["x-1-y", "x-3-y"]),
])
def test_slurm_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    cluster = cluster_from_slurm(nodelist)
    assert [n.host for n in cluster.nodes] == hosts and cluster.source == "SLURM_JOB_NODELIST"


@pytest.mark.parametrize("nodelist,words", [
    ("gpu[1-3", "without ']'"), ("gpu1-3]", "without '['"), ("gpu[3-1]", "backwards"),
    ("gpu[a-b]", "cannot read range"), ("", "empty"), ("a,,b", "empty host"), ("a[1-2],a1", "listed twice"),
    ("a[[1]]", "nested"), ("a[1-99999999]", "too large"), ("a[1-1000]b[1-1000]", "more than"),
])
def test_bad_slurm_nodelist(nodelist, words):
    with pytest.raises(ConfigError) as info:
        cluster_from_slurm(nodelist)
    assert str(info.value).startswith("SLURM_JOB_NODELIST: ") and words in str(info.value)


def test_slurm_nodelist_is_counted_before_it_is_expanded():
    """A short list that names astronomically many hosts is refused at once, not after building
    them (40 ranges of 100,000 took 0.8 s and 305 MB before; three brackets of them would never end)."""
    import time

    ranges = ",".join(f"{i * 100000}-{i * 100000 + 99999}" for i in range(40))
    started = time.monotonic()
    for nodelist in (f"n[{ranges}]", f"r[{ranges}]c[{ranges}]n[{ranges}]"):
        with pytest.raises(ConfigError, match=r"^SLURM_JOB_NODELIST: .* expands to more than 100000 hosts$"):
            expand_nodelist(nodelist)
    assert time.monotonic() - started < 0.5
    with pytest.raises(ConfigError, match="numbers too long"):   # int() would raise ValueError
        expand_nodelist("a[1-" + "9" * 5000 + "]")


def test_slurm_nodelist_cap_is_on_the_whole_list():
    with pytest.raises(ConfigError, match=r"^SLURM_JOB_NODELIST: the node list expands to more than 100000 hosts"):
        expand_nodelist("a[0-99999],b[0-99999],c[0-99999]")
    assert len(expand_nodelist("a[0-49999],b[0-49999]")) == 100_000

def test_node_source_choice(tmp_path):
    settings = write(tmp_path / "settings.toml", '[ssh]\nconnect_timeout = 3\n[defaults]\nuser = "u"\n')
    hosts = write(tmp_path / "hosts", "h1\nh2\n")
    full = write(tmp_path / "full.toml", '[[nodes]]\nhost = "f1"\n')
    slurm = {"SLURM_JOB_NODELIST": "s[1-2]"}

    assert load_node_source(environ={}) == default_cluster()
    assert [n.host for n in load_node_source(environ=slurm).nodes] == ["s1", "s2"]
    assert [n.host for n in load_node_source(full, environ=slurm).nodes] == ["f1"]   # the file wins
    from_hosts = load_node_source(settings, hostfile=hosts, environ=slurm)
    assert [(n.host, n.user) for n in from_hosts.nodes] == [("h1", "u"), ("h2", "u")]
    assert from_hosts.ssh.connect_timeout == 3.0
    from_slurm = load_node_source(settings, environ=slurm)
    assert [(n.host, n.user) for n in from_slurm.nodes] == [("s1", "u"), ("s2", "u")]
    with pytest.raises(ConfigError, match="declares nodes, so a hostfile cannot add more"):
        load_node_source(full, hostfile=hosts, environ={})
    with pytest.raises(ConfigError, match="settings.toml: no nodes declared"):
        load_node_source(settings, environ={})


def test_default_cluster_emulates_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    node, = default_cluster().nodes
    assert node.is_local and node.emulate == sized_to_cores(DEFAULT_EMULATION)
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert default_cluster().nodes[0].emulate is None


def test_the_embedded_clusters_devices_ask_at_most_half_the_cores():
    # Speed s computes s of each step on the CPU: the default set asks 2.5 cores at its declared speeds.
    assert sized_to_cores(DEFAULT_EMULATION, cores=2).speed == (0.4, 0.4, 0.1, 0.1)
    assert sized_to_cores(DEFAULT_EMULATION, cores=4).speed == (0.8, 0.8, 0.2, 0.2)
    assert sized_to_cores(DEFAULT_EMULATION, cores=8) == DEFAULT_EMULATION
    two = replace(DEFAULT_EMULATION, devices=DEFAULT_EMULATION.devices[:2], speed=(1.0, 1.0),
                  memory_mib=DEFAULT_EMULATION.memory_mib[:2])
    assert sized_to_cores(two, cores=2).speed == (0.5, 0.5) and sized_to_cores(two, cores=2).devices == two.devices


def test_nproc_per_node_sizes_the_embedded_cluster_and_slurm_nodes_only(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))            # no nvidia-smi: N identical emulated devices
    node, = load_node_source(environ={}, nproc_per_node=2).nodes
    assert node.emulate is not None and node.gpus is None
    assert node.emulate.devices == (DEFAULT_EMULATION.devices[0],) * 2
    assert node.emulate.speed == sized_to_cores(replace(DEFAULT_EMULATION, speed=(1.0, 1.0))).speed
    assert node.emulate.memory_mib == (DEFAULT_EMULATION.memory_mib[0],) * 2
    assert default_cluster(2).fingerprint() not in (default_cluster().fingerprint(), default_cluster(3).fingerprint())
    fake = tmp_path / "nvidia-smi"                         # GPUs: the first N of them
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    node, = default_cluster(3).nodes
    assert node.emulate is None and node.gpus == (0, 1, 2)
    full = write(tmp_path / "full.toml", '[[nodes]]\nhost = "f1"\n')
    hosts = write(tmp_path / "hosts", "h1\n")
    for kwargs in ({"cluster_file": full}, {"hostfile": hosts}):
        with pytest.raises(ConfigError, match="nproc_per_node sizes the embedded local cluster and a Slurm"):
            load_node_source(**{"environ": {}, **kwargs}, nproc_per_node=2)
    with pytest.raises(ConfigError, match="declares nodes, so nproc_per_node cannot size them"):
        load_node_source(full, environ={"SLURM_JOB_NODELIST": "s1"}, nproc_per_node=2)
    # Every node of a Slurm allocation gets N devices (GPUs here: nvidia-smi is on PATH), unless
    # [defaults] declares them.
    slurm = load_node_source(environ={"SLURM_JOB_NODELIST": "s[1-2]"}, nproc_per_node=2)
    assert [(n.host, n.gpus, n.emulate) for n in slurm.nodes] == [("s1", (0, 1), None), ("s2", (0, 1), None)]
    declared = write(tmp_path / "defaults.toml", "[defaults]\ngpus = [3]\n")
    slurm = load_node_source(declared, environ={"SLURM_JOB_NODELIST": "s1"}, nproc_per_node=2)
    assert slurm.nodes[0].gpus == (3,)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

def test_toml_lines_map_paths():
    lines = TomlLines('a = 1\n[t]\nk = """x\ny = 2\n"""\nz = 3\n[[arr]]\nq = 1\n[[arr]]\nq = 2\n[arr.sub]\nw = 4\n')
    assert lines.line(("t",)) == 2 and lines.line(("t", "z")) == 6   # "y = 2" was inside a string
    assert lines.line(("arr", 1, "q")) == 10 and lines.line(("arr", 1, "sub", "w")) == 12
    assert lines.line(("missing",)) == 1


_piece = st.tuples(
    st.from_regex(r"[a-z][a-z0-9-]{0,3}", fullmatch=True),
    st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(1, 3)), min_size=0, max_size=3),
)


@given(st.lists(_piece, min_size=1, max_size=4, unique_by=lambda p: p[0]))
def test_slurm_expansion_matches_a_reference(pieces):
    """Compress known hosts into bracket syntax; expanding it gives them back, in order."""
    parts, expected = [], []
    for prefix, ranges in pieces:
        if not ranges:
            parts.append(prefix)
            expected.append(prefix)
            continue
        body, numbers = [], []
        for lo, span, width in ranges:
            hi = lo + span
            body.append(f"{lo:0{width}d}" + (f"-{hi:0{width}d}" if span else ""))
            numbers.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
        parts.append(f"{prefix}[{','.join(body)}]")
        expected.extend(prefix + n for n in numbers)
    if len(set(expected)) != len(expected):
        with pytest.raises(ConfigError, match="listed twice"):
            expand_nodelist(",".join(parts))
    else:
        assert expand_nodelist(",".join(parts)) == expected


_keys = st.sampled_from(["host", "name", "port", "user", "gpus", "emulate", "python", "identity_file",
                         "proxy_jump", "devices", "speed", "memory_mib", "strict_host_key_checking",
                         "connect_timeout", "hostfile", "bogus"])
_values = st.sampled_from(['"a"', '"-x"', "1", "0", "-1", "1.5", "true", "[0, 1]", "[1, 1]", '["A"]', "[0.0]",
                           '{ devices = ["A"], speed = [1.0], memory_mib = [1] }', "{}", '"yes"', '"none"',
                           '"a,,b"', "1979-05-27", '"x:99999"'])
_line = st.one_of(
    st.builds(lambda k, v: f"{k} = {v}", _keys, _values),
    st.sampled_from(["[[nodes]]", "[ssh]", "[defaults]", "[nodes.emulate]", "[defaults.emulate]", "[x]", ""]),
    st.text(max_size=20),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_line, max_size=12))
def test_arbitrary_files_fail_only_with_config_error(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text("\n".join(lines), encoding="utf-8")
        try:
            cluster = load_cluster(path)
        except ConfigError as exc:
            assert str(exc).startswith(str(path) + ":"), exc   # file:LINE, always
        else:
            assert cluster.nodes


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab01-[],", max_size=16))
def test_arbitrary_nodelists_fail_only_with_config_error(text):
    try:
        hosts = expand_nodelist(text)
    except ConfigError:
        return
    assert hosts and all(h and "[" not in h and "," not in h for h in hosts)


def test_example_file_loads_and_docs_cover_every_key():
    from hgcli.config.checks import EMULATE_KEYS
    from hgcli.config.clusterfile import NODE_KEYS, ROOT_KEYS, SSH_KEYS

    example = ROOT_DIR / "cluster.example.toml"
    cluster = load_cluster(example)
    assert [n.name for n in cluster.nodes] == ["a100", "workstation.lab", "laptop"]
    assert cluster.nodes[2].emulate is not None
    example_text = example.read_text()
    reference = (ROOT_DIR / "docs" / "cluster-file.md").read_text()
    for key in ROOT_KEYS + SSH_KEYS + NODE_KEYS + EMULATE_KEYS:
        assert key in example_text, key
        assert f"`{key}`" in reference or f"`[{key}]`" in reference or f"`[[{key}]]`" in reference, key


def test_deep_nesting_huge_slot_counts_and_device_floods_are_one_line_refusals(tmp_path):
    """Untrusted input files: a TOML array nested 100,000 levels, a hostfile 'slots=' of 5000 digits
    and an emulate table of 200,000 devices each give one ConfigError (exit 2) naming the file,
    not a RecursionError, ValueError or a probe that fails with 'Argument list too long'."""
    deep = write(tmp_path / "deep.toml", '[[nodes]]\nhost = "a"\nx = ' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply") as info:
        load_cluster(deep)
    assert str(deep) in str(info.value) and info.value.exit_code == EXIT_USAGE
    hosts = write(tmp_path / "hosts", "node1 slots=" + "9" * 5000 + "\n")
    cfg = write(tmp_path / "h.toml", f'hostfile = "{hosts}"\n')
    with pytest.raises(ConfigError, match=r"hosts:1: slots=9{12}\.\.\. is more than 1024 slots") as info:
        load_cluster(cfg)
    assert len(str(info.value)) < 200
    write(hosts, "node1 slots=2000\n")
    with pytest.raises(ConfigError, match="slots=2000 is more than 1024 slots"):
        load_cluster(cfg)
    n = 200_000
    flood = write(tmp_path / "flood.toml", '[[nodes]]\nhost = "localhost"\nemulate = { devices = ['
                  + ", ".join(['"T4"'] * n) + "], speed = [" + ", ".join(["1.0"] * n) + "], memory_mib = ["
                  + ", ".join(["100"] * n) + "] }\n")
    with pytest.raises(ConfigError, match="200000 devices, more than the 1024 one node may emulate") as info:
        load_cluster(flood)
    assert info.value.exit_code == EXIT_USAGE


@pytest.mark.parametrize("body, says", [
    ('[ssh]\nconnect_timeout = 1{z}\n[[nodes]]\nhost = "a"\n', "2: ssh.connect_timeout: expected a number greater than 0, got a number of 401 digits"),
    ('[[nodes]]\nhost = "a"\nemulate = {{ devices = ["x"], speed = [1{z}], memory_mib = [100] }}\n',
     "3: nodes[0].emulate.speed: expected a number greater than 0, got a number of 401 digits"),
    ('[[nodes]]\nhost = "a"\nemulate = {{ devices = ["x"], speed = [1.0], memory_mib = [100], slowdown = [[0, 1{z}, 2]] }}\n',
     "3: nodes[0].emulate.slowdown[0]: AFTER_SECONDS must be a number >= 0, got a number of 401 digits"),
    ('[[nodes]]\nhost = "a"\nslots = 1{zz}\n', "3: a number of more than 4,300 digits"),
])
def test_numbers_no_float_holds_are_one_line_refusals(tmp_path, body, says):
    """The audit's finds: 400-digit integers in connect_timeout, an emulated speed or a slowdown were an
    OverflowError (exit 1), and 5,001 digits hit Python's int() limit (ValueError)."""
    path = write(tmp_path / "c.toml", body.format(z="0" * 400, zz="0" * 5001))
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value) == f"{path}:{says}" and info.value.exit_code == EXIT_USAGE
