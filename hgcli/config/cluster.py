"""Cluster file (TOML), hostfile or Slurm node list -> Cluster; every error names file:LINE and key.

Everything is checked before anything is contacted: a typo costs an exit code 2 and one line naming
the file, the line and the key (with the closest known key for a misspelling), never a half-run
probe. ``docs/cluster-file.md`` is the reference of every key and of the node sources. Host aliases
are resolved through the user's ssh config (``remote/sshconfig.py``, imported only when that file
exists, because it brings in paramiko).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from ..schema.names import RULE as NAME_RULE, valid_host, valid_name
from ..schema.stages import Cluster, EmulateSpec, HostKeyPolicy, NodeSpec, Slowdown, SshSettings
from .nodelists import HostEntry, expand_nodelist, parse_hostfile
from . import slurm
from .slurm import allocation_nodelist
from .tomllines import TomlLines

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The emulated set the default local cluster uses on a machine without GPUs: two fast and two slow
# devices, the shape of the lab clusters hgtrain is for. Labelled emulated in every output.
DEFAULT_EMULATION = EmulateSpec(
    devices=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "Tesla T4", "Tesla T4"),
    speed=(1.0, 1.0, 0.25, 0.25),
    memory_mib=(40960, 40960, 15360, 15360),
)

SLURM_SOURCE = "SLURM_JOB_NODELIST"

ROOT_KEYS = ("ssh", "defaults", "nodes", "hostfile")
SSH_KEYS = ("known_hosts", "strict_host_key_checking", "connect_timeout", "config")
MAX_EMULATED = 1024       # emulated devices per node: their names travel on the probe's command line
NODE_KEYS = ("host", "name", "port", "user", "identity_file", "proxy_jump", "python", "gpus", "emulate")
PER_NODE_KEYS = ("host", "name")        # never in [defaults]: every node would get the same one
EMULATE_KEYS = ("devices", "speed", "memory_mib", "slowdown")
EMULATE_REQUIRED = EMULATE_KEYS[:3]
# Keys whose cluster-file value beats the ssh config's (as `ssh -o` beats ~/.ssh/config).
SSH_OVERRIDABLE = frozenset({"port", "user", "identity_file", "proxy_jump"})

KeyPath = tuple[str | int, ...]


def default_cluster(nproc_per_node: int | None = None) -> Cluster:
    """This machine alone: its GPUs, or on a machine without nvidia-smi an emulated set. Its Python is
    the controller's own (where hgtrain and its dependencies are installed, a virtual environment
    say), not whichever ``python3`` comes first on PATH.

    ``nproc_per_node`` (``--nproc-per-node N``, as torchrun users type it): the first N GPUs, or on a
    machine without GPUs N identical emulated devices (the fast device of the default set), so a
    2-rank script needs no cluster file."""
    gpus, emulate = nproc_devices(nproc_per_node)
    node = NodeSpec(name="local", host="localhost", python=sys.executable, gpus=gpus, emulate=emulate)
    return Cluster(nodes=(node,), source=None)


def nproc_devices(nproc_per_node: int | None) -> tuple[tuple[int, ...] | None, EmulateSpec | None]:
    """A node's ``gpus`` and ``emulate`` for ``--nproc-per-node`` (None: all GPUs, or the default
    emulated set without them). GPUs or emulation is this machine's choice: with nvidia-smi here,
    the first N GPUs of every node, else N emulated devices."""
    has_gpus = bool(shutil.which("nvidia-smi"))
    if nproc_per_node is None:
        return None, None if has_gpus else sized_to_cores(DEFAULT_EMULATION)
    if nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    if has_gpus:
        return tuple(range(nproc_per_node)), None
    return None, sized_to_cores(EmulateSpec(devices=DEFAULT_EMULATION.devices[:1] * nproc_per_node,
                                            speed=DEFAULT_EMULATION.speed[:1] * nproc_per_node,
                                            memory_mib=DEFAULT_EMULATION.memory_mib[:1] * nproc_per_node))


def sized_to_cores(spec: EmulateSpec, cores: int | None = None) -> EmulateSpec:
    """The embedded cluster's emulated devices, their speeds scaled (same ratios) so that together
    they ask at most half of this machine's ``cores``: an emulated device of speed s computes on
    the CPU for s of its step, and devices that together ask more CPU than the machine has measure
    how the machine shares its cores, not the plan. The other half runs what a real GPU node runs
    on its CPU: the script's data loaders, the PS, hgtrain. On 2 cores the default set's A100s run
    at 0.4 and its T4s at 0.1; on 5 cores or more it is as declared."""
    cores = cores or len(os.sched_getaffinity(0))
    scale = min(1.0, cores / 2 / sum(spec.speed))
    if scale >= 1.0:
        return spec
    return dataclasses.replace(spec, speed=tuple(round(s * scale, 4) for s in spec.speed))


def load_cluster(path: str | Path) -> Cluster:
    """A cluster file that declares its nodes ([[nodes]] and/or ``hostfile = "..."``)."""
    settings = _read_cluster_file(Path(path))
    if not settings.nodes:
        raise settings.file.error((), "no nodes declared: add [[nodes]] tables or hostfile = \"...\"")
    return _finish(settings.nodes, settings.ssh, source=str(settings.file.path))


def load_hostfile(path: str | Path, *, settings_from: str | Path | None = None) -> Cluster:
    """A DeepSpeed/MPI hostfile (``host slots=N``); [ssh] and [defaults] from ``settings_from``."""
    settings = _settings_only(settings_from, "--hostfile")
    decls = _hostfile_decls(Path(path), settings.defaults)
    return _finish(decls, settings.ssh, source=str(path))


def cluster_from_slurm(nodelist: str, *, settings_from: str | Path | None = None,
                       nproc_per_node: int | None = None, python: str | None = None) -> Cluster:
    """The hosts of a Slurm allocation (``SLURM_JOB_NODELIST``, bracket ranges expanded).

    ``nproc_per_node``: every node's devices (``nproc_devices``), unless [defaults] declares them;
    ``python``: every node's Python unless [defaults] declares one (srun: the controller's own, on
    the file system the allocation shares)."""
    settings = _settings_only(settings_from, SLURM_SOURCE)
    fields = dict(settings.defaults.fields)
    if nproc_per_node is not None and not {"gpus", "emulate"} & settings.defaults.explicit:
        gpus, emulate = nproc_devices(nproc_per_node)
        fields.update(gpus=gpus, emulate=emulate)
    if python is not None and "python" not in settings.defaults.explicit:
        fields["python"] = python
    decls = [_Decl(fields={**fields, "host": host}, explicit=settings.defaults.explicit,
                   source=f"{SLURM_SOURCE}:{host}")
             for host in expand_nodelist(nodelist, SLURM_SOURCE)]
    return _finish(decls, settings.ssh, source=SLURM_SOURCE)


def load_node_source(cluster_file: str | Path | None = None, *, hostfile: str | Path | None = None,
                     environ: Mapping[str, str] | None = None, nproc_per_node: int | None = None,
                     transport: str = "ssh") -> Cluster:
    """The cluster a command works on. Nodes come from exactly one source, the first that applies:

    1. the cluster file, when it declares nodes (then ``hostfile`` must not be given as well);
    2. ``hostfile``; 3. ``SLURM_JOB_NODELIST`` in ``environ`` (inside a Slurm allocation);
    4. without a cluster file, the embedded local cluster.
    For 2 and 3 a cluster file that declares no nodes supplies [ssh] and [defaults].
    ``nproc_per_node`` sizes the embedded cluster and every node of a Slurm allocation: a declared
    node says its devices itself. ``transport`` (config/slurm.py): how the nodes are reached.
    """
    environ = os.environ if environ is None else environ
    srun = slurm.wanted(transport, environ)
    if nproc_per_node is not None and not nproc_applies(cluster_file, hostfile, environ):
        raise ConfigError("nproc_per_node sizes the embedded local cluster and a Slurm allocation's "
                          "nodes only; a declared node chooses its devices with gpus = [...] (or emulate) "
                          "in the cluster file", source=str(cluster_file or hostfile))
    cluster = _declared_nodes(cluster_file, hostfile, environ, nproc_per_node, srun is not None)
    if srun is None:
        return cluster
    return slurm.reach_by_srun(cluster, srun, environ, required=transport == "srun")


def nproc_applies(cluster_file: str | Path | None, hostfile: str | Path | None, environ: Mapping[str, str]) -> bool:
    """Whether ``nproc_per_node`` can size the nodes: those of the embedded local cluster or of a
    Slurm allocation (a cluster file without nodes may give their settings), not a file's own."""
    from_slurm = bool(allocation_nodelist(environ)) and hostfile is None
    return hostfile is None and (cluster_file is None or from_slurm)


