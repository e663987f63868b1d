"""One node's SSH connection: opened on first use, hop by hop through any jump hosts, every phase
with its own bound and its own message, so a user knows what to fix: name resolution, TCP connect
(refused / no answer), SSH banner and handshake, host key, authentication (the last two:
``sshauth``). Commands on it are ``sshexec``'s.
"""
from __future__ import annotations

import getpass
import socket
import threading
import time
from typing import Sequence

from . import known_hosts
from .sshauth import authenticate, check_host_key, known_hosts_path
from .sshlib import paramiko
from ..errors import RemoteError
from ..schema.stages import NodeSpec, SshSettings

# AES-GCM first (an order of preference only: a server without it negotiates the next one). An AEAD
# cipher carries its own tag, checked inside the cryptography library; with AES-CTR paramiko computes
# an HMAC per packet and compares it in a Python loop, which was a fifth of the controller's CPU in a
# log flood (benchmarks/log_throughput.py). OpenSSH also ranks an AEAD cipher (chacha20-poly1305,
# which paramiko lacks) first.
AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")

Hop = tuple[str, str, int, str, str | None]   # (where, for messages; address, port, user, identity file)


def parse_jump(spec: str) -> tuple[str | None, str, int]:
    """``[user@]host[:port]`` (also ``[v6addr]:port``) -> (user, host, port)."""
    user, _, hostport = spec.rpartition("@")
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
    else:
        host, port = hostport, ""
    if not host or (port and not port.isdigit()):
        raise RemoteError(spec, f"bad ProxyJump {spec!r}: expected [user@]host[:port]")
    return user or None, host, int(port) if port else 22


def _resolve(address: str, port: int, timeout: float) -> list[tuple]:
    """getaddrinfo bounded by ``timeout`` (a slow resolver must not stall the whole fan-out)."""
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["infos"] = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name=f"resolve {address}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["infos"]  # type: ignore[return-value]


def _prefer_aead(ciphers: Sequence[str]) -> tuple[str, ...]:
    first = tuple(c for c in AEAD_CIPHERS if c in ciphers)
    return first + tuple(c for c in ciphers if c not in first)


