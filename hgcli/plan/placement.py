"""The placement planner: Inventory + Profiles + JobSpec -> Plan.

Pure (no I/O, no torch, no printing) so it can be tested exhaustively and run on huge synthetic
clusters. This module turns profiles into per-device costs, sets the batch sizes, forms the groups
and picks a strategy; hgcli/plan/cost.py predicts throughput. Every constant is documented in
docs/planning.md (change both together). Work is per device, per group or per node, never over all
device pairs, so 4096 devices plan in well under a second.
"""
from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping

from ..errors import StateError, UsageError
from ..schema.stages import (
    CPU, SCHEMA_VERSION, DeviceProfile, ExchangeProfile, GroupPlan, GroupSyncProfile, Ideal, Inventory, JobSpec,
    Measurement, ModelSpec, Plan, Prediction, Profiles, RankPlan, Role, ScriptRates, StepSample, Strategy, Wire,
)
from .cost import KNEE_TOLERANCE, CostModel, Device, Network, Option, plan_overlap

# Devices whose throughputs differ by at most this factor are "like" and may share an all-reduce group.
LIKE_SPEED_RATIO = 1.25
# Benches of one device model on two nodes (or minutes apart) differ by up to this factor each way
# beyond the spread of their own repeats (a shared CPU drifts 20-40% within seconds): devices of one
# model and declared speed closer than that are one kind, costed alike.
BENCH_DRIFT = 1.25
# auto keeps synchronous all-reduce unless another strategy is predicted more than this much faster.
AUTO_MARGIN = 0.05
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
# Per-device batch when the job does not say.
DEFAULT_BATCH_PER_DEVICE = 32
# Model assumed when neither the job nor the profiles name one (the paper's ResNet-50).
DEFAULT_MODEL = ModelSpec(name="assumed ResNet-50 size (bench with --model to measure yours)",
                          parameters=25_557_032)