def _declared_nodes(cluster_file: str | Path | None, hostfile: str | Path | None, environ: Mapping[str, str],
                    nproc_per_node: int | None, by_srun: bool) -> Cluster:
    if cluster_file is not None:
        settings = _read_cluster_file(Path(cluster_file))
        if settings.nodes:
            if hostfile is not None:
                raise settings.file.error(
                    (), "declares nodes, so a hostfile cannot add more: use one or the other")
            if nproc_per_node is not None:
                raise settings.file.error(
                    (), "declares nodes, so nproc_per_node cannot size them: a declared node chooses "
                        "its devices with gpus = [...] (or emulate)")
            return _finish(settings.nodes, settings.ssh, source=str(settings.file.path))
    if hostfile is not None:
        return load_hostfile(hostfile, settings_from=cluster_file)
    nodelist = allocation_nodelist(environ)
    if nodelist:
        return cluster_from_slurm(nodelist, settings_from=cluster_file, nproc_per_node=nproc_per_node,
                                  python=sys.executable if by_srun else None)
    if cluster_file is not None:
        raise ConfigError("no nodes declared: add [[nodes]] tables or hostfile = \"...\", or pass "
                          "--hostfile", source=str(cluster_file))
    return default_cluster(nproc_per_node)


# ---------------------------------------------------------------------------------------------
# Reading a cluster file
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Fields:
    fields: dict[str, Any] = field(default_factory=dict)   # NodeSpec keyword arguments
    explicit: frozenset[str] = frozenset()                  # keys written in the file