class SshConnection:
    """The connection to one node (through ``proxy_jump`` if set): opened when first asked for,
    opened again when it dropped, closed by ``close``. Thread-safe: fan-out and reader threads share it."""

    def __init__(self, node: NodeSpec, ssh: SshSettings) -> None:
        self.node = node
        self.ssh = ssh
        self._lock = threading.Lock()
        self._hops: list[paramiko.Transport] = []   # jump hosts first, the node last

    @property
    def timeout(self) -> float:
        return self.ssh.connect_timeout

    def fail(self, message: str) -> RemoteError:
        return RemoteError(self.node.name, message)

    def transport(self) -> paramiko.Transport:
        """The node's paramiko transport, connected (hop by hop) if it is not."""
        with self._lock:
            if self._hops and self._hops[-1].is_active():
                return self._hops[-1]
            self._close_hops()
            try:
                self._open()
            except BaseException:
                self._close_hops()
                raise
            return self._hops[-1]

    def dropped(self, wait_s: float) -> bool:
        """Whether the connection is gone. paramiko closes the channels of a dead connection just
        before it marks the connection inactive: its thread gets ``wait_s`` to finish first."""
        node = self._hops[-1]
        node.join(wait_s)
        return not node.is_active()

    def _open(self) -> None:
        """Connect hop by hop: each jump host, then the node through a tunnel from the previous hop."""
        hops = self._route()
        sock: socket.socket | paramiko.Channel | None = None
        for i, (where, address, port, hop_user, identity) in enumerate(hops):
            if i:
                sock = self._tunnel(self._hops[-1], hops[i - 1][1], address, port)
            self._hops.append(self._handshake(where, address, port, hop_user, identity, sock))

    def _route(self) -> list[Hop]:
        """The hops to the node: each jump host of ``proxy_jump`` (comma-separated, as OpenSSH), then
        the node. Jump hosts get the same host-key policy and the same keys as the node (the
        ssh-config merge resolves their aliases beforehand)."""
        node = self.node
        user = node.user or getpass.getuser()
        hops: list[Hop]
        if node.jump is not None:
            # Resolved by the ssh-config merge: each hop has its own address, port, user and key.
            chain: list[NodeSpec] = []
            hop: NodeSpec | None = node.jump
            while hop is not None:
                chain.insert(0, hop)
                hop = hop.jump
            hops = [(f"jump host {j.name}: ", j.address, j.port, j.user or user,
                     j.identity_file or node.identity_file) for j in chain]
        else:
            hops = [(f"jump host {host}: ", host, port, jump_user or user, node.identity_file)
                    for jump_user, host, port in (parse_jump(spec.strip())
                                                  for spec in (node.proxy_jump or "").split(",")
                                                  if spec.strip())]
        hops.append(("", node.address, node.port, user, node.identity_file))
        return hops

    def _tunnel(self, hop: paramiko.Transport, jump_host: str, address: str, port: int) -> paramiko.Channel:
        """The next hop's socket: a direct-tcpip channel from the jump host to it."""
        try:
            return hop.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0), timeout=self.timeout)
        except paramiko.ChannelException as exc:
            raise self.fail(f"jump host {jump_host} cannot reach {address}:{port}: {exc.text}") from None
        except (paramiko.SSHException, OSError) as exc:
            raise self.fail(f"jump host {jump_host}: no tunnel to {address}:{port} within "
                            f"{self.timeout:g} s ({exc})") from None

    def _tcp(self, where: str, address: str, port: int) -> socket.socket:
        timeout = self.timeout
        try:
            infos = _resolve(address, port, timeout)
        except TimeoutError:
            raise self.fail(f"{where}cannot resolve host name {address!r}: no answer from the "
                            f"resolver within {timeout:g} s") from None
        except OSError as exc:
            raise self.fail(f"{where}cannot resolve host name {address!r} "
                            f"({getattr(exc, 'strerror', None) or exc}); check the host in the cluster "
                            "file or your ssh config") from None
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            sock.settimeout(timeout)
            try:
                sock.connect(sockaddr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
        if isinstance(error, ConnectionRefusedError):
            raise self.fail(f"{where}connection refused by {address}:{port} (no SSH server listening "
                            "on that port?)")
        if isinstance(error, socket.timeout):
            raise self.fail(f"{where}no answer from {address}:{port} within {timeout:g} s (host down, "
                            "or a firewall drops the connection)")
        raise self.fail(f"{where}cannot connect to {address}:{port}: "
                        f"{getattr(error, 'strerror', None) or error}")

    def _handshake(self, where: str, address: str, port: int, user: str, identity: str | None,
                   sock: socket.socket | paramiko.Channel | None) -> paramiko.Transport:
        """TCP (or tunnel) -> SSH banner and key exchange -> host key check -> authentication."""
        timeout = self.timeout
        name = known_hosts.host_name(address, port)
        transport = paramiko.Transport(sock if sock is not None else self._tcp(where, address, port))
        try:
            transport.banner_timeout = timeout
            transport.handshake_timeout = timeout
            transport.auth_timeout = timeout
            # Ask for a key type we have on file, as OpenSSH does, so a known host is checkable.
            options = transport.get_security_options()
            on_file = known_hosts.known_key_types(known_hosts_path(self.ssh), name)
            preferred = [t for t in on_file if t in options.key_types]
            options.key_types = preferred + [t for t in options.key_types if t not in preferred]
            options.ciphers = _prefer_aead(options.ciphers)
            done = threading.Event()
            started = time.monotonic()
            transport.start_client(event=done)
            # A little slack so paramiko's own banner timeout, with its clearer reason, fires first.
            if not done.wait(timeout + 1.0) or not transport.is_active():
                timed_out = time.monotonic() - started >= timeout
                raise self.fail(f"{where}{address}:{port} accepted the connection but "
                                f"{_handshake_reason(transport, timeout, timed_out)}")
            check_host_key(self.node.name, self.ssh, where, address, port, transport.get_remote_server_key())
            authenticate(self.node.name, where, transport, user, identity, timeout)
        except BaseException:
            transport.close()
            raise
        return transport

    def _close_hops(self) -> None:
        while self._hops:
            self._hops.pop().close()   # the node first, then each jump host

    def close(self) -> None:
        with self._lock:
            self._close_hops()


def _handshake_reason(transport: paramiko.Transport, timeout: float, timed_out: bool) -> str:
    exc = transport.get_exception()
    text = str(exc) if exc else ""
    if "banner" in text.lower():
        return f"sent no SSH banner within {timeout:g} s (is it an SSH server?)"
    if timed_out:   # paramiko reports its handshake timeout as a bare EOFError
        return f"did not finish the SSH handshake within {timeout:g} s"
    if isinstance(exc, (EOFError, ConnectionResetError)):
        return "closed it during the SSH handshake"
    return f"the SSH handshake failed: {text or type(exc).__name__}"
