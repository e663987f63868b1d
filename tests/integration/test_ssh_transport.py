"""SshTransport against real sshd test hosts: commands, quoting, shipping, host keys, auth, faults."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hgcli.errors import RemoteError
from hgcli.schema.stages import HostKeyPolicy
from hgcli.remote import ship, ssh
from hgcli.remote.known_hosts import fingerprint
from hgcli.remote.ssh import SshTransport

pytestmark = pytest.mark.sshd

# Bounds for "bounded": generous because the machine is shared; the point is "not forever".
FAST_TIMEOUT = 3.0
BOUND = 60.0


def key_fingerprint(pub_line: str) -> str:
    import base64

    return fingerprint(base64.b64decode(pub_line.split()[1]))


def failure(node, settings) -> str:
    with SshTransport(node, settings) as transport, pytest.raises(RemoteError) as info:
        transport.run(["true"], timeout=30)
    assert info.value.host == node.name
    return info.value.reason


# -- commands -------------------------------------------------------------------------------------

def test_arguments_and_env_reach_the_command_verbatim(make_hosts):
    hosts = make_hosts(1)
    tricky = ["a b", "it's", '"q"', "$HOME", "`id`", "; rm -rf /", "*", "~", "\\n", ""]
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        code = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['HG_X']]))"
        result = t.run(["python3", "-c", code, *tricky], env={"HG_X": "x y $HOME ' \""}, timeout=30)
    assert result.exit_code == 0, result.stderr
    import json

    assert json.loads(result.stdout) == [tricky, "x y $HOME ' \""]


def test_exit_code_stdin_and_stderr(make_hosts):
    hosts = make_hosts(1)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        data = os.urandom(1 << 20).hex().encode()   # 2 MiB: more than one SSH window
        result = t.run(["sh", "-c", "cat; echo oops >&2; exit 3"], stdin=data, timeout=60)
    assert result.exit_code == 3
    assert result.stdout.encode() == data
    assert result.stderr == "oops\n"


def test_an_aead_cipher_is_negotiated_with_openssh(make_hosts):
    """AES-GCM is asked for first (remote/sshconnect.py: no per-packet HMAC in Python); a real sshd agrees."""
    hosts = make_hosts(1)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        assert t.run(["true"], timeout=30).exit_code == 0
        connection = t.connection.transport()
        assert connection.remote_cipher == connection.local_cipher == "aes128-gcm@openssh.com"


def test_stalled_command_times_out(make_hosts):
    hosts = make_hosts(1)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"timed out after 1 s running sleep 60"):
            t.run(["sleep", "60"], timeout=1)
        assert time.monotonic() - start < BOUND
        assert t.run(["echo", "still usable"], timeout=30).stdout == "still usable\n"


def test_node_dying_mid_command_is_reported_not_waited_for(make_hosts):
    hosts = make_hosts(1)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        t.run(["true"], timeout=30)
        killer = threading.Timer(0.5, hosts.stop)
        killer.start()
        start = time.monotonic()
        with pytest.raises(RemoteError, match="connection lost while running sleep"):
            t.run(["sleep", "120"], timeout=100)
        killer.join()
        assert time.monotonic() - start < BOUND


def test_started_process_streams_and_sees_eof_on_close(make_hosts, tmp_path):
    hosts = make_hosts(1)
    marker = tmp_path / "saw-eof"
    script = f"echo ready; read line; echo got $line; cat >/dev/null; touch {marker}"
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        proc = t.start(["sh", "-c", script])
        assert proc.stdout.readline() == b"ready\n"
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"got hello\n"
        with pytest.raises(TimeoutError):
            proc.wait(0.2)
        proc.close()             # drop the channel: the remote command reads EOF and finishes
        deadline = time.monotonic() + BOUND
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert marker.exists()


def test_closing_stdin_ends_the_command_and_wait_returns_its_code(make_hosts):
    hosts = make_hosts(1)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        proc = t.start(["sh", "-c", "cat >/dev/null; exit 7"])
        proc.stdin.close()
        assert proc.wait(BOUND) == 7
        proc.close()


def test_connects_lazily_and_reconnects_after_close(make_hosts):
    hosts = make_hosts(1)
    with socket.socket() as s:
        s.bind((hosts[0].address, 0))
        dead_port = s.getsockname()[1]
    unreachable = SshTransport(hosts.nodes(port=dead_port)[0], hosts.ssh_settings())   # no error yet
    with pytest.raises(RemoteError, match="refused"):
        unreachable.run(["true"], timeout=30)
    unreachable.close()
    t = SshTransport(hosts.nodes()[0], hosts.ssh_settings())
    assert t.run(["true"], timeout=30).exit_code == 0
    t.close()
    assert t.run(["true"], timeout=30).exit_code == 0   # a closed transport connects again
    t.close()


# -- shipping -------------------------------------------------------------------------------------

def test_package_is_shipped_once_and_used(make_hosts, monkeypatch):
    hosts = make_hosts(1)
    host = hosts[0]
    expected = host.home / ".cache" / "hgtrain" / f"pkg-{ship.package_digest()}"
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        root = t.package_root()
        assert root == str(expected)
        assert t.package_root() is root                      # cached per transport
        code = "import hgcli; print(hgcli.__file__)"
        result = t.run(["python3", "-c", code], env={"PYTHONPATH": root}, timeout=30)
    assert result.stdout.strip() == str(expected / "hgcli" / "__init__.py")
    # (The node's python may add __pycache__ when it imports; that is its own business.)
    shipped = sorted(p.relative_to(expected).as_posix() for p in expected.rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    assert shipped == sorted(name for name, _ in ship.package_files())
    assert "hgcli/py.typed" in shipped and "hgcli/remote/ssh.py" in shipped

    # A later session remembers where the package is: no check command, no copy; the node
    # command itself checks the directory (one round trip in all).
    calls = []
    run = ssh.run_command
    monkeypatch.setattr(ssh, "run_command", lambda connection, argv, *a: calls.append(list(argv)) or
                        run(connection, argv, *a))
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t2:
        assert t2.package_root() == str(expected)
        assert calls == []
        result = t2.run(["python3", "-c", code], env={"PYTHONPATH": t2.package_root()}, timeout=30)
        assert result.stdout.strip() == str(expected / "hgcli" / "__init__.py")
        t2.run(["python3", "-c", code], env={"PYTHONPATH": t2.package_root()}, timeout=30)
    assert [c[:2] for c in calls] == [["sh", "-c"], ["python3", "-c"]]   # guarded once per session


def test_remembered_package_removed_from_node_is_shipped_again(make_hosts):
    hosts = make_hosts(1)
    code = "import hgcli; print(hgcli.__file__)"
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        root = Path(t.package_root())
    shutil.rmtree(root)                                   # someone cleared ~/.cache on the node
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        result = t.run(["python3", "-c", code], env={"PYTHONPATH": t.package_root()}, timeout=60)
    assert result.exit_code == 0 and result.stdout.strip() == str(root / "hgcli" / "__init__.py")
    shutil.rmtree(root)
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
        proc = t.start(["python3", "-c", code], env={"PYTHONPATH": t.package_root()})
        assert proc.stdout.readline().decode().strip() == str(root / "hgcli" / "__init__.py")
        assert proc.wait(BOUND) == 0
        proc.close()


def test_concurrent_shippers_end_with_one_complete_copy(make_hosts):
    hosts = make_hosts(1)
    roots, errors = [], []

    def one() -> None:
        try:
            with SshTransport(hosts.nodes()[0], hosts.ssh_settings()) as t:
                roots.append(t.package_root())
        except Exception as exc:   # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(BOUND * 2)
    assert not errors and len(set(roots)) == 1 and len(roots) == 4
    cache = hosts[0].home / ".cache" / "hgtrain"
    assert [p.name for p in cache.iterdir()] == [Path(roots[0]).name]   # no temp dirs left


def test_missing_python_is_named(make_hosts):
    hosts = make_hosts(1)
    node = hosts.nodes(python="python3.nope")[0]
    with SshTransport(node, hosts.ssh_settings()) as t, pytest.raises(RemoteError, match="python3.nope"):
        t.package_root()


# -- host keys ------------------------------------------------------------------------------------

def test_unknown_host_key_refused_under_yes(make_hosts, tmp_path):
    hosts = make_hosts(1)
    host = hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text("# my hosts\n")
    reason = failure(hosts.nodes()[0], hosts.ssh_settings(HostKeyPolicy.YES, known))
    assert "unknown host key" in reason
    assert key_fingerprint(host.host_key_line) in reason
    assert f"ssh-keyscan -p {host.port} {host.address} >> {known}" in reason
    assert "accept-new" in reason
    assert known.read_text() == "# my hosts\n"


def test_fingerprint_matches_ssh_keygen(make_hosts):
    hosts = make_hosts(1)
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(hosts[0].dir / "ssh_host_ed25519_key.pub")],
                         capture_output=True, text=True, check=True).stdout
    assert key_fingerprint(hosts[0].host_key_line) == out.split()[1]


def test_accept_new_adds_key_keeping_other_lines(make_hosts, tmp_path):
    hosts = make_hosts(2)
    known = tmp_path / "ssh" / "known_hosts"
    known.parent.mkdir()
    other = hosts[1].known_hosts_line + "\n"
    known.write_text("# keep me\n" + other.rstrip("\n"))       # no trailing newline on purpose
    known.chmod(0o644)
    node = hosts.nodes()[0]
    with SshTransport(node, hosts.ssh_settings(HostKeyPolicy.ACCEPT_NEW, known)) as t:
        assert t.run(["true"], timeout=30).exit_code == 0
    lines = known.read_text().splitlines()
    assert lines == ["# keep me", other.strip(), hosts[0].known_hosts_line]
    assert lines[-1].startswith(f"[{hosts[0].address}]:{hosts[0].port} ssh-ed25519 ")
    assert known.stat().st_mode & 0o777 == 0o644
    # Now known: the strict policy accepts it, and OpenSSH's own client agrees with the line.
    with SshTransport(node, hosts.ssh_settings(HostKeyPolicy.YES, known)) as t:
        assert t.run(["true"], timeout=30).exit_code == 0
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
           "-i", str(hosts.client_key), "-p", str(hosts[0].port), f"root@{hosts[0].address}", "true"]
    assert subprocess.run(ssh, capture_output=True, timeout=60, stdin=subprocess.DEVNULL).returncode == 0


def test_policy_no_accepts_without_writing(make_hosts, tmp_path):
    hosts = make_hosts(1)
    known = tmp_path / "known_hosts"
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings(HostKeyPolicy.NO, known)) as t:
        assert t.run(["true"], timeout=30).exit_code == 0
    assert not known.exists()


@pytest.mark.parametrize("policy", list(HostKeyPolicy))
def test_changed_host_key_refused_under_every_policy(make_hosts, tmp_path, policy):
    hosts = make_hosts(1)
    host = hosts[0]
    old_key = tmp_path / "old_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(old_key)], check=True)
    old_line = " ".join(Path(str(old_key) + ".pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text(f"[{host.address}]:{host.port} {old_line}\n")
    before = known.read_bytes()
    reason = failure(hosts.nodes()[0], hosts.ssh_settings(policy, known))
    assert "host key CHANGED" in reason
    assert key_fingerprint(old_line) in reason and key_fingerprint(host.host_key_line) in reason
    assert known.read_bytes() == before


def test_hashed_known_hosts_entries_are_understood(make_hosts, tmp_path):
    hosts = make_hosts(1)
    known = tmp_path / "known_hosts"
    known.write_text(hosts[0].known_hosts_line + "\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True)
    assert known.read_text().startswith("|1|")
    with SshTransport(hosts.nodes()[0], hosts.ssh_settings(HostKeyPolicy.YES, known)) as t:
        assert t.run(["true"], timeout=30).exit_code == 0


# -- authentication -------------------------------------------------------------------------------

def test_wrong_key_fails_without_prompt(make_hosts, tmp_path):
    hosts = make_hosts(1)
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    node = hosts.nodes(identity_file=str(wrong))[0]
    start = time.monotonic()
    reason = failure(node, hosts.ssh_settings())
    assert "authentication failed" in reason and str(wrong) in reason
    assert time.monotonic() - start < BOUND


def test_passphrase_protected_key_is_skipped_not_prompted(make_hosts, tmp_path):
    hosts = make_hosts(1)
    locked = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-pass", "-f", str(locked)], check=True)
    reason = failure(hosts.nodes(identity_file=str(locked))[0], hosts.ssh_settings())
    assert "authentication failed" in reason and "passphrase-protected" in reason
    assert "secret-pass" not in reason


def test_missing_identity_file_is_named(make_hosts, tmp_path):
    hosts = make_hosts(1)
    reason = failure(hosts.nodes(identity_file=str(tmp_path / "nope"))[0], hosts.ssh_settings())
    assert "authentication failed" in reason and "nope (file not found)" in reason


# -- network faults -------------------------------------------------------------------------------

def test_connection_refused(make_hosts):
    hosts = make_hosts(1)
    with socket.socket() as s:            # a port nobody listens on
        s.bind((hosts[0].address, 0))
        port = s.getsockname()[1]
    reason = failure(hosts.nodes(port=port)[0], hosts.ssh_settings())
    assert f"connection refused by {hosts[0].address}:{port}" in reason


def test_dns_failure(make_hosts):
    hosts = make_hosts(1)
    node = dataclasses.replace(hosts.nodes()[0], host="nonexistent.invalid")
    reason = failure(node, hosts.ssh_settings(connect_timeout=FAST_TIMEOUT))
    assert "cannot resolve host name 'nonexistent.invalid'" in reason


class SilentServer:
    """Accepts TCP and then says nothing (or only a banner): a wedged sshd, or not SSH at all."""

    def __init__(self, address: str, greeting: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind((address, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.greeting = greeting
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(self.greeting)
            self.conns.append(conn)

    def close(self) -> None:
        # shutdown wakes the accept() blocked in the thread (close alone does not, on Linux)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for conn in self.conns:
            conn.close()
        self.thread.join(5)


@pytest.mark.parametrize("greeting,expected", [
    (b"", "sent no SSH banner within 3 s"),
    (b"SSH-2.0-OpenSSH_9.2\r\n", "did not finish the SSH handshake within 3 s"),
])
def test_tcp_without_ssh_is_bounded(make_hosts, greeting, expected):
    hosts = make_hosts(1)
    server = SilentServer(hosts[0].address, greeting)
    try:
        start = time.monotonic()
        reason = failure(hosts.nodes(port=server.port)[0], hosts.ssh_settings(connect_timeout=FAST_TIMEOUT))
        elapsed = time.monotonic() - start
    finally:
        server.close()
    assert f"{hosts[0].address}:{server.port} accepted the connection but" in reason
    assert expected in reason
    assert elapsed < BOUND


def test_blackholed_connect_times_out(make_hosts):
    hosts = make_hosts(1)
    # A listener that never accepts, with its backlog full: the kernel drops further SYNs, as a
    # firewall that drops packets does.
    listener = socket.socket()
    listener.bind((hosts[0].address, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection((hosts[0].address, port), timeout=5)
    try:
        reason = failure(hosts.nodes(port=port)[0], hosts.ssh_settings(connect_timeout=FAST_TIMEOUT))
    finally:
        filler.close()
        listener.close()
    assert f"no answer from {hosts[0].address}:{port} within 3 s" in reason


# -- ProxyJump ------------------------------------------------------------------------------------

def test_proxy_jump_through_another_test_host(make_hosts):
    hosts = make_hosts(2, extra_config={0: ("LogLevel DEBUG1",)})
    jump, target = hosts[0], hosts[1]
    node = hosts.nodes([target], proxy_jump=f"root@{jump.address}:{jump.port}")[0]
    with SshTransport(node, hosts.ssh_settings()) as t:
        assert t.run(["echo", "via jump"], timeout=30).stdout == "via jump\n"
    # The jump host's sshd really opened the tunnel to the target.
    deadline = time.monotonic() + 10
    wanted = f"target {target.address} port {target.port}"
    while wanted not in jump.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wanted in jump.log.read_text()


def test_proxy_jump_chain_of_two_jump_hosts(make_hosts):
    hosts = make_hosts(3, extra_config={1: ("LogLevel DEBUG1",)})
    first, second, target = hosts[0], hosts[1], hosts[2]
    chain = f"root@{first.address}:{first.port},root@{second.address}:{second.port}"
    with SshTransport(hosts.nodes([target], proxy_jump=chain)[0], hosts.ssh_settings()) as t:
        assert t.run(["echo", "two hops"], timeout=30).stdout == "two hops\n"
    deadline = time.monotonic() + 10
    wanted = f"target {target.address} port {target.port}"   # the second hop opened the last tunnel
    while wanted not in second.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wanted in second.log.read_text()


def test_proxy_jump_refusing_forwarding_is_reported(make_hosts):
    hosts = make_hosts(2, extra_config={0: ("AllowTcpForwarding no",)})
    jump, target = hosts[0], hosts[1]
    node = hosts.nodes([target], proxy_jump=f"root@{jump.address}:{jump.port}")[0]
    reason = failure(node, hosts.ssh_settings())
    assert f"jump host {jump.address} cannot reach {target.address}:{target.port}" in reason


def test_proxy_jump_host_key_is_checked_too(make_hosts, tmp_path):
    hosts = make_hosts(2)
    jump, target = hosts[0], hosts[1]
    known = tmp_path / "known_hosts"
    known.write_text(target.known_hosts_line + "\n")          # the jump host is unknown
    node = hosts.nodes([target], proxy_jump=f"root@{jump.address}:{jump.port}")[0]
    reason = failure(node, hosts.ssh_settings(HostKeyPolicy.YES, known))
    assert reason.startswith(f"jump host {jump.address}: unknown host key")
