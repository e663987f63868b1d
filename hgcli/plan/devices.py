"""The devices a plan may use and their costs: alone (the bench's fit, one per kind), beside their
node's other devices (the bench's together figures), or fitted to a script's measured rates."""
from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Callable

from ..errors import StateError
from ..schema.stages import DeviceProfile, Inventory, Profiles, ScriptRates
from .costed import Device
from .fit import fit_time, memory_cap, timed
from .memory import memory_need, no_room_note
from .kinds import find_kinds, pooled

_DIGITS = re.compile(r"(\d+)")


def _natural_key(text: str) -> tuple:
    """gpu2 before gpu10."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


def usable_devices(inventory: Inventory, profiles: Profiles, model_bytes: float,
                    shardable: bool = False) -> tuple[list[Device], list[str], list[list[int]]]:
    """Devices the plan may use, in node then device order, a note for each one left out, and their
    kinds (indices into the devices). Devices of one kind (``find_kinds``) share one cost. A device
    with the model's memory profile is left out when it cannot hold one sample as a DDP replica, or,
    where the plan may shard (``shardable``), not even as a sharded rank with its state offloaded."""
    node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
    node_ok = {n.name: n.ok for n in inventory.nodes}
    usable: list[tuple[int, tuple, Device, DeviceProfile]] = []
    skipped: list[str] = []
    seen: set[tuple[str, str]] = set()
    for p in profiles.devices:
        label = f"{p.device}@{p.node}"
        if p.node not in node_index:
            raise StateError(f"the profiles name node {p.node!r}, which the inventory does not have; "
                             "run 'hgtrain probe' and 'hgtrain bench' again")
        if (p.node, p.device) in seen:
            raise StateError(f"the profiles list device {label} twice; run 'hgtrain bench' again")
        seen.add((p.node, p.device))
        if not node_ok[p.node]:
            skipped.append(f"{label} (node failed its probe)")
            continue
        if p.error:
            skipped.append(f"{label} ({p.error})")
            continue
        fit = fit_time(p, model_bytes)
        if fit is None:
            skipped.append(f"{label} (no step times or matmul figures)")
            continue
        need = memory_need(p)
        cap = memory_cap(p, model_bytes) if need is None else None
        no_room = no_room_note(need, shardable, p.memory_total_mib) if need is not None else (
            f"cannot hold one sample in {p.memory_total_mib} MiB" if cap is not None and cap < 1 else None)
        if no_room is not None:
            skipped.append(f"{label} ({no_room})")
            continue
        dev = Device(node_index[p.node], p.device, p.emulated, p.speed, fit[0], fit[1], cap, fit[2],
                     benched=max((s.batch_size for s in timed(p)), default=0), memory=need)
        usable.append((dev.node, _natural_key(p.device), dev, p))
    usable.sort(key=lambda t: (t[0], t[1]))
    devices = [d for _, _, d, _ in usable]
    kinds = find_kinds(devices, [p for _, _, _, p in usable])
    for kind in kinds:
        if len(kind) > 1:
            shared = pooled([devices[i] for i in kind])
            for i in kind:
                devices[i] = dataclasses.replace(devices[i], a=shared.a, c=shared.c, noise=shared.noise,
                                                 cap=shared.cap, benched=shared.benched)
    return devices, skipped, kinds


def beside_neighbours(devices: list[Device], kinds: list[list[int]], node_names: list[str],
                       profiles: Profiles) -> list[Device]:
    """Each kind's cost scaled to what its members measured stepping beside the other devices of
    their node (``DeviceProfile.together``, docs/bench.md): a member's factor is, per phase, the
    mean step of its window over its alone line's time at that batch, the median over phases; the
    kind's the median of its members' (like devices keep one cost), at least 1 (running beside
    others never makes a device faster; a lower figure is the bench's noise). The whole line
    a + c * b is scaled, as a fit to measured rates scales it: a core shared with the neighbours
    stretches a step's fixed cost and its per-sample work alike. The steps' noise is theirs too
    (per phase, the window's mean step over its fastest, less one; the median over phases, then over
    the kind): a step that lost its core to a neighbour is late, and a synchronous group waits for
    its latest member (cost.straggle). Kinds without together figures (one-device nodes, profiles
    from before them) keep their alone cost."""
    together = {(p.node, p.device): p.together for p in profiles.devices if p.together is not None}

    def measure(d: Device) -> tuple[float, float | None] | None:
        measured = together.get((node_names[d.node], d.device))
        phases = [s for s in (measured.steps if measured else ()) if s.batch_size > 0 and s.mean_s > 0]
        if not phases:
            return None
        return (statistics.median(s.mean_s / d.time(s.batch_size) for s in phases),
                statistics.median(max(0.0, s.mean_s / s.seconds.min - 1.0) if s.seconds.min > 0 else 0.0
                                  for s in phases))

    return _scaled_kinds(devices, kinds, measure, at_least=1.0, together=True)


def _scaled_kinds(devices: list[Device], kinds: list[list[int]],
                  measure: Callable[[Device], tuple[float, float | None] | None], *, at_least: float = 0.0,
                  together: bool = False, fitted: bool = False) -> list[Device]:
    """Each kind with a member ``measure`` gives (factor, noise or None) for: its line a + c * b
    scaled by the median of its members' factors (at least ``at_least``), its noise the median of the
    noises given (else its own), marked ``together`` or ``fitted``; other kinds as they are."""
    out = list(devices)
    for kind in kinds:
        found = [m for m in (measure(devices[i]) for i in kind) if m is not None]
        if not found:
            continue
        f = max(at_least, statistics.median(factor for factor, _ in found))
        noises = [noise for _, noise in found if noise is not None]
        for i in kind:
            d = devices[i]
            out[i] = dataclasses.replace(d, a=d.a * f, c=d.c * f, noise=statistics.median(noises) if noises else d.noise,
                                         together=together or d.together, fitted=fitted or d.fitted)
    return out


def fit_to_rates(devices: list[Device], kinds: list[list[int]], node_names: list[str],
                  rates: ScriptRates) -> list[Device]:
    """Each kind's cost scaled so that its measured rates come out: a member's factor is its measured
    step at its mean batch (``batch / samples_per_s``) over the bench's time there, the kind's the
    median of its members' (like devices keep one cost; one member's noise does not split them).
    The whole line a + c * b is scaled: the measured step holds the script's per-sample work and its
    fixed cost alike, and one point cannot tell them apart. The measured noise (how uneven its steps
    were) replaces the bench's. Kinds without a measured member keep the bench's cost."""
    measured = {(r.node, r.device): r for r in rates.rates if r.samples_per_s > 0 and r.batch_size > 0}

    def measure(d: Device) -> tuple[float, float | None] | None:
        r = measured.get((node_names[d.node], d.device))
        # Steps measured in training replace the bench's spread: a straggling device (another job's
        # bursts, a data loader behind every few steps) makes a synchronous group wait.
        return None if r is None else (r.batch_size / r.samples_per_s / d.time(r.batch_size), r.noise)

    return _scaled_kinds(devices, kinds, measure, fitted=True)
