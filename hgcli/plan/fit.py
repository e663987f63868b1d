"""Each device's time(batch) line and memory cap, from its profile: the planner's per-device costs.

A device's mean step is fitted as a + c * batch to its benched step times (fastest repeats, made
non-decreasing, by repeated medians), its noise priced apart; without step times, from its matmul
TFLOP/s. The constants are documented in docs/planning.md (change both together).
"""
from __future__ import annotations

import math
import statistics

from ..schema.stages import DeviceProfile, Measurement, StepSample

# Fraction of device memory the planner fills (allocator fragmentation, CUDA context, workspace).
MEMORY_USABLE_FRACTION = 0.9
# Memory estimate when the profile has no measured memory: weights + grads + two optimizer moments
# (4 x model bytes) static, and activations of one model-size per sample (a rough, stated guess).
STATIC_MEMORY_FACTOR = 4.0
ACTIVATION_MEMORY_FACTOR = 1.0
# Compute estimate when the profile has no step times: 6 FLOPs per parameter per sample (forward 2,
# backward 4) at this fraction of the measured fp32 matmul peak.
FLOPS_PER_PARAMETER_PER_SAMPLE = 6.0
MATMUL_EFFICIENCY = 0.5


def timed(p: DeviceProfile) -> list[StepSample]:
    """The step samples a fit can use."""
    return [s for s in p.steps if s.batch_size > 0 and s.seconds.median > 0]


def _linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """y = a + c * x with a >= 0 and c > 0 (least squares; through the origin when that fails)."""
    n = len(points)
    sx = sy = sxx = sxy = 0.0
    for x, y in points:
        sx += x
        sy += y
        sxx += x * x
        sxy += x * y
    spread = n * sxx - sx * sx          # > 0 exactly when there are two distinct x
    if spread > 1e-12 * n * sxx:
        c = (n * sxy - sx * sy) / spread
        a = (sy - c * sx) / n
        if c > 0 and a >= 0:
            return a, c
    return 0.0, sxy / sxx