@dataclass(frozen=True)
class _Decl:
    """One node as declared, before ssh-config resolution."""

    fields: dict[str, Any]
    explicit: frozenset[str]
    source: str                    # "file:line", shown in errors about this node


@dataclass(frozen=True)
class _Settings:
    file: "_File"
    ssh: SshSettings
    defaults: _Fields
    nodes: list[_Decl]


class _File:
    """A file being read: its path, where its keys are, and errors naming file:LINE."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = TomlLines(text)

    def where(self, at: KeyPath) -> str:
        return f"{self.path}:{self.lines.line(at)}"

    def error(self, at: KeyPath, message: str) -> ConfigError:
        return ConfigError(message, source=self.where(at))

    def relative(self, value: str) -> str:
        """Paths in the file are relative to the file, so it works from any directory."""
        expanded = Path(value).expanduser()
        return str(expanded if expanded.is_absolute() else (self.path.parent / expanded).resolve())


def _read_cluster_file(path: Path) -> _Settings:
    text = _read_private_text(path, "cluster file")
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ConfigError("TOML nested too deeply to be a cluster file", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"at line (\d+)", str(exc))
        line = m.group(1) if m else max(1, len(text.splitlines()))   # "at end of document"
        raise ConfigError(f"TOML syntax error: {exc}", source=f"{path}:{line}") from exc
    f = _File(path, text)
    _check_keys(f, data, (), ROOT_KEYS, "the cluster file")
    ssh = _ssh_settings(f, _table(f, data, ("ssh",)))
    defaults = _defaults(f, _table(f, data, ("defaults",)))
    decls: list[_Decl] = []
    if "hostfile" in data:
        hostfile = Path(f.relative(_string(f, data["hostfile"], ("hostfile",))))
        if not hostfile.is_file():
            raise f.error(("hostfile",), f"hostfile: {hostfile} is not a file")
        decls.extend(_hostfile_decls(hostfile, defaults))
    nodes = data.get("nodes", [])
    if not isinstance(nodes, list):
        raise f.error(("nodes",), f"nodes: expected [[nodes]] tables, got {_show(nodes)}")
    for i, raw in enumerate(nodes):
        decls.append(_node_decl(f, raw, ("nodes", i), defaults))
    return _Settings(file=f, ssh=ssh, defaults=defaults, nodes=decls)


def _settings_only(path: str | Path | None, node_source: str) -> _Settings:
    """[ssh] and [defaults] of a cluster file used beside another node source."""
    if path is None:
        return _Settings(file=_File(Path("-"), ""), ssh=SshSettings(), defaults=_Fields(), nodes=[])
    settings = _read_cluster_file(Path(path))
    if settings.nodes:
        raise settings.file.error((), f"declares nodes, so {node_source} cannot add more: use one "
                                      "or the other")
    return settings


def _read_private_text(path: Path, what: str) -> str:
    """The file's text, refused when others could have written it: whoever can edit a cluster file
    chooses the hosts hgtrain connects to with the user's keys and what it runs there."""
    try:
        st = path.stat()
        parent = path.resolve().parent.stat()
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", source=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text: {exc.reason}", source=str(path)) from exc
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"refusing a {what} owned by another user (uid {st.st_uid}): whoever owns it "
                          "chooses the hosts hgtrain connects to and what it runs there; use a copy of "
                          "your own", source=str(path))
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "world" if st.st_mode & stat.S_IWOTH else "group"
        raise ConfigError(f"refusing a {who}-writable {what}: others could choose the hosts hgtrain "
                          f"connects to; run: chmod go-w {path}", source=str(path))
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        raise ConfigError(f"refusing a {what} in a world-writable directory ({path.resolve().parent}) "
                          "without the sticky bit: anyone could replace it", source=str(path))
    return text


