"""Reading a cluster file (TOML) or a hostfile into node declarations, and building the Cluster from
them (checked names, the controller's Python for this machine, ssh-config aliases resolved).
Host aliases are resolved through the user's ssh config (``remote/sshconfig.py``, imported only when
that file exists, because it brings in paramiko).
"""
from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..schema.names import RULE as NAME_RULE, valid_name
from ..schema.stages import Cluster, HostKeyPolicy, NodeSpec, SshSettings
from ..state.trusted import read_trusted_text
from .checks import NODE_CONVERTERS, KeyPath, SourceFile, check_keys, keyname, positive_number, show, string, table
from .nodelists import HostEntry, parse_hostfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT_KEYS = ("ssh", "defaults", "nodes", "hostfile")
SSH_KEYS = ("known_hosts", "strict_host_key_checking", "connect_timeout", "config")
NODE_KEYS = ("host", "name", "port", "user", "identity_file", "proxy_jump", "python", "gpus", "emulate")
PER_NODE_KEYS = ("host", "name")        # never in [defaults]: every node would get the same one
# Keys whose cluster-file value beats the ssh config's (as `ssh -o` beats ~/.ssh/config).
SSH_OVERRIDABLE = frozenset({"port", "user", "identity_file", "proxy_jump"})


@dataclass(frozen=True)
class NodeFields:
    """Node settings as [defaults] (or one [[nodes]] table) gives them, and which keys it wrote: a
    written key beats the ssh config's value."""

    fields: dict[str, Any] = field(default_factory=dict)   # NodeSpec keyword arguments
    explicit: frozenset[str] = frozenset()                  # keys written in the file


@dataclass(frozen=True)
class NodeDecl:
    """One node as declared, before ssh-config resolution."""

    fields: dict[str, Any]
    explicit: frozenset[str]
    source: str                    # "file:line", shown in errors about this node


@dataclass(frozen=True)
class FileSettings:
    """What a cluster file says: its [ssh] settings, its [defaults], and the nodes it declares (none
    when it only gives settings to another node source)."""

    file: "SourceFile"
    ssh: SshSettings
    defaults: NodeFields
    nodes: list[NodeDecl]


def read_cluster_file(path: Path) -> FileSettings:
    text = read_trusted_text(path, "cluster file", CLUSTER_STAKE)
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ConfigError("TOML nested too deeply to be a cluster file", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"at line (\d+)", str(exc))
        line = m.group(1) if m else max(1, len(text.splitlines()))   # "at end of document"
        raise ConfigError(f"TOML syntax error: {exc}", source=f"{path}:{line}") from exc
    except ValueError:              # Python's int() limit: a number of thousands of digits
        long = re.search(r"\d{4300,}", text)
        line = text.count("\n", 0, long.start()) + 1 if long else 1
        raise ConfigError("a number of more than 4,300 digits", source=f"{path}:{line}") from None
    f = SourceFile(path, text)
    check_keys(f, data, (), ROOT_KEYS, "the cluster file")
    ssh = _ssh_settings(f, table(f, data, ("ssh",)))
    defaults = _defaults(f, table(f, data, ("defaults",)))
    decls: list[NodeDecl] = []
    if "hostfile" in data:
        hostfile = Path(f.relative(string(f, data["hostfile"], ("hostfile",))))
        if not hostfile.is_file():
            raise f.error(("hostfile",), f"hostfile: {hostfile} is not a file")
        decls.extend(hostfile_decls(hostfile, defaults))
    nodes = data.get("nodes", [])
    if not isinstance(nodes, list):
        raise f.error(("nodes",), f"nodes: expected [[nodes]] tables, got {show(nodes)}")
    for i, raw in enumerate(nodes):
        decls.append(_node_decl(f, raw, ("nodes", i), defaults))
    return FileSettings(file=f, ssh=ssh, defaults=defaults, nodes=decls)


def settings_only(path: str | Path | None, node_source: str) -> FileSettings:
    """[ssh] and [defaults] of a cluster file used beside another node source."""
    if path is None:
        return FileSettings(file=SourceFile(Path("-"), ""), ssh=SshSettings(), defaults=NodeFields(), nodes=[])
    settings = read_cluster_file(Path(path))
    if settings.nodes:
        raise settings.file.error((), f"declares nodes, so {node_source} cannot add more: use one "
                                      "or the other")
    return settings


# Whoever can edit a cluster file or hostfile chooses the hosts hgtrain connects to with the user's
# keys and what it runs there (state/trusted.py).
CLUSTER_STAKE = "the hosts hgtrain connects to and what it runs there"


def hostfile_decls(path: Path, defaults: NodeFields) -> list[NodeDecl]:
    entries: list[HostEntry] = parse_hostfile(read_trusted_text(path, "hostfile", CLUSTER_STAKE), str(path))
    if not entries:
        raise ConfigError("the hostfile lists no hosts", source=str(path))
    return [NodeDecl(fields={**defaults.fields, "host": e.host, "slots": e.slots}, explicit=defaults.explicit,
                  source=f"{path}:{e.line}")
            for e in entries]


