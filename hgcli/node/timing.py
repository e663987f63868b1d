"""Repeated timing -> Measurement: warm-up runs are discarded, the rest give median and spread.

A single timing hides noise (a busy machine, clock boosts); the median resists outliers and min/max
show how noisy a figure was, so the planner and the user can tell a firm figure from a shaky one.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from ..model import Measurement


def time_repeats(fn: Callable[[], object], *, warmup: int, repeats: int,
                 sync: Callable[[], object] = lambda: None) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` runs after ``warmup`` untimed ones.

    ``sync`` waits for queued device work (CUDA launches are asynchronous), so each timing covers
    the work itself and not just its launch.
    """
    for _ in range(warmup):
        fn()
    sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def summarize(values: list[float]) -> Measurement:
    return Measurement(median=statistics.median(values), min=min(values), max=max(values),
                       repeats=len(values))


def rates(amount: float, seconds: list[float]) -> Measurement:
    """``amount`` per second for each timing (e.g. FLOPs -> FLOP/s), summarised."""
    return summarize([amount / s for s in seconds])


def scaled(m: Measurement, factor: float) -> Measurement:
    """The measurement multiplied by a positive factor (emulated speed), order of min/max kept."""
    return Measurement(median=m.median * factor, min=m.min * factor, max=m.max * factor,
                       repeats=m.repeats)
