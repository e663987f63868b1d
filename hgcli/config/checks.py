"""The cluster file's value checks: each raises a ConfigError naming file:LINE and the key (with the
closest known key for a misspelling); and the file being read (``SourceFile``), which knows where its keys are.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..schema.names import RULE as NAME_RULE, valid_host, valid_name
from ..schema.stages import EmulateSpec, Slowdown
from .tomllines import TomlLines

MAX_EMULATED = 1024       # emulated devices per node: their names travel on the probe's command line
EMULATE_KEYS = ("devices", "speed", "memory_mib", "slowdown")
EMULATE_REQUIRED = EMULATE_KEYS[:3]

KeyPath = tuple[str | int, ...]


class SourceFile:
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


def keyname(at: KeyPath) -> str:
    """("nodes", 2, "port") -> "nodes[2].port"."""
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def show(value: Any) -> str:
    """A value as the user wrote it in TOML, or its kind for tables and lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int) and not -10 ** 30 < value < 10 ** 30:
        return f"a number of {len(str(abs(value)))} digits"     # one line, not a screenful of zeros
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def check_keys(f: SourceFile, raw: dict[str, Any], at: KeyPath, known: tuple[str, ...], label: str) -> None:
    for key in raw:
        if key not in known:
            import difflib   # only for the error: every launch reads a cluster file

            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise f.error(at + (key,), f"unknown key {key!r} in {label} ({hint})")


def table(f: SourceFile, data: dict[str, Any], at: KeyPath) -> dict[str, Any]:
    value = data.get(str(at[-1]), {})
    if not isinstance(value, dict):
        raise f.error(at, f"{keyname(at)}: expected a table [{keyname(at)}], got {show(value)}")
    return value


def string(f: SourceFile, value: Any, at: KeyPath) -> str:
    if not isinstance(value, str) or not value.strip():
        raise f.error(at, f"{keyname(at)}: expected a non-empty string, got {show(value)}")
    return value


def _integer(f: SourceFile, value: Any, at: KeyPath, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise f.error(at, f"{keyname(at)}: expected an integer from {lo} to {hi}, got {show(value)}")
    return value


def finite(value: int | float) -> bool:
    """A number a float holds: math.isfinite(10**400) raises OverflowError instead of saying no."""
    return abs(value) < 2 ** 63 if isinstance(value, int) else math.isfinite(value)


def positive_number(f: SourceFile, value: Any, at: KeyPath) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            finite(value) and value > 0):
        raise f.error(at, f"{keyname(at)}: expected a number greater than 0, got {show(value)}")
    return float(value)


def _list(f: SourceFile, value: Any, at: KeyPath, item: Callable[[Any, KeyPath], Any]) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise f.error(at, f"{keyname(at)}: expected a list, got {show(value)}")
    return tuple(item(v, at) for v in value)


def _host(f: SourceFile, value: Any, at: KeyPath) -> str:
    host = string(f, value, at)
    if not valid_host(host):
        raise f.error(at, f"{keyname(at)}: {host!r} is not a host name or ssh alias")
    return host


def _name(f: SourceFile, value: Any, at: KeyPath) -> str:
    name = string(f, value, at)
    if not valid_name(name):   # the node agent checks the same pattern (job directories, arguments)
        raise f.error(at, f"{keyname(at)}: {name!r} is not a valid node name ({NAME_RULE})")
    return name


def _user(f: SourceFile, value: Any, at: KeyPath) -> str:
    user = string(f, value, at)
    if re.search(r"\s", user) or user.startswith("-"):
        raise f.error(at, f"{keyname(at)}: {user!r} is not a user name")
    return user


def _gpus(f: SourceFile, value: Any, at: KeyPath) -> tuple[int, ...]:
    gpus = _list(f, value, at, lambda v, a: _integer(f, v, a, 0, 1023))
    if len(set(gpus)) != len(gpus):
        raise f.error(at, f"{keyname(at)}: an index is listed twice in {list(gpus)}")
    return gpus


