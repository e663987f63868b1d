"""~/.ssh/config for node hosts: HostName, User, Port, IdentityFile and ProxyJump of an alias.

Users already describe their cluster there (aliases, bastions); hgtrain honours it so a host that
works with ``ssh gpu1`` works in the cluster file. Values written in the cluster file win over the ssh
config, as a command-line ``-o`` wins in OpenSSH. paramiko's parser is used (no ``Include``), and only
the five keys above are applied. A host reached through ``ProxyCommand`` is refused with a message
rather than connected to directly: that would bypass the bastion the user configured. ProxyJump is
resolved here, hop by hop through the same config, into
``NodeSpec.jump`` so the transport can connect without reading the config again.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..schema.stages import NodeSpec
from ..schema.names import valid_host
from ..state.trusted import read_trusted_text
from .sshlib import paramiko

# OpenSSH has no hop limit; a chain longer than this is a loop or a mistake, refused with a message.
MAX_HOPS = 8

_PORT = re.compile(r"^\d{1,5}$")


@dataclass(frozen=True)
class HostConfig:
    """What the ssh config says about one alias (None: not set there)."""

    hostname: str | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    proxy_command: str | None = None   # never run (paramiko connects): a host that needs it is refused


@dataclass(frozen=True)
class Hop:
    """One element of a ProxyJump list, ``[user@]host[:port]`` or ``ssh://[user@]host[:port]``."""

    host: str
    user: str | None
    port: int | None


class SshConfig:
    """The user's ssh config file, read once, asked per host alias for the keys hgtrain applies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Whoever can write it chooses the hosts hgtrain connects to with the user's keys (its HostName,
        # ProxyJump): trusted as OpenSSH trusts it (StrictModes), or refused.
        text = read_trusted_text(path, "ssh config", "the hosts hgtrain connects to with your keys")
        try:
            self._config = paramiko.SSHConfig.from_text(text)
        except (paramiko.ConfigParseError, ValueError) as exc:
            raise ConfigError(f"cannot read ssh config: {exc}", source=str(path)) from exc

    def lookup(self, alias: str) -> HostConfig:
        try:
            found = self._config.lookup(alias)
        # paramiko raises assorted errors for Match/token problems; each is this file's fault.
        except Exception as exc:
            raise ConfigError(f"ssh config for host {alias!r}: {exc}", source=str(self.path)) from exc
        hostname = found.get("hostname")
        port = found.get("port")
        if port is not None and (not _PORT.match(port) or not 0 < int(port) < 65536):
            raise ConfigError(f"host {alias!r}: Port {port!r} is not a port number", source=str(self.path))
        identity = found.get("identityfile") or [None]
        jump = found.get("proxyjump")
        command = found.get("proxycommand")
        return HostConfig(
            hostname=hostname if hostname and hostname != alias else None,
            port=int(port) if port is not None else None,
            user=found.get("user"),
            identity_file=identity[0],
            proxy_jump=None if jump is None or jump.lower() == "none" else jump,
            proxy_command=None if command is None or command.lower() == "none" else command,
        )


def load_ssh_config(path: str | Path) -> SshConfig | None:
    """The parsed config, or None when the file does not exist (no ssh config is fine)."""
    path = Path(path).expanduser()
    return SshConfig(path) if path.is_file() else None


def parse_jump(spec: str, where: str) -> list[Hop]:
    """A ProxyJump value -> hops, first hop first."""
    hops = []
    for text in spec.split(","):
        hops.append(_parse_hop(text.strip(), spec, where))
    return hops


def _parse_hop(text: str, spec: str, where: str) -> Hop:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"ProxyJump {spec!r}: {why}", source=where)

    if text.startswith("ssh://"):
        text = text[len("ssh://"):].rstrip("/")
    user, at, hostport = text.rpartition("@")
    if at and not user:
        raise bad(f"empty user in {text!r}")
    port: str | None = None
    if hostport.startswith("["):          # [IPv6]:port
        host, _, rest = hostport[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise bad(f"cannot read {text!r}")
            port = rest[1:]
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    else:
        host = hostport
    if not host or not valid_host(host):
        raise bad(f"{host!r} is not a host name")
    if port is not None and (not _PORT.match(port) or not 0 < int(port) < 65536):
        raise bad(f"{port!r} is not a port number")
    return Hop(host=host, user=user or None, port=int(port) if port is not None else None)


def resolve_node(node: NodeSpec, config: SshConfig | None, explicit: frozenset[str]) -> NodeSpec:
    """``node`` with its alias resolved; fields named in ``explicit`` (set in the cluster file) win."""
    found = config.lookup(node.host) if config is not None else HostConfig()
    changes: dict[str, Any] = {"hostname": node.hostname or found.hostname}
    if "port" not in explicit and found.port is not None:
        changes["port"] = found.port
    if "user" not in explicit and found.user is not None:
        changes["user"] = found.user
    if "identity_file" not in explicit and found.identity_file is not None:
        changes["identity_file"] = found.identity_file
    proxy_jump = node.proxy_jump if "proxy_jump" in explicit else found.proxy_jump
    if proxy_jump is not None and proxy_jump.lower() == "none":
        proxy_jump = None
    changes["proxy_jump"] = proxy_jump
    where = node.source or node.name
    if "proxy_jump" not in explicit:   # proxy_jump in the cluster file (even "none") replaces it
        _refuse_proxy_command(node.host, found, config, where)
    changes["jump"] = _resolve_chain(proxy_jump, config, where, seen=(node.host,)) if proxy_jump else None
    return dataclasses.replace(node, **changes)


def _resolve_chain(spec: str, config: SshConfig | None, where: str, seen: tuple[str, ...]) -> NodeSpec:
    """The last hop of ``spec`` as a NodeSpec whose ``jump`` is the hop before it; the first hop
    keeps its own ProxyJump from the ssh config (as OpenSSH does when it connects to that hop)."""
    hops = parse_jump(spec, where)
    previous: NodeSpec | None = None
    for position, hop in enumerate(hops):
        chain = seen + tuple(h.host for h in hops[:position])
        if hop.host in chain or len(chain) >= MAX_HOPS:
            raise ConfigError(
                f"ProxyJump loops or is longer than {MAX_HOPS} hops: {' -> '.join(chain + (hop.host,))}",
                source=where)
        found = config.lookup(hop.host) if config is not None else HostConfig()
        if position == 0 and found.proxy_jump:
            previous = _resolve_chain(found.proxy_jump, config, where, seen=chain + (hop.host,))
        elif position == 0:
            _refuse_proxy_command(hop.host, found, config, where)
        previous = NodeSpec(
            name=hop.host,
            host=hop.host,
            hostname=found.hostname,
            port=hop.port or found.port or 22,
            user=hop.user or found.user,
            identity_file=found.identity_file,
            proxy_jump=found.proxy_jump if position == 0 else None,
            jump=previous,
            source=where,
        )
    if previous is None:
        raise ConfigError(f"ProxyJump {spec!r} names no host", source=where)
    return previous


def _refuse_proxy_command(host: str, found: HostConfig, config: SshConfig | None, where: str) -> None:
    """hgtrain cannot run a ProxyCommand; connecting straight to the host instead would silently
    bypass the bastion (or tunnel) the user put in front of it."""
    if found.proxy_command is None or config is None:
        return
    raise ConfigError(f"host {host!r} is reached through ProxyCommand {found.proxy_command!r} in "
                      f"{config.path}, which hgtrain cannot run (it connects with paramiko) and will not "
                      "bypass: write the bastion as ProxyJump there, or proxy_jump = \"[user@]bastion\" "
                      "for this node in the cluster file", source=where)
