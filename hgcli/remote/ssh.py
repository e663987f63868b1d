"""The SSH transport (paramiko). The only module that imports paramiko.

Why paramiko rather than the ``ssh`` binary: one process, connections reused by every command of a
stage, and every wait bounded by us. What it keeps from OpenSSH: known_hosts and its policies,
``[user@]host[:port]`` ProxyJump, identity file / agent / default keys, and never a prompt: a node
that wants a password or a passphrase fails with "authentication failed (tried: ...)" instead of
hanging a fan-out on a TTY read.

Every phase has its own bound and its own message, so a user knows what to fix: name resolution,
TCP connect (refused / no answer), SSH banner and handshake, host key, authentication, command.
"""
from __future__ import annotations

import getpass
import importlib
import importlib.util
import io
import os
import re
import select
import shlex
import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence, cast


class _Deferred(types.ModuleType):
    """Stands for a module in ``sys.modules`` until one of its attributes is used, then imports it.
    (importlib's LazyLoader does not defer here: Python 3.11's import statement reads the module's
    ``__spec__`` and so loads a lazy module at once.)"""

    def __getattr__(self, name: str) -> object:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def _defer_invoke() -> None:
    """paramiko.config imports ``invoke`` (a task runner that pulls in asyncio, yaml, unittest.mock...)
    at import time for one thing only: the ssh-config keyword ``Match exec``. That was half of
    paramiko's import and a tenth of every ``hgtrain launch``'s start-up; deferred, ``Match exec``
    still works as before (it imports invoke when it runs)."""
    if "invoke" not in sys.modules and importlib.util.find_spec("invoke") is not None:
        sys.modules["invoke"] = _Deferred("invoke")


_defer_invoke()
import paramiko  # noqa: E402  (after _defer_invoke)

from ..errors import RemoteError
from ..schema.stages import HostKeyPolicy, NodeSpec, SshSettings
from . import known_hosts
from . import ship
from .known_hosts import HostKey, Verdict
from .transport import Completed

DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def command_line(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The remote shell command: ``env K=V ... argv`` with every element quoted."""
    words = []
    if env:
        for key, value in env.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"not an environment variable name: {key!r}")
            words.append(shlex.quote(f"{key}={value}"))
        words.insert(0, "env")
    words.extend(shlex.quote(str(a)) for a in argv)
    return " ".join(words)


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


def _drop(channel: paramiko.Channel) -> None:
    """Close a channel; on a connection that is already gone that is not an error."""
    try:
        channel.close()
    except (EOFError, OSError, paramiko.SSHException):
        pass


# AES-GCM first (an order of preference only: a server without it negotiates the next one). An AEAD
# cipher carries its own tag, checked inside the cryptography library; with AES-CTR paramiko computes
# an HMAC per packet and compares it in a Python loop, which was a fifth of the controller's CPU in a
# log flood (benchmarks/log_throughput.py). OpenSSH also ranks an AEAD cipher (chacha20-poly1305,
# which paramiko lacks) first.
AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _prefer_aead(ciphers: Sequence[str]) -> tuple[str, ...]:
    first = tuple(c for c in AEAD_CIPHERS if c in ciphers)
    return first + tuple(c for c in ciphers if c not in first)


class _ChannelStream(io.RawIOBase):
    """One of a channel's output streams as a raw stream, so ``io.BufferedReader`` splits its lines
    (in C). paramiko's own file object splits in Python and re-copies a long line for every 8 KiB
    it reads: a flood of log lines, or one frame of a batch of them, crawled through it."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        super().__init__()
        self._recv = recv

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:   # a writable buffer (memoryview) of BufferedReader's
        data = self._recv(len(buffer))   # what has arrived (at least one byte); b"" at EOF
        buffer[:len(data)] = data
        return len(data)


STREAM_BUFFER = 1 << 16


class SshProcess:
    """A command started with ``SshTransport.start``; closing drops its channel (stdin EOF)."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        # paramiko's file is not a BinaryIO, but does what RemoteProcess.stdin is used for (write,
        # flush, close).
        self.stdin: BinaryIO = cast(BinaryIO, channel.makefile_stdin("wb"))
        self.stdout: BinaryIO = io.BufferedReader(_ChannelStream(channel.recv), STREAM_BUFFER)
        self.stderr: BinaryIO = io.BufferedReader(_ChannelStream(channel.recv_stderr), STREAM_BUFFER)

    def wait(self, timeout: float | None = None) -> int:
        if not self._channel.status_event.wait(timeout):
            raise TimeoutError(f"still running after {timeout:g} s")
        return self._channel.recv_exit_status()

    def close(self) -> None:
        _drop(self._channel)


class SshTransport:
    """Connects on first use (through ``proxy_jump`` if set), then runs every command on that one
    connection. Close it (or use it as a context manager) to drop the connection."""

    def __init__(self, node: NodeSpec, ssh: SshSettings) -> None:
        self.node = node
        self.ssh = ssh
        self._lock = threading.Lock()
        self._hops: list[paramiko.Transport] = []   # jump hosts first, the node last
        self._package_root: str | None = None
        self._package_verified = False   # seen on the node during this session

    # -- connection ----------------------------------------------------------------------------

    @property
    def _timeout(self) -> float:
        return self.ssh.connect_timeout

    @property
    def _known_hosts(self) -> Path:
        return Path(self.ssh.known_hosts).expanduser()

    def _fail(self, message: str) -> RemoteError:
        return RemoteError(self.node.name, message)

    def _connection(self) -> paramiko.Transport:
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

    def _open(self) -> None:
        """Connect hop by hop: each jump host of ``proxy_jump`` (comma-separated, as OpenSSH), then
        the node through a tunnel from the previous hop. Jump hosts get the same host-key policy
        and the same keys as the node (the ssh-config merge resolves their aliases beforehand)."""
        node = self.node
        user = node.user or getpass.getuser()
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
        sock: socket.socket | paramiko.Channel | None = None
        for i, (where, address, port, hop_user, identity) in enumerate(hops):
            if i:
                sock = self._tunnel(self._hops[-1], hops[i - 1][1], address, port)
            self._hops.append(self._handshake(where, address, port, hop_user, identity, sock))

    def _tunnel(self, hop: paramiko.Transport, jump_host: str, address: str, port: int) -> paramiko.Channel:
        """The next hop's socket: a direct-tcpip channel from the jump host to it."""
        try:
            return hop.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0), timeout=self._timeout)
        except paramiko.ChannelException as exc:
            raise self._fail(f"jump host {jump_host} cannot reach {address}:{port}: {exc.text}") from None
        except (paramiko.SSHException, OSError) as exc:
            raise self._fail(f"jump host {jump_host}: no tunnel to {address}:{port} within "
                             f"{self._timeout:g} s ({exc})") from None

    def _tcp(self, where: str, address: str, port: int) -> socket.socket:
        timeout = self._timeout
        try:
            infos = _resolve(address, port, timeout)
        except TimeoutError:
            raise self._fail(f"{where}cannot resolve host name {address!r}: no answer from the "
                             f"resolver within {timeout:g} s") from None
        except OSError as exc:
            raise self._fail(f"{where}cannot resolve host name {address!r} "
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
            raise self._fail(f"{where}connection refused by {address}:{port} (no SSH server listening "
                             "on that port?)")
        if isinstance(error, socket.timeout):
            raise self._fail(f"{where}no answer from {address}:{port} within {timeout:g} s (host down, "
                             "or a firewall drops the connection)")
        raise self._fail(f"{where}cannot connect to {address}:{port}: "
                         f"{getattr(error, 'strerror', None) or error}")

    def _handshake(self, where: str, address: str, port: int, user: str, identity: str | None,
                   sock: socket.socket | paramiko.Channel | None) -> paramiko.Transport:
        """TCP (or tunnel) -> SSH banner and key exchange -> host key check -> authentication."""
        timeout = self._timeout
        name = known_hosts.host_name(address, port)
        transport = paramiko.Transport(sock if sock is not None else self._tcp(where, address, port))
        try:
            transport.banner_timeout = timeout
            transport.handshake_timeout = timeout
            transport.auth_timeout = timeout
            # Ask for a key type we have on file, as OpenSSH does, so a known host is checkable.
            options = transport.get_security_options()
            preferred = [t for t in known_hosts.known_key_types(self._known_hosts, name)
                         if t in options.key_types]
            options.key_types = preferred + [t for t in options.key_types if t not in preferred]
            options.ciphers = _prefer_aead(options.ciphers)
            done = threading.Event()
            started = time.monotonic()
            transport.start_client(event=done)
            # A little slack so paramiko's own banner timeout, with its clearer reason, fires first.
            if not done.wait(timeout + 1.0) or not transport.is_active():
                timed_out = time.monotonic() - started >= timeout
                raise self._fail(f"{where}{address}:{port} accepted the connection but "
                                 f"{self._handshake_reason(transport, timeout, timed_out)}")
            self._check_host_key(where, address, port, transport.get_remote_server_key())
            self._authenticate(where, transport, user, identity)
        except BaseException:
            transport.close()
            raise
        return transport

    @staticmethod
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

    def _check_host_key(self, where: str, address: str, port: int, server_key: paramiko.PKey) -> None:
        path = self._known_hosts
        name = known_hosts.host_name(address, port)
        key = HostKey(server_key.get_name(), server_key.asbytes())
        result = known_hosts.check(path, name, key)
        if result.verdict is Verdict.KNOWN:
            return
        if result.verdict is Verdict.REVOKED:
            raise self._fail(f"{where}host key {key.key_type} {key.fingerprint} of {name} is marked "
                             f"@revoked in {path}; refusing to connect")
        if result.verdict is Verdict.CHANGED:
            on_file = ", ".join(f"{k.key_type} {k.fingerprint}" for k in result.known)
            raise self._fail(
                f"{where}host key CHANGED for {name}: the server offers {key.key_type} {key.fingerprint} "
                f"but {path} has {on_file}. This can be an attack (or a reinstalled host); refusing "
                f"under every policy. If the change is expected: ssh-keygen -f {path} -R '{name}'")
        policy = self.ssh.strict_host_key_checking
        if policy is HostKeyPolicy.ACCEPT_NEW:
            try:
                known_hosts.add(path, name, key)
            except OSError as exc:
                raise self._fail(f"{where}cannot add the host key of {name} to {path}: "
                                 f"{exc.strerror or exc}") from None
            return
        if policy is HostKeyPolicy.NO:
            return
        scan = f"ssh-keyscan -p {port} {address}" if port != 22 else f"ssh-keyscan {address}"
        raise self._fail(
            f"{where}unknown host key for {name}: {key.key_type} {key.fingerprint}. If this is the "
            f"right fingerprint, trust it with `{scan} >> {path}`, or set "
            f"strict_host_key_checking = \"accept-new\" in the [ssh] section of the cluster file")

    def _candidate_keys(self, tried: list[str], identity: str | None) -> Iterator[tuple[str, paramiko.PKey]]:
        """(label, key) in OpenSSH's order: the identity file, agent keys, default key files.
        Keys that cannot be used without a prompt are listed in ``tried`` and skipped."""
        paths = [identity] if identity else []
        for path in paths:
            yield from self._key_file(path, tried, explicit=True)
        if os.environ.get("SSH_AUTH_SOCK"):
            try:
                agent_keys = paramiko.Agent().get_keys()
            except paramiko.SSHException:
                agent_keys = ()
            for key in agent_keys:
                yield f"agent key {known_hosts.fingerprint(key.asbytes())}", key
        for path in DEFAULT_KEYS:
            if path not in paths:
                yield from self._key_file(path, tried, explicit=False)

    @staticmethod
    def _key_file(path: str, tried: list[str], *, explicit: bool) -> Iterator[tuple[str, paramiko.PKey]]:
        full = Path(path).expanduser()
        if not full.exists():
            if explicit:
                tried.append(f"{path} (file not found)")
            return
        locked = f"{path} (passphrase-protected: load it into ssh-agent; hgtrain never prompts)"
        try:
            key = paramiko.PKey.from_path(full)
        except paramiko.PasswordRequiredException:
            tried.append(locked)
            return
        except TypeError as exc:   # what cryptography raises for an encrypted OpenSSH-format key
            tried.append(locked if "password" in str(exc).lower() else f"{path} (unreadable: {exc})")
            return
        except (paramiko.SSHException, OSError, ValueError) as exc:
            tried.append(f"{path} (unreadable: {exc})")
            return
        yield str(full), key

    def _authenticate(self, where: str, transport: paramiko.Transport, user: str,
                      identity: str | None) -> None:
        tried: list[str] = []
        for label, key in self._candidate_keys(tried, identity):
            if not transport.is_active():
                break
            try:
                remaining = transport.auth_publickey(user, key)
            except paramiko.AuthenticationException:
                tried.append(label)
                continue
            except paramiko.SSHException as exc:
                raise self._fail(f"{where}authentication as {user!r} did not finish within "
                                 f"{self._timeout:g} s ({exc})") from None
            if transport.is_authenticated():
                return
            tried.append(f"{label} (server wants more: {', '.join(remaining)})")
        raise self._fail(
            f"{where}authentication failed for user {user!r} (tried: {', '.join(tried) or 'no keys found'}). "
            "hgtrain uses keys only and never prompts: set identity_file, or load a key into ssh-agent")

    # -- commands ------------------------------------------------------------------------------

    def _channel(self, argv: Sequence[str], env: Mapping[str, str] | None,
                 watchdog_s: float | None) -> paramiko.Channel:
        """A session channel running ``argv``. ``exec_command`` waits for the server's reply without
        a bound of its own, so a watchdog closes the channel if the server stalls."""
        line = command_line(argv, env)
        try:
            channel = self._connection().open_session(timeout=self._timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._fail(f"cannot open a session: {exc or type(exc).__name__}") from None
        watchdog = threading.Timer(watchdog_s or self._timeout, _drop, args=(channel,))
        watchdog.daemon = True
        watchdog.start()
        try:
            channel.exec_command(line)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            _drop(channel)
            raise self._fail(f"the server did not start {argv[0]}: {exc or type(exc).__name__}") from None
        finally:
            watchdog.cancel()
        return channel

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, timeout: float) -> Completed:
        if not self._runs_unverified_package(env):
            return self._run(argv, stdin, env, timeout)
        # The package root was remembered from an earlier session: check it in the same command.
        result = self._run(["sh", "-c", ship.GUARD_SCRIPT, "sh", str(self._package_root), *argv],
                           stdin, env, timeout)
        if not ship.says_missing(result):
            self._package_verified = True
            return result
        self._ship()
        return self._run(argv, stdin, {**(env or {}), "PYTHONPATH": str(self._package_root)}, timeout)

    def _run(self, argv: Sequence[str], stdin: bytes | None, env: Mapping[str, str] | None,
             timeout: float) -> Completed:
        deadline = time.monotonic() + timeout
        channel = self._channel(argv, env, timeout)
        out: list[bytes] = []
        err: list[bytes] = []
        writer = threading.Thread(target=self._feed, args=(channel, stdin or b""), daemon=True)
        writer.start()
        try:
            while True:
                # Decide "finished" before draining: data that arrives between the checks is
                # still read below, because the server sends it before the exit status and EOF.
                finished = channel.closed or (channel.exit_status_ready() and channel.eof_received)
                while channel.recv_ready():
                    out.append(channel.recv(65536))
                while channel.recv_stderr_ready():
                    err.append(channel.recv_stderr(65536))
                if finished:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._fail(f"timed out after {timeout:g} s running {shlex.join(argv[:3])} "
                                     "(the command did not finish)")
                select.select([channel], [], [], min(remaining, 1.0))
            code = channel.recv_exit_status()   # -1: the server sent none (a signal, or a lost link)
            if code == -1:
                # paramiko closes the channels of a dead connection just before it marks the
                # connection inactive: give its thread a moment to finish before deciding.
                self._hops[-1].join(1.0)
                if not self._hops[-1].is_active():
                    raise self._fail(f"connection lost while running {shlex.join(argv[:3])}")
        finally:
            _drop(channel)
            writer.join(1.0)
        return Completed(code, b"".join(out).decode("utf-8", "replace"),
                         b"".join(err).decode("utf-8", "replace"))

    @staticmethod
    def _feed(channel: paramiko.Channel, data: bytes) -> None:
        """Send stdin from its own thread: a command may write output before it reads its input."""
        try:
            if data:
                channel.sendall(data)
            channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass   # the command exited or the channel closed; run() reports what happened

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> SshProcess:
        if not self._runs_unverified_package(env):
            return SshProcess(self._channel(argv, env, None))
        # A package remembered from an earlier session: the guard's sh test checks it on a second
        # channel while the command starts, so the check adds no round trip. Such a command is a
        # node program (PYTHONPATH is the package): without its package it only fails to import
        # it, so when the check says the package is gone it is dropped, the package shipped, and
        # the command started again.
        self._connection()   # connect once, before the two channels
        found: list[Completed | BaseException] = []

        def check() -> None:
            try:
                found.append(self._run(["sh", "-c", ship.GUARD_SCRIPT, "sh", str(self._package_root), "true"],
                                       None, None, ship.SHIP_TIMEOUT_S))
            except BaseException as exc:   # noqa: BLE001 - raised below, on the caller's thread
                found.append(exc)

        checker = threading.Thread(target=check, name=f"package check {self.node.name}", daemon=True)
        checker.start()
        try:
            channel = self._channel(argv, env, None)
        finally:
            checker.join()
        result = found[0]
        if isinstance(result, BaseException) or ship.says_missing(result):
            _drop(channel)
            if isinstance(result, BaseException):
                raise result
            self._ship()
            channel = self._channel(argv, {**(env or {}), "PYTHONPATH": str(self._package_root)}, None)
        self._package_verified = True
        return SshProcess(channel)

    # -- the shipped package -------------------------------------------------------------------

    def _target(self) -> str:
        """Who this connection reaches, as the key of the remembered package location."""
        via = f" via {self.node.proxy_jump}" if self.node.proxy_jump else ""
        return f"{self.node.user or getpass.getuser()}@{self.node.address}:{self.node.port}{via}"

    def _ship(self) -> None:
        self._package_root = ship.ensure_package(self)
        self._package_verified = True
        ship.remember_root(self._target(), self._package_root)

    def _runs_unverified_package(self, env: Mapping[str, str] | None) -> bool:
        return (not self._package_verified and self._package_root is not None
                and env is not None and env.get("PYTHONPATH") == self._package_root)

    def package_root(self) -> str:
        """Remembered from an earlier session (checked when first used), else checked/shipped now."""
        if self._package_root is None:
            remembered = ship.remembered_root(self._target())
            if remembered is None:
                self._ship()
            else:
                self._package_root, self._package_verified = remembered, False
        return str(self._package_root)

    # -- lifetime ------------------------------------------------------------------------------

    def _close_hops(self) -> None:
        while self._hops:
            self._hops.pop().close()   # the node first, then each jump host

    def close(self) -> None:
        with self._lock:
            self._close_hops()

    def __enter__(self) -> "SshTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