def _ssh_settings(f: SourceFile, raw: dict[str, Any]) -> SshSettings:
    check_keys(f, raw, ("ssh",), SSH_KEYS, "[ssh]")
    values: dict[str, Any] = {}
    for key in ("known_hosts", "config"):
        if key in raw:
            values[key] = f.relative(string(f, raw[key], ("ssh", key)))
    if "strict_host_key_checking" in raw:
        at = ("ssh", "strict_host_key_checking")
        value = raw["strict_host_key_checking"]
        allowed = [p.value for p in HostKeyPolicy]
        if not isinstance(value, str) or value not in allowed:
            raise f.error(at, f"{keyname(at)}: expected one of {', '.join(map(repr, allowed))}, "
                              f"got {show(value)}")
        values["strict_host_key_checking"] = HostKeyPolicy(value)
    if "connect_timeout" in raw:
        values["connect_timeout"] = positive_number(f, raw["connect_timeout"], ("ssh", "connect_timeout"))
    return SshSettings(**values)


def _defaults(f: SourceFile, raw: dict[str, Any]) -> NodeFields:
    for key in PER_NODE_KEYS:
        if key in raw:
            raise f.error(("defaults", key), f"{key!r} cannot be a default: each [[nodes]] sets its own")
    fields = _node_fields(f, raw, ("defaults",), "[defaults]")
    return NodeFields(fields=fields, explicit=frozenset(raw))


def _node_decl(f: SourceFile, raw: Any, at: KeyPath, defaults: NodeFields) -> NodeDecl:
    if not isinstance(raw, dict):
        raise f.error(at, f"{keyname(at)}: expected a [[nodes]] table, got {show(raw)}")
    own = _node_fields(f, raw, at, "[[nodes]]")
    if "host" not in own:
        raise f.error(at, f"{keyname(at)}: missing required key 'host'")
    fields = {**defaults.fields, **own}
    fields.setdefault("name", fields["host"])
    emulate, gpus = fields.get("emulate"), fields.get("gpus")
    if emulate is not None and gpus is not None:
        gpus_at = at + ("gpus",) if "gpus" in own else ("defaults", "gpus")
        for index in gpus:
            if index >= len(emulate.devices):
                raise f.error(gpus_at, f"{keyname(gpus_at)}: index {index} is not one of the "
                                       f"{len(emulate.devices)} emulated devices of node {fields['name']!r}")
    return NodeDecl(fields=fields, explicit=defaults.explicit | frozenset(raw), source=f.where(at))


def _node_fields(f: SourceFile, raw: dict[str, Any], at: KeyPath, label: str) -> dict[str, Any]:
    check_keys(f, raw, at, NODE_KEYS, label)
    return {key: NODE_CONVERTERS[key](f, value, at + (key,)) for key, value in raw.items()}


def finish(decls: list[NodeDecl], ssh: SshSettings, *, source: str) -> Cluster:
    first_seen: dict[str, str] = {}
    nodes = []
    for decl in decls:
        name = decl.fields.get("name", decl.fields["host"])
        if not valid_name(name):   # a host that is no valid name ("gpu:1", an IPv6 literal)
            raise ConfigError(f"node name {name!r} is not a valid name ({NAME_RULE}); give the node "
                              "a name = \"...\"", source=decl.source)
        if name in first_seen:
            raise ConfigError(f"duplicate node name {name!r} (first declared at {first_seen[name]}); "
                              "give one of them another name = \"...\"", source=decl.source)
        first_seen[name] = decl.source
        node = NodeSpec(**{**decl.fields, "name": name}, source=decl.source)
        if node.is_local and "python" not in decl.fields:
            # This machine: the Python hgtrain runs in has its dependencies; PATH's python3 may not.
            node = dataclasses.replace(node, python=sys.executable)
        nodes.append(node)
    return Cluster(nodes=tuple(_resolve_ssh_aliases(nodes, decls, ssh)), ssh=ssh, source=source)


def _resolve_ssh_aliases(nodes: list[NodeSpec], decls: list[NodeDecl], ssh: SshSettings) -> list[NodeSpec]:
    remote = [n for n in nodes if not n.is_local]
    if not remote:
        return nodes
    needs_jump = any(n.proxy_jump for n in remote)
    if not Path(ssh.config).expanduser().is_file() and not needs_jump:
        return nodes   # nothing to resolve: keep paramiko out of the import path
    from ..remote.sshconfig import load_ssh_config, resolve_node

    config = load_ssh_config(ssh.config)
    return [node if node.is_local else resolve_node(node, config, decl.explicit & SSH_OVERRIDABLE)
            for node, decl in zip(nodes, decls)]