def make_plan(inventory: Inventory, profiles: Profiles, job: JobSpec, rates: ScriptRates | None = None,
              keep_ps: tuple[str, ...] = ()) -> Plan:
    """Plan the ranks of one job; raises HgError for a request that cannot be planned. ``rates``: what
    a job of the same script measured (hgcli/bench/rates.py), to fit the devices' costs to.
    ``keep_ps``: the nodes of an earlier plan's PS shards, in shard order (``launch --nnodes`` after a
    lost node): when every one is still here, the plan keeps a PS on each, whose checkpoint holds
    the training state, and chooses among hybrid and ps around them."""
    _check_inputs(inventory, profiles, job)
    model = job.model or profiles.model or DEFAULT_MODEL
    model_bytes = float(model.parameters * model.bytes_per_parameter)
    node_names = [n.name for n in inventory.nodes]
    alone, skipped, kinds = _usable_devices(inventory, profiles, model_bytes)
    together = _beside_neighbours(alone, kinds, node_names, profiles)
    devices = _fit_to_rates(together, kinds, node_names, rates) if rates is not None else together
    fitted_to = rates.job_id if rates is not None and any(d.fitted for d in devices) else None
    bench_together = any(d.together for d in devices)
    if not devices:
        why = _summarise(skipped) if skipped else "the profiles list no devices"
        raise UsageError(f"no usable devices to plan on ({why}); run 'hgtrain bench' again")
    global_batch = job.global_batch if job.global_batch is not None else DEFAULT_BATCH_PER_DEVICE * len(devices)
    real, batches = _assign_batches(devices, global_batch, node_names)
    net = Network(node_names, profiles.links)
    cost = CostModel(devices, batches, net, model_bytes, global_batch, inventory, job,
                     _exchanges(inventory, profiles), _group_syncs(inventory, profiles),
                     wire_bytes=float(model.parameters * job.wire.bytes))

    allreduce = cost.allreduce()
    classes = _speed_classes(devices, real)
    kept = len(devices) > 1 and bool(keep_ps) and all(n in node_names for n in keep_ps)
    if kept:
        cost.fixed_ps = tuple(node_names.index(n) for n in keep_ps)
    hybrid = cost.best_async(Strategy.HYBRID, _hybrid_layouts(devices, classes))
    ps = cost.best_async(Strategy.PS, [tuple((i,) for i in range(len(devices)))])
    options = {Strategy.ALLREDUCE: allreduce, Strategy.HYBRID: hybrid, Strategy.PS: ps}
    if kept and job.strategy in (Strategy.AUTO, Strategy.HYBRID, Strategy.PS):
        pick = job.strategy if job.strategy is not Strategy.AUTO else max(
            (Strategy.HYBRID, Strategy.PS), key=lambda s: options[s].samples_per_s)
        chosen = options[pick]
        reason = (f"re-planned keeping the PS shards on {', '.join(dict.fromkeys(keep_ps))}, whose checkpoints "
                  f"hold the training state: {pick.value} ({chosen.summary})")
    else:
        chosen, reason = _choose(job.strategy, options, len(classes), len(devices))
    reason += _below_knee_note(batches, [knee(d) for d in devices], global_batch)
    if skipped:
        reason += "; not used: " + _summarise(skipped)
    predicted: dict[Prediction, float] = {s: o.samples_per_s for s, o in options.items()}
    # The ideal stays each device's own speed, the bench's (alone): a fitted cost has the node's
    # contention in it, and an ideal that shrank with it would flatter every run against it.
    predicted[Ideal.IDEAL] = sum(b / d.time(b) for d, b in zip(alone, batches))
    if fitted_to is not None:
        reason += f"; device costs fitted to this script's compute measured in job {fitted_to}"
    elif bench_together:
        reason += "; device costs from each node's devices benched together, their contention included"
    plan = _build_plan(chosen, devices, batches, node_names, predicted, global_batch, inventory.cluster,
                       reason, model, overlap=plan_overlap(job), wire=job.wire, fitted_to=fitted_to)
    return dataclasses.replace(plan, bench_together=bench_together)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _check_inputs(inventory: Inventory, profiles: Profiles, job: JobSpec) -> None:
    if inventory.cluster != profiles.cluster:
        raise StateError(f"the profiles were measured on cluster {profiles.cluster}, the inventory is of "
                         f"cluster {inventory.cluster}; run 'hgtrain bench' again")
    for what, version in (("inventory", inventory.version), ("profiles", profiles.version)):
        if version != SCHEMA_VERSION:
            raise StateError(f"the stored {what} has format version {version}, this hgtrain reads "
                             f"{SCHEMA_VERSION}; run 'hgtrain probe' and 'hgtrain bench' again")
    if job.global_batch is not None and job.global_batch < 1:
        raise UsageError(f"global batch must be at least 1, got {job.global_batch}")
    if job.ps_ranks is not None and job.ps_ranks < 1:
        raise UsageError(f"the number of PS ranks must be at least 1, got {job.ps_ranks}")
    if job.staleness is not None and job.staleness < 0:
        raise UsageError(f"the staleness bound must be 0 or more, got {job.staleness}")
    model = job.model or profiles.model
    if model is not None and (model.parameters < 1 or model.bytes_per_parameter < 1):
        raise UsageError(f"model {model.name!r} must have at least one parameter of at least one byte")


def _exchanges(inventory: Inventory, profiles: Profiles) -> dict[int, ExchangeProfile]:
    """The measured PS push of each node (node index -> profile), from any of its devices."""
    node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
    out: dict[int, ExchangeProfile] = {}
    for p in profiles.devices:
        i = node_index.get(p.node)
        if i is not None and p.exchange is not None and p.exchange.bytes > 0 and i not in out:
            out[i] = p.exchange
    return out


def _group_syncs(inventory: Inventory, profiles: Profiles) -> dict[int, GroupSyncProfile]:
    """The measured synchronous step of each emulated node's devices (node index -> profile)."""
    node_index = {n.name: i for i, n in enumerate(inventory.nodes)}
    out: dict[int, GroupSyncProfile] = {}
    for p in profiles.devices:
        i = node_index.get(p.node)
        if i is not None and p.group_sync is not None and i not in out:
            out[i] = p.group_sync
    return out


_DIGITS = re.compile(r"(\d+)")