def _emulate(f: SourceFile, value: Any, at: KeyPath) -> EmulateSpec:
    if not isinstance(value, dict):
        raise f.error(at, f"{keyname(at)}: expected a table like {{ devices = [...], speed = [...], "
                          f"memory_mib = [...] }}, got {show(value)}")
    check_keys(f, value, at, EMULATE_KEYS, keyname(at))
    for key in EMULATE_REQUIRED:
        if key not in value:
            raise f.error(at, f"{keyname(at)}: missing key {key!r} (emulate needs devices, speed "
                              "and memory_mib, one entry per device)")
    devices = _list(f, value["devices"], at + ("devices",), lambda v, a: string(f, v, a))
    speed = _list(f, value["speed"], at + ("speed",), lambda v, a: positive_number(f, v, a))
    memory = _list(f, value["memory_mib"], at + ("memory_mib",), lambda v, a: _integer(f, v, a, 1, 1 << 30))
    if not devices:
        raise f.error(at + ("devices",), f"{keyname(at)}.devices: declare at least one device")
    if len(devices) > MAX_EMULATED:
        raise f.error(at + ("devices",), f"{keyname(at)}.devices: {len(devices)} devices, more than the "
                                         f"{MAX_EMULATED} one node may emulate")
    for key, values in (("speed", speed), ("memory_mib", memory)):
        if len(values) != len(devices):
            entries = "entry" if len(values) == 1 else "entries"
            raise f.error(at + (key,), f"{keyname(at)}.{key} has {len(values)} {entries} for "
                                       f"{len(devices)} devices: give one per device")
    slowdown = _slowdowns(f, value.get("slowdown", []), at + ("slowdown",), len(devices))
    return EmulateSpec(devices=devices, speed=speed, memory_mib=memory, slowdown=slowdown)


def _slowdowns(f: SourceFile, value: Any, at: KeyPath, devices: int) -> tuple[Slowdown, ...]:
    """``slowdown = [[DEVICE_INDEX, AFTER_SECONDS, FACTOR], ...]``: FACTOR >= 1 divides the device's
    speed from AFTER_SECONDS on (1: its declared speed again, a recovery)."""
    def entry(item: Any, where: KeyPath) -> Slowdown:
        if (not isinstance(item, list) or len(item) != 3
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in item)):
            shown = json.dumps(item) if isinstance(item, list) else show(item)
            raise f.error(where, f"{keyname(where)}: each entry is [DEVICE_INDEX, AFTER_SECONDS, FACTOR], "
                                 f"got {shown}")
        index, after, factor = item
        if not isinstance(index, int) or not 0 <= index < devices:
            raise f.error(where, f"{keyname(where)}: device index {show(index)} is not one of the "
                                 f"{devices} emulated devices (0 to {devices - 1})")
        if not (finite(after) and after >= 0):
            raise f.error(where, f"{keyname(where)}: AFTER_SECONDS must be a number >= 0, got {show(after)}")
        if not (finite(factor) and factor >= 1):
            raise f.error(where, f"{keyname(where)}: FACTOR must be a number >= 1 (the speed is divided "
                                 f"by it; 1 restores it), got {show(factor)}")
        return Slowdown(device=index, after_s=float(after), factor=float(factor))

    if not isinstance(value, list):
        raise f.error(at, f"{keyname(at)}: expected a list like [[0, 60, 4]], got {show(value)}")
    return tuple(entry(item, at + (k,)) for k, item in enumerate(value))


NODE_CONVERTERS: dict[str, Callable[[SourceFile, Any, KeyPath], Any]] = {
    "host": _host,
    "name": _name,
    "port": lambda f, v, at: _integer(f, v, at, 1, 65535),
    "user": _user,
    "identity_file": lambda f, v, at: f.relative(string(f, v, at)),
    "proxy_jump": string,
    "python": string,
    "gpus": _gpus,
    "emulate": _emulate,
}