def _robust_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """y = a + c * x with a >= 0 and c > 0 by repeated medians (Siegel): c = the median over points
    of the median slope to the others, a = the median of y - c * x. Unlike least squares, one
    batch size measured during a burst of load (its fastest repeat far above the others' line) moves
    neither; with fewer than three sizes it is the line through them."""
    xs = sorted({x for x, _ in points})
    if len(xs) < 2:
        return _linear_fit(points)
    slopes = []
    for i, (xi, yi) in enumerate(points):
        mine = [(yj - yi) / (xj - xi) for j, (xj, yj) in enumerate(points) if j != i and xj != xi]
        slopes.append(statistics.median(mine))
    c = statistics.median(slopes)
    # Equal pooled times give slopes of rounding noise (+-1e-22 s per sample): flat too.
    if not c * xs[-1] > 1e-9 * max(y for _, y in points):
        # Flat (after _monotone, equal times): the step is its fixed cost at every size measured, as
        # a small model on a GPU is (kernel launches and host work set its step, not the batch:
        # benchmarks/RESULTS.md, "Bench"). The per-sample slope is below what the bench resolves;
        # the caller prices it.
        return statistics.median([y for _, y in points]), 0.0
    a = statistics.median([y - c * x for x, y in points])
    if a < 0:
        return 0.0, statistics.median([y / x for x, y in points])
    return a, c


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pool adjacent violators: the closest non-decreasing sequence in x (a larger batch never
    takes less time; a measurement saying otherwise is noise, shared out between the sizes)."""
    points = sorted(points)
    blocks: list[tuple[float, int]] = []      # (sum of y, count)
    for _, y in points:
        total, count = y, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            prev_total, prev_count = blocks.pop()
            total, count = total + prev_total, count + prev_count
        blocks.append((total, count))
    ys = [total / count for total, count in blocks for _ in range(count)]
    return [(x, y) for (x, _), y in zip(points, ys)]


def fit_time(p: DeviceProfile, model_bytes: float) -> tuple[float, float, float] | None:
    """(a, c, noise): mean seconds per step = a + c * batch, and the noise of one step (see
    ``step_noise``); from step times, else from matmul TFLOP/s (noise 0), else None.

    A step's time is its noise-free time plus delays that only ever add (another process on the
    core, a cache refilled after the emulator's pause), so the noise-free line is fitted to each
    batch size's fastest repeat (``min``), made non-decreasing, by repeated medians, and the delays
    are priced apart: one outlier repeat moves a median a lot and a minimum never upwards.
    """
    steps = timed(p)
    lows = [(float(s.batch_size), s.seconds.min if s.seconds.min > 0 else s.seconds.median) for s in steps]
    if lows:
        a, c = _robust_fit(_monotone(lows))
        if c == 0.0 and a > 0:
            # A flat time(batch): price the unresolved per-sample part from the matmul throughput,
            # else as 1% of the fixed cost over the largest batch measured (below the bench's noise).
            c = _flop_slope(p, model_bytes) or a * 0.01 / max(x for x, _ in lows)
        if c > 0 and math.isfinite(c):
            noise = step_noise([s.seconds.median / (a + c * s.batch_size) - 1.0 for s in steps])
            grow = 1.0 + noise
            return a * grow, c * grow, noise
    slope = _flop_slope(p, model_bytes)
    return None if slope is None else (0.0, slope, 0.0)


def matmul_figure(p: DeviceProfile) -> Measurement | None:
    """The fp32 matmul figure, or the best dtype measured when fp32 was not."""
    tflops = p.matmul_tflops.get("fp32") or p.matmul_tflops.get("float32")
    if tflops is None and p.matmul_tflops:
        tflops = max(p.matmul_tflops.values(), key=lambda m: m.median)
    return tflops


def _flop_slope(p: DeviceProfile, model_bytes: float) -> float | None:
    """Seconds per sample of a step from the fp32 matmul throughput (the best dtype measured when
    fp32 was not): FLOPS_PER_PARAMETER_PER_SAMPLE at MATMUL_EFFICIENCY of the peak."""
    tflops = matmul_figure(p)
    if tflops is None or tflops.median <= 0:
        return None
    parameters = model_bytes / 4.0
    return FLOPS_PER_PARAMETER_PER_SAMPLE * parameters / (tflops.median * 1e12 * MATMUL_EFFICIENCY)


def step_noise(excess: list[float]) -> float:
    """Mean delay of a step as a fraction of its noise-free time, from each batch size's
    median / fitted noise-free time - 1. Delays are modelled as exponential (independent
    interruptions): their median is ln 2 x their mean. The median over batch sizes keeps one
    noisy size from deciding."""
    if not excess:
        return 0.0
    return max(0.0, statistics.median(excess)) / math.log(2.0)


def memory_cap(p: DeviceProfile, model_bytes: float) -> int | None:
    """Largest batch that fits in the usable memory; None when the device's memory is unknown."""
    if p.memory_total_mib is None:
        return None
    model_mib = model_bytes / 2**20
    points = [(float(s.batch_size), float(s.memory_mib)) for s in p.steps
              if s.memory_mib is not None and s.batch_size > 0 and s.memory_mib > 0]
    if len({x for x, _ in points}) >= 2:
        static, per_sample = _linear_fit(points)
    elif points:
        batch, mem = points[0]
        static = min(STATIC_MEMORY_FACTOR * model_mib, mem / 2)
        per_sample = (mem - static) / batch
    else:
        static, per_sample = STATIC_MEMORY_FACTOR * model_mib, ACTIVATION_MEMORY_FACTOR * model_mib
    if per_sample <= 0:
        return None
    return math.floor((MEMORY_USABLE_FRACTION * p.memory_total_mib - static) / per_sample)