def _natural_key(text: str) -> tuple:
    """gpu2 before gpu10."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


def _usable_devices(inventory: Inventory, profiles: Profiles,
                    model_bytes: float) -> tuple[list[Device], list[str], list[list[int]]]:
    """Devices the plan may use, in node then device order, a note for each one left out, and their
    kinds (indices into the devices). Devices of one kind (``_kinds``) share one cost."""
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
        fit = _fit_time(p, model_bytes)
        if fit is None:
            skipped.append(f"{label} (no step times or matmul figures)")
            continue
        cap = _memory_cap(p, model_bytes)
        if cap is not None and cap < 1:
            skipped.append(f"{label} (cannot hold one sample in {p.memory_total_mib} MiB)")
            continue
        dev = Device(node_index[p.node], p.device, p.emulated, p.speed, fit[0], fit[1], cap, fit[2],
                     benched=max((s.batch_size for s in _timed(p)), default=0))
        usable.append((dev.node, _natural_key(p.device), dev, p))
    usable.sort(key=lambda t: (t[0], t[1]))
    devices = [d for _, _, d, _ in usable]
    kinds = _kinds(devices, [p for _, _, _, p in usable])
    for kind in kinds:
        if len(kind) > 1:
            shared = _pooled([devices[i] for i in kind])
            for i in kind:
                devices[i] = dataclasses.replace(devices[i], a=shared.a, c=shared.c, noise=shared.noise,
                                                 cap=shared.cap, benched=shared.benched)
    return devices, skipped, kinds


def _beside_neighbours(devices: list[Device], kinds: list[list[int]], node_names: list[str],
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


def _fit_to_rates(devices: list[Device], kinds: list[list[int]], node_names: list[str],
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


def _timed(p: DeviceProfile) -> list[StepSample]:
    """The step samples a fit can use."""
    return [s for s in p.steps if s.batch_size > 0 and s.seconds.median > 0]


# ---------------------------------------------------------------------------------------------
# Kinds: devices of one model whose benches agree within noise share one cost
# ---------------------------------------------------------------------------------------------

def _kinds(devices: list[Device], profiles: list[DeviceProfile]) -> list[list[int]]:
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
    steps = _timed(p)
    if steps:
        return {s.batch_size: (s.seconds.min if s.seconds.min > 0 else s.seconds.median,
                               max(s.seconds.max, s.seconds.median)) for s in steps}
    tflops = _tflops(p)
    if tflops is None or tflops.median <= 0:
        return {}
    fast = tflops.max if tflops.max > 0 else tflops.median
    slow = tflops.min if tflops.min > 0 else tflops.median
    return {0: (1.0 / max(fast, tflops.median), 1.0 / min(slow, tflops.median))}


def _pooled(members: list[Device]) -> Device:
    """One cost for a kind: the median fit of its members, the smallest memory cap among them."""
    caps = [d.cap for d in members if d.cap is not None]
    return dataclasses.replace(members[0], a=statistics.median(d.a for d in members),
                               c=statistics.median(d.c for d in members),
                               noise=statistics.median(d.noise for d in members),
                               cap=min(caps) if caps else None, benched=min(d.benched for d in members))


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


def _fit_time(p: DeviceProfile, model_bytes: float) -> tuple[float, float, float] | None:
    """(a, c, noise): mean seconds per step = a + c * batch, and the noise of one step (see
    ``step_noise``); from step times, else from matmul TFLOP/s (noise 0), else None.

    A step's time is its noise-free time plus delays that only ever add (another process on the
    core, a cache refilled after the emulator's pause), so the noise-free line is fitted to each
    batch size's fastest repeat (``min``), made non-decreasing, by repeated medians, and the delays
    are priced apart: one outlier repeat moves a median a lot and a minimum never upwards.
    """
    steps = _timed(p)
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


def _tflops(p: DeviceProfile) -> Measurement | None:
    """The fp32 matmul figure, or the best dtype measured when fp32 was not."""
    tflops = p.matmul_tflops.get("fp32") or p.matmul_tflops.get("float32")
    if tflops is None and p.matmul_tflops:
        tflops = max(p.matmul_tflops.values(), key=lambda m: m.median)
    return tflops


def _flop_slope(p: DeviceProfile, model_bytes: float) -> float | None:
    """Seconds per sample of a step from the fp32 matmul throughput (the best dtype measured when
    fp32 was not): FLOPS_PER_PARAMETER_PER_SAMPLE at MATMUL_EFFICIENCY of the peak."""
    tflops = _tflops(p)
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


def _memory_cap(p: DeviceProfile, model_bytes: float) -> int | None:
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


# ---------------------------------------------------------------------------------------------
# Batch sizes: from each device's throughput curve (its knee), split by speed
# ---------------------------------------------------------------------------------------------

def _summarise(notes: list[str], limit: int = 6, sep: str = "; ") -> str:
    """The first few of a long list, so an error about 4096 devices stays one readable line."""
    more = f" and {len(notes) - limit} more" if len(notes) > limit else ""
    return sep.join(notes[:limit]) + more


def _name_devices(devices: list[Device], node_names: list[str]) -> str:
    return _summarise([f"{d.device}@{node_names[d.node]}" for d in devices], sep=", ")


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


def _assign_batches(devices: list[Device], global_batch: int,
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
        listed = _summarise([f"{d.device}@{node_names[d.node]} <= {d.cap}" for d in tight], sep=", ")
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


def _below_knee_note(batches: list[int], knees: list[int], global_batch: int) -> str:
    """The reason's word on devices the global batch holds below their knee, if any."""
    below = sum(b < k for b, k in zip(batches, knees))
    if not below:
        return ""
    return (f"; global batch {global_batch} holds {below} of {len(batches)} devices below their knee (the batch "
            f"within {KNEE_TOLERANCE:.0%} of their best samples/s; all at their knee take {sum(knees):,} per "
            f"step): batches split by speed below it")


