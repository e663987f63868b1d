"""Real OpenSSH test hosts: one ``sshd -D -e`` per host, each on its own loopback address.

Reused by the probe, fault and launch tests and by ``benchmarks/probe_fanout.py``.

Each host gets, in its own directory:
- a generated ed25519 host key and its own ``sshd_config`` (public-key root login only, no PAM);
- ``home/``: the session's ``$HOME`` (so the shipped package cache and rc files are per host);
- ``bin/``: first on the session's ``PATH``, where a host may get the fake ``nvidia-smi`` of
  ``tests/fakes`` plus its ``scenario`` file (no ``nvidia-smi`` there = a CPU-only node).

``PATH`` and ``HOME`` are set with sshd's ``SetEnv``: sshd applies SetEnv after its own defaults
(``PATH``, ``HOME``, ``USER``), so it overrides them for exec sessions too; ``test_sshhosts.py``
checks that this really holds. With a per-host ``HOME``, bash reads that host's ``.bashrc`` (Debian's
bash sources it for commands run by sshd), which is how a host gets login-shell noise.

The sessions' environment does not inherit this process's ``PYTHONPATH`` (sshd builds a fresh one),
and ``/usr/bin/python3`` has neither hgcli nor torch, so node code runs only from what hgtrain ships.
Tests whose nodes run torch give them this test run's interpreter (``python=sys.executable``): the
``.venv`` of ``scripts/setup`` in CI, which has exactly what pyproject.toml declares.

Ports are free ports picked by a bind test on each address; other test runs may start sshds at the
same time, so a port lost to a race is retried with another one.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from hgcli.schema.stages import HostKeyPolicy, NodeSpec, SshSettings
from hgcli.node.ports import free_port
from hgcli.remote.known_hosts import host_name

SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[1]
FAKE_NVIDIA_SMI = REPO / "tests" / "fakes" / "nvidia-smi"
FIRST_ADDRESS = 11          # hosts live on 127.0.0.11, 127.0.0.12, ...
START_TIMEOUT_S = 30.0      # generous: the machine is shared with other test runs


def sshd_available() -> bool:
    return os.access(SSHD, os.X_OK) and shutil.which("ssh-keygen") is not None


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (sshd's per-connection children call setsid, so a process
    group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class TestHost:
    __test__ = False   # not a pytest class

    name: str
    address: str
    dir: Path
    port: int = 0
    host_key_line: str = ""        # "ssh-ed25519 AAAA..." (no host name)
    proc: subprocess.Popen | None = None
    extra_config: tuple[str, ...] = ()
    stopped_pids: list[int] = field(default_factory=list)
    # Run sshd under this command (``ip netns exec NS``: a host behind a link a test can cut), on
    # ``fixed_port`` (a port in a namespace of its own is free; a bind test from here cannot see it).
    prefix: tuple[str, ...] = ()
    fixed_port: int = 0

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def log(self) -> Path:
        return self.dir / "sshd.log"

    @property
    def known_hosts_line(self) -> str:
        return f"{host_name(self.address, self.port)} {self.host_key_line}"

    def node(self, **overrides) -> NodeSpec:
        fields = dict(name=self.name, host=self.address, port=self.port, user="root")
        fields.update(overrides)
        return NodeSpec(**fields)

    def set_gpus(self, scenario: str | None) -> None:
        """Install the fake nvidia-smi with ``scenario``; None makes this a CPU-only host."""
        target = self.bin_dir / "nvidia-smi"
        if scenario is None:
            target.unlink(missing_ok=True)
            (self.bin_dir / "scenario").unlink(missing_ok=True)
            return
        # A copy, not a symlink: the fake finds its ``scenario`` file next to its own path.
        shutil.copy2(FAKE_NVIDIA_SMI, target)
        target.chmod(0o755)
        (self.bin_dir / "scenario").write_text(scenario + "\n")

    def set_rc_noise(self, stdout_line: str, stderr_line: str) -> None:
        """Make this host's shell print noise, as a login shell's motd and rc-file warnings do."""
        (self.home / ".bashrc").write_text(f"echo {stdout_line!r}\necho {stderr_line!r} >&2\n")

    def config_text(self, authorized_keys: Path) -> str:
        path_env = f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin"
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            f"HostKey {self.dir / 'ssh_host_ed25519_key'}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",         # tmp dirs are not owned the way sshd insists on for ~/.ssh
            "PrintMotd no",
            "MaxStartups 200",        # benchmarks open many connections at once
            "MaxSessions 50",
            f"SetEnv PATH={path_env} HOME={self.home}",
            *self.extra_config,
        ]
        return "\n".join(lines) + "\n"

    def start(self, authorized_keys: Path) -> None:
        last_error = ""
        for _ in range(5):
            self.port = self.fixed_port or free_port(self.address)  # below the ephemeral range: see hgcli.node.ports
            config = self.dir / "sshd_config"
            config.write_text(self.config_text(authorized_keys))
            log = open(self.log, "ab")
            # Fresh minimal environment: nothing of this process (PYTHONPATH...) reaches sessions.
            self.proc = subprocess.Popen([*self.prefix, SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, env={"PATH": "/usr/sbin:/usr/bin:/bin"})
            log.close()
            if self._wait_ready():
                return
            self.stop()
            last_error = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"sshd test host {self.name} did not start:\n{last_error}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.address, self.port), timeout=2) as s:
                    s.settimeout(5)
                    if s.recv(64).startswith(b"SSH-"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def pids(self) -> list[int]:
        """Live processes of this host: the listener, its sessions, and any that outlived stop()."""
        current = [self.proc.pid, *_descendants(self.proc.pid)] if self.proc is not None else []
        return [p for p in dict.fromkeys(current + self.stopped_pids) if _alive(p)]

    def freeze(self) -> None:
        """SIGSTOP the listener: it accepts no connection until stopped (its sessions run on)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        """Stop the listener and every session it forked, and wait until they are gone.

        The session processes are listed first: once the listener dies they are reparented and
        can no longer be found as its descendants."""
        if self.proc is None:
            return
        # Frozen first: a connection accepted between the listing and the listener's death would
        # fork a session that is in no list and outlives the host (a restart's agent, say).
        self.freeze()
        pids = self.pids()
        self.stopped_pids.extend(pids)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in reversed(pids):
                if _alive(pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            try:
                os.kill(self.proc.pid, signal.SIGCONT)   # the frozen listener takes its signal
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
            deadline = time.monotonic() + 10
            while any(_alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not any(_alive(p) for p in pids):
                break
        self.proc = None


def stop_at_once(*hosts: "TestHost") -> None:
    """Stop several hosts as one failure (a rack losing power): every listener is frozen first and
    every host's processes are killed concurrently, so nothing sees one host down and the next up."""
    import threading

    for host in hosts:
        host.freeze()
    threads = [threading.Thread(target=host.stop) for host in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair at ``path``; returns the public key as \"type base64\"."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    kind, blob = Path(str(path) + ".pub").read_text().split()[:2]
    return f"{kind} {blob}"


@dataclass
class TestHosts:
    """N sshd test hosts sharing one client key; ``known_hosts`` trusts all of them."""

    __test__ = False

    root: Path
    hosts: list[TestHost] = field(default_factory=list)

    @property
    def client_key(self) -> Path:
        return self.root / "client_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.root / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    def __getitem__(self, i: int) -> TestHost:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def ssh_settings(self, policy: HostKeyPolicy = HostKeyPolicy.YES, known_hosts: Path | None = None,
                     connect_timeout: float = 30.0) -> SshSettings:
        return SshSettings(known_hosts=str(known_hosts or self.known_hosts),
                           strict_host_key_checking=policy, connect_timeout=connect_timeout,
                           config=str(self.root / "no-ssh-config"))

    def nodes(self, hosts: Iterable[TestHost] | None = None, **overrides) -> tuple[NodeSpec, ...]:
        return tuple(h.node(**{"identity_file": str(self.client_key), **overrides})
                     for h in (self.hosts if hosts is None else hosts))

    def write_known_hosts(self) -> None:
        self.known_hosts.write_text("".join(h.known_hosts_line + "\n" for h in self.hosts))
        self.known_hosts.chmod(0o600)

    def stop(self) -> None:
        for host in self.hosts:
            host.stop()

    def leftover_pids(self) -> list[int]:
        return [pid for h in self.hosts for pid in h.pids()]


def start_hosts(root: Path, count: int, *, first: int = FIRST_ADDRESS,
                extra_config: dict[int, tuple[str, ...]] | None = None,
                namespaced: dict[int, tuple[str, str]] | None = None) -> TestHosts:
    """Start ``count`` hosts named host1..hostN on 127.0.0.<first>...; stop them with ``.stop()``.

    ``namespaced``: host index -> (network namespace, address there): that host's sshd runs inside
    the namespace (``ip netns exec``; the namespace and its link are the caller's), on port 2222."""
    if not os.path.isdir("/run/sshd"):      # sshd's privilege-separation directory
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    hosts = TestHosts(root)
    pub = _keygen(hosts.client_key, "hgtrain-test-client")
    hosts.authorized_keys.write_text(pub + "\n")
    try:
        for i in range(count):
            namespace, address = (namespaced or {}).get(i, (None, f"127.0.0.{first + i}"))
            host = TestHost(name=f"host{i + 1}", address=address, dir=root / f"host{i + 1}",
                            extra_config=(extra_config or {}).get(i, ()),
                            prefix=("ip", "netns", "exec", namespace) if namespace else (),
                            fixed_port=2222 if namespace else 0)
            host.bin_dir.mkdir(parents=True)
            host.home.mkdir(mode=0o700)
            host.host_key_line = _keygen(host.dir / "ssh_host_ed25519_key", host.name)
            hosts.hosts.append(host)
            host.start(hosts.authorized_keys)
        hosts.write_known_hosts()
    except BaseException:
        hosts.stop()
        raise
    return hosts
