"""Batch sizes: from each device's throughput curve (its knee), split by speed, summing exactly to
the global batch within every device's memory cap."""
from __future__ import annotations

import math

from ..errors import UsageError
from .cost import KNEE_TOLERANCE
from .costed import Device


def summarise(notes: list[str], limit: int = 6, sep: str = "; ") -> str:
    """The first few of a long list, so an error about 4096 devices stays one readable line."""
    more = f" and {len(notes) - limit} more" if len(notes) > limit else ""
    return sep.join(notes[:limit]) + more


def _name_devices(devices: list[Device], node_names: list[str]) -> str:
    return summarise([f"{d.device}@{node_names[d.node]}" for d in devices], sep=", ")


def knee(d: Device) -> int:
    """The smallest batch whose samples/s, b / (a + c b), is within KNEE_TOLERANCE of the device's
    best: at its memory cap, or 1 / c without one. From b / (a + c b) >= q: b >= q a / (1 - q c)."""
    best = d.rate(d.cap) if d.cap is not None else 1.0 / d.c
    q = (1.0 - KNEE_TOLERANCE) * best            # q * c <= 1 - KNEE_TOLERANCE < 1
    b = max(1, math.ceil(q * d.a / (1.0 - q * d.c) - 1e-9))
    return min(b, d.cap) if d.cap is not None else b


def _knee_rate(d: Device, k: int) -> float:
    """Samples/s the split follows: at the knee, or at the largest batch benched when the knee lies
    beyond it (the fit's slope is least certain past what was timed; a flat fit's slope is a stand-in)."""
    return d.rate(min(k, d.benched) if d.benched else k)


def assign_batches(devices: list[Device], global_batch: int,
                    node_names: list[str]) -> tuple[list[float], list[int]]:
    """Real-valued batches and integers in [floor, cap] summing exactly to the global batch.

    Every device gets at least its knee when the global batch holds all the knees, else at least 1
    (the plan's reason then says so). Within those floors, the batches follow each device's samples/s
    at its knee (a careful DDP user's split by speed), limited to a step at most KNEE_TOLERANCE above
    the shortest synchronous step the global batch allows (equal step times): a large fixed cost on
    a slow device cannot stretch every step, and a small one no longer leaves a slow device 1 sample
    because its fixed cost alone outlasts a fast device's step."""
    if global_batch < len(devices):
        raise UsageError(f"global batch {global_batch} is smaller than the {len(devices)} worker devices "
                         f"({_name_devices(devices, node_names)}); each needs at least one sample: "
                         f"use --global-batch {len(devices)} or more")
    capacity = sum(d.cap for d in devices if d.cap is not None)
    if all(d.cap is not None for d in devices) and global_batch > capacity:
        tight = sorted(devices, key=lambda d: d.cap or 0)
        listed = summarise([f"{d.device}@{node_names[d.node]} <= {d.cap}" for d in tight], sep=", ")
        raise UsageError(f"global batch {global_batch} does not fit in device memory: the "
                         f"{len(devices)} devices hold at most {capacity} samples per step ({listed}); "
                         f"use --global-batch {capacity} or less")
    knees = [knee(d) for d in devices]
    caps = [float(d.cap) if d.cap is not None else math.inf for d in devices]
    ones = [1] * len(devices)
    # The shortest synchronous step: equal step time, sum(clamp((T - a) / c, 1, cap)) == global batch.
    at = _fill([1.0 / d.c for d in devices], [-d.a / d.c for d in devices], ones, caps, global_batch)
    step = max(d.time(min(max((at - d.a) / d.c, 1.0), hi)) for d, hi in zip(devices, caps))
    limit = step * (1.0 + KNEE_TOLERANCE)
    tops = [min(hi, max(1.0, (limit - d.a) / d.c)) for d, hi in zip(devices, caps)]
    # Knees as floors where the step allows them and the global batch holds them all.
    floors = [min(k, math.floor(top)) for k, top in zip(knees, tops)]
    if sum(floors) > global_batch:
        floors = ones
    rates = [_knee_rate(d, k) for d, k in zip(devices, knees)]
    scale = _fill(rates, [0.0] * len(devices), floors, tops, global_batch)
    real = [min(max(scale * r, float(lo)), hi) for r, lo, hi in zip(rates, floors, tops)]
    return real, _round_to_total(real, devices, floors, tops, global_batch)


def _fill(slopes: list[float], offsets: list[float], floors: list[int], tops: list[float],
          total: int) -> float:
    """The x at which sum(clamp(slope * x + offset, floor, top)) == total (slopes > 0), by a sweep
    over the 2n breakpoints: between them the sum is K + S * x. O(n log n). Equal step time is
    x = T with slope 1 / c and offset -a / c; a split by speed is x = the scale on each rate."""
    events: list[tuple[float, int, int]] = []
    for i, (s, o) in enumerate(zip(slopes, offsets)):
        events.append(((floors[i] - o) / s, 0, i))
        if tops[i] < math.inf:
            events.append(((tops[i] - o) / s, 1, i))
    events.sort()
    k, rate = float(sum(floors)), 0.0
    for when, kind, i in events:
        if rate > 0 and k + rate * when >= total:
            return (total - k) / rate
        if kind == 0:
            rate += slopes[i]
            k += offsets[i] - floors[i]
        else:
            rate -= slopes[i]
            k += tops[i] - offsets[i]
    if rate > 0:
        return (total - k) / rate
    return events[-1][0]   # every device at its top: the caller checked the total fits


def _round_to_total(real: list[float], devices: list[Device], floors: list[int], tops: list[float],
                    total: int) -> list[int]:
    """Largest-remainder rounding that keeps every batch within [floor, cap], and within its top
    (the step limit) while some device still has room below its own."""
    out = [max(lo, math.floor(x)) for x, lo in zip(real, floors)]
    out = [min(b, d.cap) if d.cap is not None else b for b, d in zip(out, devices)]
    missing = total - sum(out)
    by_remainder = sorted(range(len(real)), key=lambda i: real[i] - math.floor(real[i]), reverse=missing > 0)
    # Room below the top first, then (only if the tops cannot hold the total) up to the cap.
    order = [i for i in by_remainder if out[i] + 1 <= tops[i]] + [i for i in by_remainder if out[i] + 1 > tops[i]]
    while missing != 0:
        moved = False
        for i in order:
            if missing == 0:
                break
            cap = devices[i].cap
            if missing > 0 and (cap is None or out[i] < cap):
                out[i] += 1
                missing -= 1
                moved = True
            elif missing < 0 and out[i] > floors[i]:
                out[i] -= 1
                missing += 1
                moved = True
        if not moved:  # cannot happen once the total was checked against [n, capacity]
            raise UsageError(f"cannot split global batch {total} over {len(devices)} devices")
    return out


def below_knee_note(batches: list[int], knees: list[int], global_batch: int) -> str:
    """The reason's word on devices the global batch holds below their knee, if any."""
    below = sum(b < k for b, k in zip(batches, knees))
    if not below:
        return ""
    return (f"; global batch {global_batch} holds {below} of {len(batches)} devices below their knee (the batch "
            f"within {KNEE_TOLERANCE:.0%} of their best samples/s; all at their knee take {sum(knees):,} per "
            f"step): batches split by speed below it")
