"""Node lists users already have: DeepSpeed/MPI hostfiles and Slurm's SLURM_JOB_NODELIST.

Pure text -> host entries; ``config.py`` turns them into a ``Cluster``. Errors are ConfigErrors
naming the hostfile line or the Slurm list, so a typo never reaches a connection attempt.
"""
from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass

from ..errors import ConfigError
from ..schema.names import valid_host

# Far beyond any real allocation; stops a typo like gpu[1-99999999] from eating memory.
MAX_HOSTS = 100_000
# Digits in one range bound: far more than any node number, far fewer than int() refuses.
_MAX_DIGITS = 64
_SLOTS = re.compile(r"slots=([0-9]+)")   # [0-9]: \d also takes "٣"; used with fullmatch
MAX_SLOTS = 1024          # devices (ranks) one hostfile line may declare


@dataclass(frozen=True)
class HostEntry:
    """One hostfile line (DeepSpeed/MPI style): the host, its declared slots, and the line number that
    errors name."""

    host: str
    slots: int | None
    line: int


def parse_hostfile(text: str, source: str) -> list[HostEntry]:
    """``host [slots=N]`` per line, ``#`` comments, blank lines; duplicates are refused (as DeepSpeed
    does) because a host listed twice would get ranks started twice."""
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{number}"
        host, rest = fields[0], fields[1:]
        if not valid_host(host):
            raise ConfigError(f"{host!r} is not a host name", source=where)
        slots = None
        for item in rest:
            m = _SLOTS.fullmatch(item)
            if m is None:
                raise ConfigError(f"cannot read {item!r}: expected 'host' or 'host slots=N'", source=where)
            if slots is not None:
                raise ConfigError("slots given twice", source=where)
            digits = m.group(1).lstrip("0") or "0"
            if len(digits) > 6:          # int() of thousands of digits fails; no node has a million slots
                raise ConfigError(f"slots={digits[:12]}... is more than {MAX_SLOTS} slots", source=where)
            slots = int(digits)
            if slots < 1:
                raise ConfigError("slots must be at least 1", source=where)
            if slots > MAX_SLOTS:
                raise ConfigError(f"slots={slots} is more than {MAX_SLOTS} slots", source=where)
        if host in seen:
            raise ConfigError(f"host {host!r} listed twice (first at line {seen[host]})", source=where)
        seen[host] = number
        entries.append(HostEntry(host=host, slots=slots, line=number))
    return entries


def expand_nodelist(nodelist: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5. A range keeps the zero padding of its
    lower bound (as Slurm prints it); several bracket groups in one name expand as their product
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), like Slurm's multi-dimensional names.
    """
    items = [_parse_item(item, source) for item in _split_top_level(nodelist, source)]
    # Counted before anything is expanded: a short list like n[0-99999]m[0-99999] would otherwise
    # build billions of names before being refused, and MAX_HOSTS caps the whole list, not each item.
    total = 0
    for item, choices in items:
        count = math.prod(_count(choice) for choice in choices)
        if count > MAX_HOSTS:
            raise ConfigError(f"{item!r} expands to more than {MAX_HOSTS} hosts", source=source)
        total += count
    if total > MAX_HOSTS:
        raise ConfigError(f"the node list expands to more than {MAX_HOSTS} hosts ({total})", source=source)
    hosts: list[str] = []
    for item, choices in items:
        hosts.extend(_expand_item(item, choices, source))
    if not hosts:
        raise ConfigError("the node list is empty", source=source)
    duplicates = [host for host, count in Counter(hosts).items() if count > 1]
    if duplicates:
        raise ConfigError(f"host {duplicates[0]!r} listed twice in {nodelist!r}", source=source)
    return hosts


def _split_top_level(nodelist: str, source: str) -> list[str]:
    current: list[str]
    items, depth, current = [], 0, []
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"nested '[' in {nodelist!r}", source=source)
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"']' without '[' in {nodelist!r}", source=source)
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ConfigError(f"'[' without ']' in {nodelist!r}", source=source)
    items.append("".join(current))
    for item in items:
        if not item.strip():
            raise ConfigError(f"empty host name in {nodelist!r}", source=source)
    return [item.strip() for item in items]


# One part of a host name: fixed text, or a bracket's ranges as (low, high, zero-padded width).
_Choice = str | list[tuple[int, int, int]]


def _parse_item(item: str, source: str) -> tuple[str, list[_Choice]]:
    choices: list[_Choice] = []
    for part in re.split(r"(\[[^\]]*\])", item):
        if part.startswith("["):
            choices.append(_parse_ranges(part[1:-1], item, source))
        elif part:
            choices.append(part)
    return item, choices


def _count(choice: _Choice) -> int:
    return 1 if isinstance(choice, str) else sum(hi - lo + 1 for lo, hi, _ in choice)


def _expand_item(item: str, choices: list[_Choice], source: str) -> list[str]:
    expanded = [[choice] if isinstance(choice, str)
                else [str(n).zfill(width) for lo, hi, width in choice for n in range(lo, hi + 1)]
                for choice in choices]
    hosts = ["".join(combo) for combo in itertools.product(*expanded)]
    for host in hosts:
        if not valid_host(host):
            raise ConfigError(f"{host!r} (from {item!r}) is not a host name", source=source)
    return hosts


def _parse_ranges(ranges: str, item: str, source: str) -> list[tuple[int, int, int]]:
    values: list[tuple[int, int, int]] = []
    for rng in ranges.split(","):
        # [0-9], not \d: \d also takes other scripts' digits ("٣"), which int() reads as 3.
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", rng)
        if m is None:
            raise ConfigError(f"cannot read range {rng!r} in {item!r}", source=source)
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if max(len(lo), len(hi)) > _MAX_DIGITS:   # int() of thousands of digits is a ValueError
            raise ConfigError(f"range {rng.strip()!r} in {item!r} has numbers too long", source=source)
        if int(hi) < int(lo):
            raise ConfigError(f"range {rng.strip()!r} in {item!r} runs backwards", source=source)
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ConfigError(f"range {rng.strip()!r} in {item!r} is too large", source=source)
        values.append((int(lo), int(hi), len(lo)))
    return values