# ---------------------------------------------------------------------------------------------
# Strategies: speed classes, group layouts, the choice
# ---------------------------------------------------------------------------------------------

def _speed_classes(devices: list[Device], batches: list[float]) -> list[list[int]]:
    """Devices sorted by samples/s at their batch; a class holds devices within LIKE_SPEED_RATIO of
    its fastest member, so a class never spans more than that ratio. The batches are the real-valued
    ones, so rounding never splits identical devices."""
    speed = [b / d.time(b) for d, b in zip(devices, batches)]
    order = sorted(range(len(devices)), key=lambda i: -speed[i])
    classes: list[list[int]] = []
    for i in order:
        if classes and speed[classes[-1][0]] <= LIKE_SPEED_RATIO * speed[i]:
            classes[-1].append(i)
        else:
            classes.append([i])
    return [sorted(c) for c in classes]


def _hybrid_layouts(devices: list[Device], classes: list[list[int]]) -> list[tuple[tuple[int, ...], ...]]:
    """Two groupings of the speed classes: one group per class (spanning nodes), and one group per
    class and node (all-reduce only on intra-node links). The cost model picks between them."""
    merged = tuple(tuple(c) for c in classes)
    per_node: list[tuple[int, ...]] = []
    for c in classes:
        by_node: dict[int, list[int]] = {}
        for i in c:
            by_node.setdefault(devices[i].node, []).append(i)
        per_node.extend(tuple(v) for v in by_node.values())
    layouts = [merged]
    if len(per_node) != len(merged):
        layouts.append(tuple(per_node))
    return layouts


def predicted_best(predicted: Mapping[Prediction, float]) -> Strategy:
    """The strategy ``auto`` takes from the cost model's predictions (``predicted``: samples/s by
    strategy name): hybrid when it beats allreduce by more than AUTO_MARGIN, else allreduce. ps is
    never auto's pick: it splits every speed class into one asynchronous group per device, and each
    group more adds staleness and, under Adam and kin, a full optimizer step per push, which cost
    accuracy that samples/s does not show (docs/planning.md, rule 2). ``auto`` follows this except on
    a homogeneous cluster (rule 1)."""
    ar, hy = predicted[Strategy.ALLREDUCE], predicted[Strategy.HYBRID]
    return Strategy.HYBRID if hy > ar * (1 + AUTO_MARGIN) else Strategy.ALLREDUCE


def _ps_aside(ps: Option, chosen: Option) -> str:
    """What the reason adds when the predictions favour ps over auto's pick (rule 2)."""
    if (ps.samples_per_s <= chosen.samples_per_s * (1 + AUTO_MARGIN)
            or sorted(ps.groups) == sorted(chosen.groups)):
        return ""
    return (f"; ps (every device its own asynchronous group) was predicted "
            f"{ps.samples_per_s / chosen.samples_per_s - 1:.0%} above it, but auto keeps like-speed devices "
            f"synchronous: --strategy ps asks for it")


