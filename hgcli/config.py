"""Cluster file (TOML) -> Cluster, with file:line errors. Also the embedded default cluster.

Minimal first version: the foundation issue extends it (line numbers for every key, ~/.ssh/config,
hostfiles, Slurm node lists, file permission checks). The public API is ``load_cluster`` and
``default_cluster``; callers depend on nothing else.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .errors import ConfigError
from .model import Cluster, EmulateSpec, HostKeyPolicy, NodeSpec, SshSettings

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


def default_cluster() -> Cluster:
    """This machine alone: its GPUs, or on a machine without nvidia-smi an emulated set."""
    emulate = None if shutil.which("nvidia-smi") else DEFAULT_EMULATION
    return Cluster(nodes=(NodeSpec(name="local", host="localhost", emulate=emulate),), source=None)


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file: {exc.strerror}", source=str(path)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(exc), source=str(path)) from exc
    nodes = []
    defaults = data.get("defaults", {})
    for i, raw in enumerate(data.get("nodes", [])):
        merged = {**defaults, **raw}
        if "host" not in merged:
            raise ConfigError(f"nodes[{i}]: missing key 'host'", source=str(path))
        emulate = merged.pop("emulate", None)
        if emulate is not None:
            emulate = EmulateSpec(
                devices=tuple(emulate["devices"]),
                speed=tuple(float(s) for s in emulate["speed"]),
                memory_mib=tuple(int(m) for m in emulate["memory_mib"]),
            )
        gpus = merged.pop("gpus", None)
        nodes.append(NodeSpec(
            name=merged.pop("name", merged["host"]),
            gpus=tuple(gpus) if gpus is not None else None,
            emulate=emulate,
            source=f"{path}:nodes[{i}]",
            **merged,
        ))
    if not nodes:
        raise ConfigError("no [[nodes]] declared", source=str(path))
    return Cluster(nodes=tuple(nodes), ssh=_ssh_settings(data.get("ssh", {}), path), source=str(path))


def _ssh_settings(raw: dict, path: Path) -> SshSettings:
    """Minimal [ssh] reading (the full config issue adds line numbers and ~/.ssh/config)."""
    try:
        return SshSettings(**{**raw, "strict_host_key_checking": HostKeyPolicy(
            raw.get("strict_host_key_checking", SshSettings.strict_host_key_checking.value))})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[ssh]: {exc}", source=str(path)) from exc
