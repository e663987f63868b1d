"""What every stage's values stand on: the stored format's version, device names, read-only maps for
frozen fields, and the digest that names a cluster or a plan. Standard library only (shipped to nodes).
"""
from __future__ import annotations

import json
from types import MappingProxyType
from typing import Mapping, TypeVar

from . import codec

# Bumped when a stored JSON shape changes incompatibly; readers refuse other versions.
SCHEMA_VERSION = 1


class Device(str):
    """A device of a node, as profiles, plans and measured rates name it: ``gpuN`` is the node's CUDA
    device N, ``cpu`` its processor; other names are devices hgtrain does not run ranks on by index
    (an emulated local rank's ``emuN``, an imported profile's). A ``str``, so its JSON form and its
    comparisons are the name's; checked once, where it is made (a ``gpu`` name needs its index)."""

    def __new__(cls, name: str) -> Device:
        if not isinstance(name, str) or not name or (name.startswith("gpu") and not name[3:].isdigit()):
            raise ValueError(f"device must be gpuN, cpu or another non-empty name, got {name!r}")
        return super().__new__(cls, name)

    @classmethod
    def gpu(cls, index: int) -> Device:
        return cls(f"gpu{index}")

    @property
    def gpu_index(self) -> int | None:
        """N of ``gpuN``; None for every other device."""
        return int(self[3:]) if self.startswith("gpu") else None

    @property
    def is_gpu(self) -> bool:
        return self.startswith("gpu")


CPU = Device("cpu")


_K = TypeVar("_K")
_V = TypeVar("_V")


def frozen_map(value: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only copy of ``value`` for a frozen dataclass's field (one already read-only is kept)."""
    return value if isinstance(value, MappingProxyType) else MappingProxyType(dict(value))


def settle(obj: object, **values: object) -> None:
    """Set fields of a frozen dataclass in its ``__post_init__``: the typed form of what it was given."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def as_device(value: str) -> Device:
    """``value`` as a Device, parsed only if it is not one already (a dataclass built from plain text)."""
    return value if isinstance(value, Device) else Device(value)


def digest(value: object) -> str:
    """Stable short hash of a value's JSON form (cluster identity, plan identity)."""
    import hashlib  # here, not at the top: node programs import this module and never hash

    blob = json.dumps(codec.to_dict(value), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
