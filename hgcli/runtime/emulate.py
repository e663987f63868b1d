"""Emulated devices: a rank declared slower than its CPU stretches each step's compute time.

Per step, the wall time since the previous step ended (data, forward, backward) is measured and the
rank sleeps until it equals compute / speed (times a straggler factor on steps where this rank is the
straggler). Only time changes, never the maths. Communication is not stretched: links are real.
"""
from __future__ import annotations

import contextlib
import random
import time
from typing import Iterator


class Emulator:
    def __init__(self, speed: float, *, worker_index: int = 0, n_workers: int = 1,
                 straggler_factor: float = 1.0, straggler_seed: int = 0) -> None:
        self.speed = speed
        self.worker_index = worker_index
        self.n_workers = n_workers
        self.straggler_factor = straggler_factor
        self.straggler_seed = straggler_seed
        self.compute_s = 0.0        # totals, for metrics and the benchmark's honesty check
        self.slept_s = 0.0
        self._start = time.perf_counter()
        self._untimed = 0.0

    @property
    def active(self) -> bool:
        return self.speed < 1.0 or self.straggler_factor > 1.0

    def is_straggler(self, step: int) -> bool:
        """Every rank agrees, without talking, which worker is slowed at local step ``step``."""
        if self.straggler_factor <= 1.0 or self.n_workers < 1:
            return False
        pick = random.Random(f"{self.straggler_seed}:{step}").randrange(self.n_workers)
        return pick == self.worker_index

    def end_compute(self, step: int) -> float:
        """Called when the step's compute is done (before communication); returns the sleep taken."""
        compute = time.perf_counter() - self._start - self._untimed
        factor = 1.0 / self.speed
        if self.is_straggler(step):
            factor *= self.straggler_factor
        pause = max(0.0, compute * factor - compute) if factor > 1.0 else 0.0
        if pause:
            time.sleep(pause)
        self.compute_s += compute
        self.slept_s += pause
        return pause

    def begin_compute(self) -> None:
        """Called when the step's communication is done: the next step's compute starts now."""
        self._start = time.perf_counter()
        self._untimed = 0.0

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work that is not part of the device's step (evaluation, logging) is not stretched."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._untimed += time.perf_counter() - t0