def _hostfile_decls(path: Path, defaults: _Fields) -> list[_Decl]:
    entries: list[HostEntry] = parse_hostfile(_read_private_text(path, "hostfile"), str(path))
    if not entries:
        raise ConfigError("the hostfile lists no hosts", source=str(path))
    return [_Decl(fields={**defaults.fields, "host": e.host, "slots": e.slots}, explicit=defaults.explicit,
                  source=f"{path}:{e.line}")
            for e in entries]


def _ssh_settings(f: _File, raw: dict[str, Any]) -> SshSettings:
    _check_keys(f, raw, ("ssh",), SSH_KEYS, "[ssh]")
    values: dict[str, Any] = {}
    for key in ("known_hosts", "config"):
        if key in raw:
            values[key] = f.relative(_string(f, raw[key], ("ssh", key)))
    if "strict_host_key_checking" in raw:
        at = ("ssh", "strict_host_key_checking")
        value = raw["strict_host_key_checking"]
        allowed = [p.value for p in HostKeyPolicy]
        if not isinstance(value, str) or value not in allowed:
            raise f.error(at, f"{_keyname(at)}: expected one of {', '.join(map(repr, allowed))}, "
                              f"got {_show(value)}")
        values["strict_host_key_checking"] = HostKeyPolicy(value)
    if "connect_timeout" in raw:
        values["connect_timeout"] = _positive_number(f, raw["connect_timeout"], ("ssh", "connect_timeout"))
    return SshSettings(**values)


def _defaults(f: _File, raw: dict[str, Any]) -> _Fields:
    for key in PER_NODE_KEYS:
        if key in raw:
            raise f.error(("defaults", key), f"{key!r} cannot be a default: each [[nodes]] sets its own")
    fields = _node_fields(f, raw, ("defaults",), "[defaults]")
    return _Fields(fields=fields, explicit=frozenset(raw))


