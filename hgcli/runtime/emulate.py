"""Emulated devices: a rank declared slower than its CPU stretches each step to compute / speed.

"Compute" is the CPU time the training thread spent on the step since the previous step ended
(data, forward, backward; emulated ranks run torch on one thread, and CPU autograd runs on the
calling thread). CPU time, not wall time: on a CPU shared by several ranks, wall time also counts
the time the rank waited for a core, and stretching that would multiply the machine's noise. The
rank then sleeps until the step's wall time reaches compute / speed (times a straggler factor on
steps where it is the straggler, and by the factor of a declared slowdown once its time has come).
Only time changes, never the maths; communication is not
stretched (links are real).

What is stretched is not the step's own CPU time but ``StableSpeed``'s estimate of it: the lower
quartile of the last few steps of the same batch size. The emulated device is one of stable speed,
as a GPU is; the shared CPU's jitter (an interrupt, another process, cold caches) is the host's, and
stretching each step's raw CPU time multiplies it by 1/speed, so a synchronous group would wait
for a straggler that no real device of that speed would be. The lower
quartile rather than the median: delays only ever add to a step's CPU time (other jobs sharing the
caches and cores), so the faster steps are the ones closer to the device's own speed.

Ranks of one all-reduce group on one node pool their estimates (``share``, fed by the group's
all-reduce in group/engine.py): identical devices run at one speed, but each process's own estimate of
the same step can differ on a small shared CPU (which core, whose caches), x 1/speed once stretched,
so every synchronous step would wait for the process that happened to be slowest: an artifact
of emulating on one shared CPU that no group of real GPUs of one model would show.
"""
from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from typing import Iterator, Sequence

# Steps of one batch size whose CPU times make the stable estimate: enough that slow steps (most of
# them) do not move the lower quartile, few enough to follow a lasting change of the machine's load
# within a few steps.
STABLE_WINDOW = 9


class StableSpeed:
    """The CPU seconds a step of a given batch size takes on a device of stable speed: the lower
    quartile of the last ``STABLE_WINDOW`` steps of that size (this one included; the fastest of
    up to three). The bench times emulated devices through the same estimate
    (hgcli/node/bench/step.py), so profile and runtime agree."""

    def __init__(self, window: int = STABLE_WINDOW) -> None:
        self._window = window
        self._recent: dict[int, deque[float]] = {}

    def observe(self, batch: int, seconds: float) -> float:
        recent = self._recent.get(batch)
        if recent is None:
            recent = self._recent[batch] = deque(maxlen=self._window)
        recent.append(seconds)
        return sorted(recent)[len(recent) // 4]

    def current(self, batch: int) -> float | None:
        """The estimate for ``batch`` after the last ``observe``; None before any."""
        recent = self._recent.get(batch)
        return sorted(recent)[len(recent) // 4] if recent else None


class Emulator:
    """Paces one rank as its emulated device: stretches each step's compute by 1 / speed (and the
    declared stragglers and slowdowns), so a CPU stands in for a GPU of the declared speed."""

    def __init__(self, speed: float, *, worker_index: int = 0, n_workers: int = 1,
                 straggler_factor: float = 1.0, straggler_seed: int = 0,
                 slowdown: Sequence[tuple[float, float]] = ()) -> None:
        self.speed = speed
        # (seconds after this emulator started, factor): the latest one whose time has come applies.
        self.slowdown = sorted((float(a), float(f)) for a, f in slowdown)
        self._born = time.monotonic()
        self.worker_index = worker_index
        self.n_workers = n_workers
        self.straggler_factor = straggler_factor
        self.straggler_seed = straggler_seed
        self.compute_s = 0.0        # totals, for metrics and the benchmark's honesty check
        self.slept_s = 0.0
        self.target_s = 0.0         # what the steps were stretched to (estimate x factor), summed
        self._stable = StableSpeed()
        self._shared: dict[int, float] = {}   # batch -> the group's pooled estimate on this node
        self._next_step = 0                   # the step being computed (for ``pace``)
        self._last_estimate = 0.0             # the estimate the last step was stretched to
        self.begin_compute()

    def is_straggler(self, step: int) -> bool:
        """Every rank agrees, without talking, which worker is slowed at local step ``step``."""
        if self.straggler_factor <= 1.0 or self.n_workers < 1:
            return False
        pick = random.Random(f"{self.straggler_seed}:{step}").randrange(self.n_workers)
        return pick == self.worker_index

    def begin_compute(self) -> None:
        """Called when the step's communication is done: the next step's compute starts now."""
        self._wall0 = time.perf_counter()
        self._cpu0 = time.thread_time()
        self._untimed_wall = 0.0
        self._untimed_cpu = 0.0

    def end_compute(self, step: int, batch: int = 0) -> float:
        """Called when the step's compute is done (before communication), with the samples it saw;
        returns the sleep taken."""
        wall, cpu = self._elapsed()
        factor = self._factor(step)
        own = self._stable.observe(batch, cpu)
        estimate = self._shared.get(batch, own)
        pause = max(0.0, estimate * factor - wall) if factor > 1.0 else 0.0
        if pause:
            time.sleep(pause)
        self.compute_s += cpu
        self.slept_s += pause
        self.target_s += estimate * factor if factor > 1.0 else 0.0
        self._next_step = step + 1
        self._last_estimate = estimate
        return pause

    def pace(self) -> float:
        """Mid-step, before communication that starts while the step still computes (a gradient
        bucket leaving during backward): sleep until the step's wall time reaches its CPU time so far
        / speed, so the communication starts when it would on the emulated device, not at once with
        the whole stretch still ahead (which would hide it all in the step's sleep). The CPU so far
        is capped at the last step's stable estimate, so pacing never stretches a step beyond what
        ``end_compute`` will; returns the sleep taken."""
        factor = self._factor(self._next_step)
        if factor <= 1.0 or self._last_estimate <= 0.0:
            return 0.0
        wall, cpu = self._elapsed()
        pause = min(cpu, self._last_estimate) * factor - wall
        if pause <= 0.0:
            return 0.0
        time.sleep(pause)
        self.slept_s += pause
        return pause

    def _factor(self, step: int) -> float:
        """How much longer than its CPU time step ``step`` lasts: 1 / speed, x the straggler factor
        on the steps where this worker is the straggler."""
        factor = 1.0 / self.speed * self.slowdown_factor()
        if self.is_straggler(step):
            factor *= self.straggler_factor
        return factor

    def slowdown_factor(self) -> float:
        """The declared slowdown in force now (1.0 before the first, or without any)."""
        if not self.slowdown:
            return 1.0
        age = time.monotonic() - self._born
        factor = 1.0
        for after, f in self.slowdown:
            if age < after:
                break
            factor = f
        return factor

    def _elapsed(self) -> tuple[float, float]:
        """Wall and CPU seconds of the step so far, untimed work left out."""
        return (time.perf_counter() - self._wall0 - self._untimed_wall,
                time.thread_time() - self._cpu0 - self._untimed_cpu)

    def estimate(self, batch: int) -> float:
        """This process's own stable estimate for ``batch`` (0.0 before its first step of it)."""
        return self._stable.current(batch) or 0.0

    def share(self, batch: int, estimate: float) -> None:
        """Use ``estimate`` (pooled over the group's ranks on this node) for later steps of ``batch``."""
        if estimate > 0:
            self._shared[batch] = estimate

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work that is not part of the device's step (evaluation, logging) is not stretched."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._untimed_wall += time.perf_counter() - wall
            self._untimed_cpu += time.thread_time() - cpu
