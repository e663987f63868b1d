"""What stretches a step beyond its device's fitted time: the slowest of a synchronous group's noisy
members, ranks that outnumber their node's cores, and the CPU an emulated device asks of its node.
Formulas in docs/planning.md (change both together).
"""
from __future__ import annotations

import math

from .costed import Device


def compute_cpu(d: Device, batch: float) -> float:
    """Seconds of a core an emulated device's step asks of its node (it computes ``speed`` of its
    step and sleeps the rest); 0 for a fitted cost or one benched together, whose measured step had
    its share of the node's cores in it already (counting it again would crowd the node twice)."""
    return 0.0 if d.fitted or d.together else d.speed * d.time(batch)


def _harmonic(n: int) -> float:
    """1 + 1/2 + ... + 1/n (asymptotic form beyond 64 terms: error below 1e-7)."""
    if n <= 64:
        return sum(1.0 / k for k in range(1, n + 1))
    return math.log(n) + 0.5772156649 + 1.0 / (2 * n) - 1.0 / (12 * n * n)


def straggle(noise: float, n: int, accumulate: int = 1) -> float:
    """Expected slowest of ``n`` members / one member's mean, over ``accumulate`` steps between
    two synchronisations. A step is its noise-free time t0 plus an exponential delay of mean
    noise * t0; the largest of n such delays has mean H_n times theirs (H_n the harmonic number),
    and the delays of accumulated steps add up, so their spread grows as sqrt(accumulate)."""
    if n < 2 or noise <= 0:
        return 1.0
    return 1.0 + (_harmonic(n) - 1.0) * noise / ((1.0 + noise) * math.sqrt(accumulate))


def oversubscription(ranks: int, cores: int, demand: float | None = None) -> float:
    """How much longer a latency-bound exchange takes on a node whose ranks outnumber its cores:
    every hop wakes a process that may then wait for a core. With ``ranks`` processes all runnable,
    sharing ``cores`` round-robin, each runs ranks / cores of the time it would alone; that is the
    bound. ``demand`` (cores' worth of CPU the workers ask for: an emulated device at speed s runs
    s of a core while it computes and sleeps the rest) lowers it as a queue would: with the cores
    busy a share u = demand / cores of the time, a woken process's wait stretches it by 1 / (1 - u).
    1 when the node has a core per rank, or its core count is unknown (0)."""
    if not cores or ranks <= cores:
        return 1.0
    bound = ranks / cores
    if demand is None:
        return bound
    busy = min(demand / cores, 0.99)
    return min(bound, 1.0 / (1.0 - busy))
