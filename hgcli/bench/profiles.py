"""Stored profiles (``clusters/<fingerprint>/profiles.json``): write, read, and notice when stale.

``plan`` reuses stored profiles instead of benching again, so it must know when they no longer
describe the cluster: another cluster, other devices, another torch or driver, another schema.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import StateError
from ..schema.stages import CPU, SCHEMA_VERSION, Device, Inventory, Profiles, from_dict, to_dict
from ..state import cluster_dir, read_json, write_json


def profiles_path(fingerprint: str) -> Path:
    return cluster_dir(fingerprint) / "profiles.json"


def store_profiles(profiles: Profiles) -> Path:
    path = profiles_path(profiles.cluster)
    write_json(path, to_dict(profiles))
    return path


def load_profiles(fingerprint: str) -> Profiles | None:
    """The stored profiles of that cluster, or None; an unreadable file is a StateError naming it."""
    path = profiles_path(fingerprint)
    data = read_json(path)
    if data is None:
        return None
    try:
        return from_dict(Profiles, data)
    except ValueError as exc:
        version = data.get("version") if isinstance(data, dict) else None
        if version != SCHEMA_VERSION:
            raise StateError(f"{path}: written with profile schema {version}, this hgtrain reads "
                             f"{SCHEMA_VERSION}; run 'hgtrain bench' again") from exc
        raise StateError(f"{path}: {exc}; run 'hgtrain bench' again") from exc


def same_torch(a: str, b: str) -> bool:
    """One torch build as two reports of it can differ: "2.11.0" (a stored inventory from an older
    probe, which read the install metadata) and "2.11.0+cu130" (torch.__version__) are the same
    build; two different local labels (+cu121 against +cpu) are not."""
    if a == b:
        return True
    (pa, _, la), (pb, _, lb) = a.partition("+"), b.partition("+")
    return pa == pb and not (la and lb)


def profile_is_stale(profiles: Profiles, inventory: Inventory) -> str | None:
    """Why ``profiles`` no longer describe the cluster of ``inventory``, or None when they still do."""
    if profiles.version != SCHEMA_VERSION:
        return f"profiles use schema {profiles.version}, this hgtrain uses {SCHEMA_VERSION}"
    if profiles.cluster != inventory.cluster:
        return f"profiles are of cluster {profiles.cluster}, the inventory of {inventory.cluster}"
    measured = {(d.node, d.device): d for d in profiles.devices}
    for node in inventory.succeeded:
        gpus = node.gpus or ()
        devices: list[tuple[Device, str | None, str | None]] = ([(Device.gpu(g.index), g.name, g.driver_version)
                                                                 for g in gpus] or [(CPU, None, None)])
        for device, name, driver in devices:
            profile = measured.get((node.name, device))
            where = f"{node.name}/{device}"
            if profile is None:
                return f"{where} has no profile"
            if name is not None and profile.name != name:
                return f"{where} was {profile.name!r}, is now {name!r}"
            if driver and profile.driver_version and profile.driver_version != driver:
                return f"{where} driver was {profile.driver_version}, is now {driver}"
            if node.torch_version and profile.torch_version and \
                    not same_torch(profile.torch_version, node.torch_version):
                return f"{node.name} torch was {profile.torch_version}, is now {node.torch_version}"
    return None
