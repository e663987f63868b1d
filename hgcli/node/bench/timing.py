"""Repeated timing -> Measurement: warm-up runs are discarded, the rest give median and spread.

A single timing hides noise (a busy machine, clock boosts); the median resists outliers and min/max
show how noisy a figure was, so the planner and the user can tell a firm figure from a shaky one.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from ...schema.stages import Measurement


@dataclass(frozen=True)
class Clock:
    """How a timing is taken: ``now`` reads the clock; ``rest(seconds)`` runs after each timed call,
    outside the timing."""

    now: Callable[[], float] = time.perf_counter
    rest: Callable[[float], object] = lambda seconds: None


WALL = Clock()
# Longest pause after one timed call of an emulated device: bounds the bench's own duration.
MAX_EMULATED_PAUSE_S = 0.25


def emulated_clock(speed: float) -> Clock:
    """Time what the runtime's device emulation stretches, the way it runs (hgcli/runtime/emulate.py):
    this thread's CPU time (emulated ranks run torch on one thread), and after each call the pause the
    emulator would take at ``speed``. The pause matters: a step that follows a sleep runs with caches
    another process has evicted, and on a small shared CPU that costs measurably more CPU than
    back-to-back steps (about twice as much for the example MLP at batch 20)."""
    def rest(seconds: float) -> None:
        if speed < 1.0:
            time.sleep(min(seconds * (1.0 / speed - 1.0), MAX_EMULATED_PAUSE_S))

    return Clock(now=time.thread_time, rest=rest)


def time_repeats(fn: Callable[[], object], *, warmup: int, repeats: int,
                 sync: Callable[[], object] = lambda: None, clock: Clock = WALL) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` runs after ``warmup`` untimed ones.

    ``sync`` waits for queued device work (CUDA launches are asynchronous), so each timing covers
    the work itself and not just its launch. ``clock`` is wall time unless the caller measures an
    emulated device (``emulated_clock``).
    """
    for _ in range(warmup):
        start = clock.now()
        fn()
        sync()
        # Rest after warm-up too: else the first timed call follows a warm one back to back and
        # is the one call faster than the emulated device ever runs (its minimum is fitted).
        clock.rest(clock.now() - start)
    seconds = []
    for _ in range(repeats):
        start = clock.now()
        fn()
        sync()
        seconds.append(clock.now() - start)
        clock.rest(seconds[-1])
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