def _choose(requested: Strategy, options: dict[Strategy, Option], classes: int,
            devices: int) -> tuple[Option, str]:
    ar = options[Strategy.ALLREDUCE]
    if requested is not Strategy.AUTO:
        chosen = options[requested]
        auto, _ = _choose(Strategy.AUTO, options, classes, devices)
        note = "" if auto is chosen else f"; auto would choose {auto.strategy.value}"
        return chosen, f"{requested.value} requested ({chosen.summary}){note}"
    hy, ps = options[Strategy.HYBRID], options[Strategy.PS]
    if classes == 1:
        # Rule 1 holds whatever the predictions say; saying what they favour lets a user ask for it.
        best = max((hy, ps), key=lambda o: o.samples_per_s)
        aside = "" if best.samples_per_s <= ar.samples_per_s * (1 + AUTO_MARGIN) else (
            f"; the predictions alone favour {best.strategy.value} "
            f"({best.samples_per_s / ar.samples_per_s - 1:.0%} above allreduce; "
            f"--strategy {best.strategy.value} asks for it)")
        return ar, (f"homogeneous: all {devices} devices within {LIKE_SPEED_RATIO}x of each other's speed, "
                    f"so one synchronous all-reduce group (plain DDP) with no parameter servers{aside}")
    best = options[predicted_best({s: o.samples_per_s for s, o in options.items()})]
    if best is ar:
        return ar, (f"allreduce predicted {ar.samples_per_s:.4g} samples/s, hybrid {hy.samples_per_s:.4g}: "
                    f"not more than {AUTO_MARGIN:.0%} faster, so the synchronous all-reduce is kept "
                    f"({classes} speed classes, batches proportional to speed){_ps_aside(ps, ar)}")
    gain = best.samples_per_s / ar.samples_per_s - 1
    return best, (f"{best.strategy.value} predicted {best.samples_per_s:.4g} samples/s, {gain:.0%} above "
                  f"allreduce ({ar.samples_per_s:.4g}): {classes} speed classes, {best.summary}"
                  f"{_ps_aside(ps, best)}")


# ---------------------------------------------------------------------------------------------
# The Plan value
# ---------------------------------------------------------------------------------------------

def _build_plan(option: Option, devices: list[Device], batches: list[int], node_names: list[str],
                predicted: Mapping[Prediction, float], global_batch: int, cluster: str, reason: str,
                model: ModelSpec, overlap: bool = False, wire: Wire = Wire.FP32,
                fitted_to: str | None = None) -> Plan:
    """Workers first (groups in node order), then PS ranks in node order; local ranks per node."""
    order = sorted(range(len(option.groups)), key=lambda g: option.groups[g][0])
    ranks: list[RankPlan] = []
    groups: list[GroupPlan] = []
    local: dict[int, int] = {}

    def next_local(node: int) -> int:
        local[node] = local.get(node, 0) + 1
        return local[node] - 1

    for gid, g in enumerate(order):
        members = []
        for i in option.groups[g]:
            d = devices[i]
            ranks.append(RankPlan(rank=len(ranks), role=Role.WORKER, node=node_names[d.node], device=d.device,
                                  group=gid, batch_size=batches[i], local_rank=next_local(d.node),
                                  emulated=d.emulated, speed=d.speed,
                                  benched_samples_per_s=round(d.rate(batches[i]), 3)))
            members.append(ranks[-1].rank)
        groups.append(GroupPlan(id=gid, ranks=tuple(members), accumulate=option.accumulate[g]))
    shards = []
    for node in sorted(option.ps_nodes):
        ranks.append(RankPlan(rank=len(ranks), role=Role.PS, node=node_names[node], device=CPU,
                              local_rank=next_local(node)))
        shards.append(ranks[-1].rank)
    group_rates = {str(gid): option.group_rates[g] for gid, g in enumerate(order)} if option.group_rates else {}
    return Plan(strategy=option.strategy, world_size=len(ranks), groups=tuple(groups), ranks=tuple(ranks),
                predicted_samples_per_s=predicted, predicted_group_samples_per_s=group_rates,
                global_batch=global_batch, cluster=cluster, reason=reason,
                staleness_bound=option.staleness if shards else 0, ps_shards=tuple(shards), model=model,
                overlap=overlap and bool(shards), wire=wire if shards else Wire.FP32, fitted_to=fitted_to)
