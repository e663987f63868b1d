"""Who is who on an SSH connection: the server's host key against known_hosts and the cluster's
policy, then our keys (identity file, agent, default files) until one is accepted.

What it keeps from OpenSSH: known_hosts and its policies, the key order, and never a prompt: a node
that wants a password or a passphrase fails with "authentication failed (tried: ...)" instead of
hanging a fan-out on a TTY read. The known_hosts decisions themselves are ``known_hosts``'s.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from . import known_hosts
from .known_hosts import HostKey, Verdict
from .sshlib import paramiko
from ..errors import RemoteError
from ..schema.stages import HostKeyPolicy, SshSettings

DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")


def known_hosts_path(ssh: SshSettings) -> Path:
    return Path(ssh.known_hosts).expanduser()


def check_host_key(host: str, ssh: SshSettings, where: str, address: str, port: int,
                   server_key: paramiko.PKey) -> None:
    """Accept ``server_key`` for ``address:port`` or raise RemoteError (``host``: the node's name) with
    what to do: a changed or revoked key is refused under every policy, an unknown one as the policy says."""
    path = known_hosts_path(ssh)
    name = known_hosts.host_name(address, port)
    key = HostKey(server_key.get_name(), server_key.asbytes())
    result = known_hosts.check(path, name, key)
    if result.verdict is Verdict.KNOWN:
        return
    if result.verdict is Verdict.REVOKED:
        raise RemoteError(host, f"{where}host key {key.key_type} {key.fingerprint} of {name} is marked "
                                f"@revoked in {path}; refusing to connect")
    if result.verdict is Verdict.CHANGED:
        on_file = ", ".join(f"{k.key_type} {k.fingerprint}" for k in result.known)
        raise RemoteError(host, (
            f"{where}host key CHANGED for {name}: the server offers {key.key_type} {key.fingerprint} "
            f"but {path} has {on_file}. This can be an attack (or a reinstalled host); refusing "
            f"under every policy. If the change is expected: ssh-keygen -f {path} -R '{name}'"))
    policy = ssh.strict_host_key_checking
    if policy is HostKeyPolicy.ACCEPT_NEW:
        try:
            known_hosts.add(path, name, key)
        except OSError as exc:
            raise RemoteError(host, f"{where}cannot add the host key of {name} to {path}: "
                                    f"{exc.strerror or exc}") from None
        return
    if policy is HostKeyPolicy.NO:
        return
    scan = f"ssh-keyscan -p {port} {address}" if port != 22 else f"ssh-keyscan {address}"
    raise RemoteError(host, (
        f"{where}unknown host key for {name}: {key.key_type} {key.fingerprint}. If this is the "
        f"right fingerprint, trust it with `{scan} >> {path}`, or set "
        f"strict_host_key_checking = \"accept-new\" in the [ssh] section of the cluster file"))


def authenticate(host: str, where: str, transport: paramiko.Transport, user: str, identity: str | None,
                 timeout: float) -> None:
    """Offer our keys in OpenSSH's order until the server accepts one; RemoteError listing every key
    tried (and why a key was skipped) when none is."""
    tried: list[str] = []
    for label, key in _candidate_keys(tried, identity):
        if not transport.is_active():
            break
        try:
            remaining = transport.auth_publickey(user, key)
        except paramiko.AuthenticationException:
            tried.append(label)
            continue
        except paramiko.SSHException as exc:
            raise RemoteError(host, f"{where}authentication as {user!r} did not finish within "
                                    f"{timeout:g} s ({exc})") from None
        if transport.is_authenticated():
            return
        tried.append(f"{label} (server wants more: {', '.join(remaining)})")
    raise RemoteError(host, (
        f"{where}authentication failed for user {user!r} (tried: {', '.join(tried) or 'no keys found'}). "
        "hgtrain uses keys only and never prompts: set identity_file, or load a key into ssh-agent"))


def _candidate_keys(tried: list[str], identity: str | None) -> Iterator[tuple[str, paramiko.PKey]]:
    """(label, key) in OpenSSH's order: the identity file, agent keys, default key files.
    Keys that cannot be used without a prompt are listed in ``tried`` and skipped."""
    paths = [identity] if identity else []
    for path in paths:
        yield from _key_file(path, tried, explicit=True)
    if os.environ.get("SSH_AUTH_SOCK"):
        try:
            agent_keys = paramiko.Agent().get_keys()
        except paramiko.SSHException:
            agent_keys = ()
        for key in agent_keys:
            yield f"agent key {known_hosts.fingerprint(key.asbytes())}", key
    for path in DEFAULT_KEYS:
        if path not in paths:
            yield from _key_file(path, tried, explicit=False)


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
