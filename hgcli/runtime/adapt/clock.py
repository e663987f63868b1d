"""How long a group member computes (group/engine.py): per accumulation window, its compute seconds and
samples, the waits for the group's all-reduces left out.

Three readers: the rebalancer (sums since its last check, sent with the step's small all-reduce),
the launcher's re-grouping (the ``rates`` record every RATES_EVERY_S), and the finish record's
per-device rate and noise, which the next plan of the script is fitted to (bench/rates.py).
"""
from __future__ import annotations

import collections
import statistics
import time
from typing import Iterable

from ...schema.records import RatesRecord
from .rebalance import steady_seconds

NOISE_WINDOWS = 2048        # windows a member's compute_noise is taken over (the run's latest)
# Windows of the `rates` record's recent figures: a straggler that recovers shows there within a
# minute of steps, where the run's figures still carry its slow past (launch/adapt.py, the way back).
RECENT_WINDOWS = 64
SINCE_CHECK_WINDOWS = 64   # windows steady_s is taken over at most (a rebalancer checks every 4)
RATES_EVERY_S = 5.0         # between two `rates` records (the launcher's re-grouping reads them)


class ComputeClock:
    """A member's compute seconds and samples per accumulation window, the all-reduce waits left out:
    what the rebalancer, the ``rates`` records and the finish record read of its speed."""

    def __init__(self) -> None:
        self.windows = 0                  # accumulation windows (steps of the group) completed
        self.window_began = 0.0           # when the current window's first compute began
        # This member's compute since the rebalancer's last check: samples, and each window's seconds
        # per sample (``steady_s`` is sent with the next small all-reduce). A rebalancer clears them
        # every few windows; without one (--no-adapt) nobody does, so only the latest are kept.
        self.computed = 0.0
        self._since_check: collections.deque[float] = collections.deque(maxlen=SINCE_CHECK_WINDOWS)
        # The run's compute (every window but the first, a warm-up) for the summary's per-device rate.
        self.compute_total_s = 0.0
        self.computed_total = 0.0
        # Each window's compute seconds per sample, the last NOISE_WINDOWS of them: how uneven this
        # member's steps are (``compute_noise``), for the next plan of the script (bench/rates.py).
        self._per_sample: collections.deque[float] = collections.deque(maxlen=NOISE_WINDOWS)
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT_WINDOWS)
        self._rates_at = time.monotonic()
        self._last_bucket_at: float | None = None
        self.reduce_wait_s = 0.0

    def begin_window(self) -> None:
        self.window_began = time.perf_counter()

    def bucket_left(self) -> None:
        """The step's last DDP bucket started its all-reduce."""
        self._last_bucket_at = time.perf_counter()

    def reduce_waited(self) -> tuple[float, float | None]:
        """At ``opt.step()``: the seconds since the last bucket left, and when it left (None: no
        bucket this step). From the last bucket's start to here, backward only waited for DDP's
        all-reduces: what synchronisation cost this step beyond the compute it overlapped."""
        waited, bucket_at = 0.0, self._last_bucket_at
        if self._last_bucket_at is not None:
            waited = time.perf_counter() - self._last_bucket_at
            self.reduce_wait_s += waited
            self._last_bucket_at = None
        return waited, bucket_at

    def window_done(self, seconds: float, samples: float) -> bool:
        """A window computed ``samples`` in ``seconds``; True when a ``rates`` record is due."""
        self.windows += 1
        self.computed += samples
        if seconds > 0 and samples > 0:
            self._since_check.append(seconds / samples)
        if self.windows > 1:
            self.compute_total_s += seconds
            self.computed_total += samples
            if seconds > 0 and samples > 0:
                self._per_sample.append(seconds / samples)
                self._recent.append((seconds, samples))
        now = time.monotonic()
        if now - self._rates_at >= RATES_EVERY_S and self.compute_rate is not None:
            self._rates_at = now
            return True
        return False

    def reset_sums(self) -> None:
        """Every member starts its next sums now (the rebalancer read the ones sent before this step)."""
        self.computed = 0.0
        self._since_check.clear()

    @property
    def steady_s(self) -> float:
        """The seconds this member's samples since the last check take at its steady rate
        (rebalance.steady_seconds: a window of contention does not move it)."""
        return steady_seconds(self._since_check, self.computed)

    @property
    def compute_noise(self) -> float | None:
        """The mean delay of this member's steps over their noise-free time, as the planner's
        ``Device.noise`` means it: the mean over the 10th percentile of its per-sample compute, less
        one (a member that is every fourth step 3x slower: 0.5). None before 10 windows."""
        return noise_of(self._per_sample)

    def recent_figures(self) -> dict[str, float | None]:
        """Compute samples/s and noise over the last RECENT_WINDOWS windows."""
        seconds = sum(s for s, _ in self._recent)
        return {"recent_samples_per_s": sum(n for _, n in self._recent) / seconds if seconds > 0 else None,
                "recent_noise": noise_of([s / n for s, n in self._recent])}

    @property
    def compute_rate(self) -> float | None:
        """Samples per second of this member's compute over the run (waits for others excluded)."""
        return self.computed_total / self.compute_total_s if self.compute_total_s > 0 else None

    def rates_due(self, seconds: float, samples: float, *, group: int, step: int,
                  samples_seen: int) -> RatesRecord | None:
        """A window computed (``window_done``); the ``rates`` record when one is due: what the finish
        record will say, so far (the launcher re-groups a job on it while it runs, launch/adapt.py,
        as the next plan of the script is fitted to the finish record)."""
        if not self.window_done(seconds, samples):
            return None
        recent = self.recent_figures()
        return RatesRecord(group=group, step=step, compute_samples_per_s=self.compute_rate, samples=samples_seen,
                           steps=step, compute_noise=self.compute_noise,
                           recent_samples_per_s=recent["recent_samples_per_s"], recent_noise=recent["recent_noise"])


class ClockedMember:
    """A group member's speed as its ComputeClock measured it, read by the finish record (a group
    engine's base)."""

    clock: ComputeClock

    @property
    def compute_noise(self) -> float | None:
        """ComputeClock.compute_noise: how uneven this member's steps are."""
        return self.clock.compute_noise

    @property
    def compute_rate(self) -> float | None:
        """Samples per second of this member's compute over the run (waits for others excluded)."""
        return self.clock.compute_rate


def noise_of(per_sample: Iterable[float]) -> float | None:
    """Mean over 10th percentile of per-sample compute seconds, less one; None under 10 values."""
    values = sorted(per_sample)
    if len(values) < 10:
        return None
    floor = values[len(values) // 10]
    return max(0.0, statistics.fmean(values) / floor - 1.0) if floor > 0 else None