def _node_decl(f: _File, raw: Any, at: KeyPath, defaults: _Fields) -> _Decl:
    if not isinstance(raw, dict):
        raise f.error(at, f"{_keyname(at)}: expected a [[nodes]] table, got {_show(raw)}")
    own = _node_fields(f, raw, at, "[[nodes]]")
    if "host" not in own:
        raise f.error(at, f"{_keyname(at)}: missing required key 'host'")
    fields = {**defaults.fields, **own}
    fields.setdefault("name", fields["host"])
    emulate, gpus = fields.get("emulate"), fields.get("gpus")
    if emulate is not None and gpus is not None:
        gpus_at = at + ("gpus",) if "gpus" in own else ("defaults", "gpus")
        for index in gpus:
            if index >= len(emulate.devices):
                raise f.error(gpus_at, f"{_keyname(gpus_at)}: index {index} is not one of the "
                                       f"{len(emulate.devices)} emulated devices of node {fields['name']!r}")
    return _Decl(fields=fields, explicit=defaults.explicit | frozenset(raw), source=f.where(at))


def _node_fields(f: _File, raw: dict[str, Any], at: KeyPath, label: str) -> dict[str, Any]:
    _check_keys(f, raw, at, NODE_KEYS, label)
    return {key: _NODE_CONVERTERS[key](f, value, at + (key,)) for key, value in raw.items()}


# ---------------------------------------------------------------------------------------------
# Building the Cluster
# ---------------------------------------------------------------------------------------------

def _finish(decls: list[_Decl], ssh: SshSettings, *, source: str) -> Cluster:
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


def _resolve_ssh_aliases(nodes: list[NodeSpec], decls: list[_Decl], ssh: SshSettings) -> list[NodeSpec]:
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


# ---------------------------------------------------------------------------------------------
# Value checks (each raises a ConfigError naming file:LINE and the key)
# ---------------------------------------------------------------------------------------------

