"""The I/O around the pure planner: its stored inputs, and plan files users write and launch from."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from . import state
from .errors import ConfigError, StateError, UsageError
from .model import SCHEMA_VERSION, Cluster, Inventory, Plan, Profiles, from_dict, to_json

T = TypeVar("T")


def stored_inputs(cluster: Cluster) -> tuple[Inventory, Profiles]:
    """The inventory and profiles stored for this cluster.

    For now a missing one is an error telling the user which stage to run; this is the one place to
    swap for an automatic quick probe/bench.
    """
    folder = state.cluster_dir(cluster.fingerprint())
    where = f" -c {cluster.source}" if cluster.source else ""
    inventory = _stored(folder / "inventory.json", Inventory)
    if inventory is None:
        raise UsageError(f"no stored inventory for this cluster: run 'hgtrain probe{where}' first")
    profiles = _stored(folder / "profiles.json", Profiles)
    if profiles is None:
        raise UsageError(f"no stored profiles for this cluster: run 'hgtrain bench{where}' first")
    return inventory, profiles


def _stored(path: Path, cls: type[T]) -> T | None:
    data = state.read_json(path)
    if data is None:
        return None
    try:
        return from_dict(cls, data)
    except (ValueError, TypeError) as exc:
        raise StateError(f"{path}: {exc}; run the stage that writes it again") from exc


def write_plan(path: Path, plan: Plan) -> None:
    """Write a plan file atomically. It is the user's file, not state: mode 0644 like any output."""
    try:
        state.atomic_write(path, to_json(plan) + "\n", mode=0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write plan file: {exc.strerror or exc}", source=str(path)) from exc


def load_plan(path: Path, cluster: Cluster) -> Plan:
    """A plan file made for this cluster; anything else is a ConfigError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read plan file: {exc.strerror or exc}", source=str(path)) from exc
    except ValueError as exc:
        raise ConfigError(f"not a JSON plan file: {exc}", source=str(path)) from exc
    if isinstance(data, dict) and data.get("version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ConfigError(f"plan format version {data.get('version')!r}, this hgtrain reads "
                          f"{SCHEMA_VERSION}; run 'hgtrain plan' again", source=str(path))
    try:
        plan = from_dict(Plan, data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a valid plan: {exc}", source=str(path)) from exc
    if plan.cluster != cluster.fingerprint():
        raise ConfigError(f"this plan was made for cluster {plan.cluster}, not this cluster "
                          f"({cluster.fingerprint()}); run 'hgtrain plan' for it", source=str(path))
    return plan
