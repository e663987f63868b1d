"""Kinds: devices of one model whose benches agree within noise share one cost (docs/planning.md)."""
from __future__ import annotations

import dataclasses
import math
import statistics

from ..schema.stages import DeviceProfile
from .costed import Device
from .fit import matmul_figure, timed

# Benches of one device model on two nodes (or minutes apart) differ by up to this factor each way
# beyond the spread of their own repeats (a shared CPU drifts 20-40% within seconds): devices of one
# model and declared speed closer than that are one kind, costed alike.
BENCH_DRIFT = 1.25


def find_kinds(devices: list[Device], profiles: list[DeviceProfile]) -> list[list[int]]:
    """Devices of one model name, memory, declared speed and emulation whose measurements overlap within
    noise. Each device's level is the median over its benched sizes of its [fastest, slowest] repeat
    over the candidates' median fastest repeat at that size; levels widened by BENCH_DRIFT each way
    that overlap (directly or through others) make one kind. Devices costed from matmul figures
    compare those. A clear difference (a throttled GPU, a node under load all through its bench)
    still makes two kinds. O(n log n)."""
    candidates: dict[tuple, list[int]] = {}
    for i, (d, p) in enumerate(zip(devices, profiles)):
        candidates.setdefault((p.name, p.memory_total_mib, d.emulated, d.speed, d.benched > 0), []).append(i)
    kinds: list[list[int]] = []
    for members in candidates.values():
        if len(members) == 1:
            kinds.append(members)
            continue
        spans = [_spans(profiles[i]) for i in members]
        sizes: dict[int, list[float]] = {}
        for span in spans:
            for b, (low, _) in span.items():
                sizes.setdefault(b, []).append(low)
        reference = {b: statistics.median(lows) for b, lows in sizes.items()}
        levels = []
        for i, span in zip(members, spans):
            low = statistics.median([lo / reference[b] for b, (lo, _) in span.items()]) if span else 1.0
            high = statistics.median([hi / reference[b] for b, (_, hi) in span.items()]) if span else 1.0
            levels.append((low, max(low, high), i))
        levels.sort()
        reach = -math.inf
        for low, high, i in levels:
            if low > BENCH_DRIFT * BENCH_DRIFT * reach:
                kinds.append([])
                reach = high
            kinds[-1].append(i)
            reach = max(reach, high)
    return [sorted(k) for k in kinds]


def _spans(p: DeviceProfile) -> dict[int, tuple[float, float]]:
    """Per benched batch size, the (fastest, slowest) repeat of the step in seconds; for a device
    without step times, its matmul figure as a time (1 / TFLOP/s) under key 0."""
    steps = timed(p)
    if steps:
        return {s.batch_size: (s.seconds.min if s.seconds.min > 0 else s.seconds.median,
                               max(s.seconds.max, s.seconds.median)) for s in steps}
    tflops = matmul_figure(p)
    if tflops is None or tflops.median <= 0:
        return {}
    fast = tflops.max if tflops.max > 0 else tflops.median
    slow = tflops.min if tflops.min > 0 else tflops.median
    return {0: (1.0 / max(fast, tflops.median), 1.0 / min(slow, tflops.median))}


def pooled(members: list[Device]) -> Device:
    """One cost for a kind: the median fit of its members, the smallest memory cap among them."""
    caps = [d.cap for d in members if d.cap is not None]
    return dataclasses.replace(members[0], a=statistics.median(d.a for d in members),
                               c=statistics.median(d.c for d in members),
                               noise=statistics.median(d.noise for d in members),
                               cap=min(caps) if caps else None, benched=min(d.benched for d in members))