def _keyname(at: KeyPath) -> str:
    """("nodes", 2, "port") -> "nodes[2].port"."""
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _show(value: Any) -> str:
    """A value as the user wrote it in TOML, or its kind for tables and lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _check_keys(f: _File, raw: dict[str, Any], at: KeyPath, known: tuple[str, ...], label: str) -> None:
    for key in raw:
        if key not in known:
            import difflib   # only for the error: every launch reads a cluster file

            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise f.error(at + (key,), f"unknown key {key!r} in {label} ({hint})")


def _table(f: _File, data: dict[str, Any], at: KeyPath) -> dict[str, Any]:
    value = data.get(str(at[-1]), {})
    if not isinstance(value, dict):
        raise f.error(at, f"{_keyname(at)}: expected a table [{_keyname(at)}], got {_show(value)}")
    return value


def _string(f: _File, value: Any, at: KeyPath) -> str:
    if not isinstance(value, str) or not value.strip():
        raise f.error(at, f"{_keyname(at)}: expected a non-empty string, got {_show(value)}")
    return value


def _integer(f: _File, value: Any, at: KeyPath, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise f.error(at, f"{_keyname(at)}: expected an integer from {lo} to {hi}, got {_show(value)}")
    return value


def _positive_number(f: _File, value: Any, at: KeyPath) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise f.error(at, f"{_keyname(at)}: expected a number greater than 0, got {_show(value)}")
    return float(value)


def _list(f: _File, value: Any, at: KeyPath, item: Callable[[Any, KeyPath], Any]) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise f.error(at, f"{_keyname(at)}: expected a list, got {_show(value)}")
    return tuple(item(v, at) for v in value)


def _host(f: _File, value: Any, at: KeyPath) -> str:
    host = _string(f, value, at)
    if not valid_host(host):
        raise f.error(at, f"{_keyname(at)}: {host!r} is not a host name or ssh alias")
    return host


def _name(f: _File, value: Any, at: KeyPath) -> str:
    name = _string(f, value, at)
    if not valid_name(name):   # the node agent checks the same pattern (job directories, arguments)
        raise f.error(at, f"{_keyname(at)}: {name!r} is not a valid node name ({NAME_RULE})")
    return name


def _user(f: _File, value: Any, at: KeyPath) -> str:
    user = _string(f, value, at)
    if re.search(r"\s", user) or user.startswith("-"):
        raise f.error(at, f"{_keyname(at)}: {user!r} is not a user name")
    return user


def _gpus(f: _File, value: Any, at: KeyPath) -> tuple[int, ...]:
    gpus = _list(f, value, at, lambda v, a: _integer(f, v, a, 0, 1023))
    if len(set(gpus)) != len(gpus):
        raise f.error(at, f"{_keyname(at)}: an index is listed twice in {list(gpus)}")
    return gpus


def _emulate(f: _File, value: Any, at: KeyPath) -> EmulateSpec:
    if not isinstance(value, dict):
        raise f.error(at, f"{_keyname(at)}: expected a table like {{ devices = [...], speed = [...], "
                          f"memory_mib = [...] }}, got {_show(value)}")
    _check_keys(f, value, at, EMULATE_KEYS, _keyname(at))
    for key in EMULATE_REQUIRED:
        if key not in value:
            raise f.error(at, f"{_keyname(at)}: missing key {key!r} (emulate needs devices, speed "
                              "and memory_mib, one entry per device)")
    devices = _list(f, value["devices"], at + ("devices",), lambda v, a: _string(f, v, a))
    speed = _list(f, value["speed"], at + ("speed",), lambda v, a: _positive_number(f, v, a))
    memory = _list(f, value["memory_mib"], at + ("memory_mib",), lambda v, a: _integer(f, v, a, 1, 1 << 30))
    if not devices:
        raise f.error(at + ("devices",), f"{_keyname(at)}.devices: declare at least one device")
    if len(devices) > MAX_EMULATED:
        raise f.error(at + ("devices",), f"{_keyname(at)}.devices: {len(devices)} devices, more than the "
                                         f"{MAX_EMULATED} one node may emulate")
    for key, values in (("speed", speed), ("memory_mib", memory)):
        if len(values) != len(devices):
            entries = "entry" if len(values) == 1 else "entries"
            raise f.error(at + (key,), f"{_keyname(at)}.{key} has {len(values)} {entries} for "
                                       f"{len(devices)} devices: give one per device")
    slowdown = _slowdowns(f, value.get("slowdown", []), at + ("slowdown",), len(devices))
    return EmulateSpec(devices=devices, speed=speed, memory_mib=memory, slowdown=slowdown)


def _slowdowns(f: _File, value: Any, at: KeyPath, devices: int) -> tuple[Slowdown, ...]:
    """``slowdown = [[DEVICE_INDEX, AFTER_SECONDS, FACTOR], ...]``: FACTOR >= 1 divides the device's
    speed from AFTER_SECONDS on (1: its declared speed again, a recovery)."""
    def entry(item: Any, where: KeyPath) -> Slowdown:
        if (not isinstance(item, list) or len(item) != 3
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in item)):
            shown = json.dumps(item) if isinstance(item, list) else _show(item)
            raise f.error(where, f"{_keyname(where)}: each entry is [DEVICE_INDEX, AFTER_SECONDS, FACTOR], "
                                 f"got {shown}")
        index, after, factor = item
        if not isinstance(index, int) or not 0 <= index < devices:
            raise f.error(where, f"{_keyname(where)}: device index {_show(index)} is not one of the "
                                 f"{devices} emulated devices (0 to {devices - 1})")
        if not (math.isfinite(after) and after >= 0):
            raise f.error(where, f"{_keyname(where)}: AFTER_SECONDS must be a number >= 0, got {_show(after)}")
        if not (math.isfinite(factor) and factor >= 1):
            raise f.error(where, f"{_keyname(where)}: FACTOR must be a number >= 1 (the speed is divided "
                                 f"by it; 1 restores it), got {_show(factor)}")
        return Slowdown(device=index, after_s=float(after), factor=float(factor))

    if not isinstance(value, list):
        raise f.error(at, f"{_keyname(at)}: expected a list like [[0, 60, 4]], got {_show(value)}")
    return tuple(entry(item, at + (k,)) for k, item in enumerate(value))


_NODE_CONVERTERS: dict[str, Callable[[_File, Any, KeyPath], Any]] = {
    "host": _host,
    "name": _name,
    "port": lambda f, v, at: _integer(f, v, at, 1, 65535),
    "user": _user,
    "identity_file": lambda f, v, at: f.relative(_string(f, v, at)),
    "proxy_jump": _string,
    "python": _string,
    "gpus": _gpus,
    "emulate": _emulate,
}
