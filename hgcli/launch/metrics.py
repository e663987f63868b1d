"""Live aggregation of the ranks' metric lines: per group step, loss, samples/s; cluster total.

A training step is a metric with ``step`` and ``samples`` and no ``event`` (what ``ctx.log(step=,
loss=, samples=)`` of the runtime writes); anything else (evaluations, syncs) only updates
``accuracy`` when it carries one. Rates use the ranks' own ``time`` stamps, so a controller that
falls behind does not see a burst of fake throughput.
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any, Sequence

from .events import BoardView, GroupView, Summary
from ..schema.stages import Plan

WINDOW_S = 10.0   # the live rate is over the last WINDOW_S seconds


# Numbers in rank records beyond this magnitude are treated as missing: steps and versions become
# int64 in TensorBoard files, and a 400-digit integer does not even convert to a float.
LARGEST = float(2 ** 63)


def number(value: Any) -> float | None:
    """A record's number as a float: None for anything else, and for numbers that are not finite
    or beyond LARGEST (rank output is untrusted: Infinity, NaN and huge integers parse as JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) and abs(f) < LARGEST else None


def clean_record(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with every number that ``number`` would refuse (in lists and nested objects too)
    replaced by None, and the keys where that happened: what is stored, shown and aggregated of a
    rank's record, so that --json stays JSON and no reader trips over it."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if number(value) is None:
                bad.append(key)
                return None
            return value
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        return value

    out = clean(data, "")
    return out, sorted(set(bad))


def predictions(plan: Plan) -> tuple[float | None, float | None]:
    """The plan's predicted samples/s for its own strategy, and the ideal (sum of the devices)."""
    return plan.predicted(), plan.ideal_samples_per_s


def group_predictions(plan: Plan) -> tuple[dict[str, float], bool]:
    """Each group's predicted samples/s, and whether it was derived rather than read from the plan.

    The plan's own per-group figures when it carries them (``Plan.predicted_group_samples_per_s``).
    Otherwise the plan's total for its strategy split in proportion to each group's samples per
    step (the sum of its workers' batches): exact for a single group; for several, what the total
    implies when every worker steps in the same time, which the planner's batches aim at."""
    own = {g: r for g, r in plan.predicted_group_samples_per_s.items() if r > 0}
    if own:
        return own, False
    total, _ = predictions(plan)
    if not total:
        return {}, False
    samples = {str(g.id): float(sum(plan.rank(r).batch_size or 0 for r in g.ranks)) for g in plan.groups}
    whole = sum(samples.values())
    if whole <= 0:
        return {}, False
    return {g: total * n / whole for g, n in samples.items()}, len(samples) > 1


class MetricsBoard:
    """Rates are per rank (samples after its first record over the span of its stamps), summed per
    group and over the cluster: ranks of a group log at the same moments, so pooling their records
    before taking a span would count one step too many."""

    def __init__(self, plan: Plan, carried: int = 0) -> None:
        self.plan = plan
        self.carried = carried        # samples trained under an earlier plan of the job (launch --nnodes)
        self._group = {r.rank: ("-" if r.group is None else str(r.group)) for r in plan.workers}
        self._recent: dict[int, collections.deque[tuple[float, float]]] = collections.defaultdict(
            collections.deque)
        self._step: dict[int, int] = {}
        self._loss: dict[int, float] = {}
        self._total: dict[int, float] = collections.defaultdict(float)
        self._first: dict[int, tuple[float, float]] = {}   # rank -> (time, samples) of its first step
        self._last: dict[int, float] = {}
        self._compute_rate: dict[int, float] = {}   # rank -> its finish record's compute samples/s
        self._mean_batch: dict[int, float] = {}     # rank -> its finish record's samples per step
        self._noise: dict[int, float] = {}          # rank -> its finish record's compute noise
        # rank -> (compute samples/s, mean batch, compute noise) of its latest `rates` record: what
        # the finish record would say so far (launch/adapt.py re-groups a running job on them)
        self._live: dict[int, tuple[float, float, float | None]] = {}
        self._live_recent: dict[int, tuple[float, float, float | None]] = {}   # the same, its last steps
        self.snapshot_step: int | None = None       # the newest all-reduce snapshot a worker took
        self.accuracy: float | None = None

    def add(self, rank: int, data: dict[str, Any]) -> None:
        accuracy = number(data.get("accuracy"))
        if accuracy is not None:
            self.accuracy = accuracy
        rate = number(data.get("compute_samples_per_s"))
        if data.get("event") == "finish" and rate is not None and rate > 0 and rank in self._group:
            self._compute_rate[rank] = rate
            done, steps = number(data.get("samples")), number(data.get("steps"))
            if done is not None and steps is not None and done > 0 and steps > 0:
                self._mean_batch[rank] = done / steps
            noise = number(data.get("compute_noise"))
            if noise is not None and noise >= 0:
                self._noise[rank] = noise
        snap = data.get("step")
        if data.get("event") == "snapshot" and isinstance(snap, int) and snap > 0 and rank in self._group:
            self.snapshot_step = max(snap, self.snapshot_step or 0)
        if data.get("event") == "rates" and rate is not None and rate > 0 and rank in self._group:
            done, steps = number(data.get("samples")), number(data.get("steps"))
            noise = number(data.get("compute_noise"))
            if done is not None and steps is not None and done > 0 and steps > 0:
                self._live[rank] = (rate, done / steps, noise if noise is not None and noise >= 0 else None)
                last, last_noise = number(data.get("recent_samples_per_s")), number(data.get("recent_noise"))
                if last is not None and last > 0:
                    self._live_recent[rank] = (last, done / steps, last_noise
                                               if last_noise is not None and last_noise >= 0 else None)
        step, samples = number(data.get("step")), number(data.get("samples"))
        if step is None or samples is None or "event" in data or rank not in self._group:
            return
        at = number(data.get("time")) or time.time()
        self._step[rank] = int(step)
        loss = number(data.get("loss"))
        if loss is not None:
            self._loss[rank] = loss
        self._total[rank] += samples
        self._first.setdefault(rank, (at, samples))
        self._last[rank] = at
        recent = self._recent[rank]
        recent.append((at, samples))
        while recent and recent[0][0] < at - WINDOW_S:
            recent.popleft()

    def _live_rate(self, rank: int) -> float | None:
        recent = self._recent.get(rank)
        if not recent or len(recent) < 2:
            return None
        span = recent[-1][0] - recent[0][0]
        return sum(s for _, s in list(recent)[1:]) / span if span > 0 else None

    def _job_rate(self, rank: int) -> float | None:
        if rank not in self._first:
            return None
        start, first = self._first[rank]
        span = self._last[rank] - start
        return (self._total[rank] - first) / span if span > 0 else None

    def _groups(self) -> dict[str, tuple[int, ...]]:
        groups: dict[str, tuple[int, ...]] = {}
        for rank, group in self._group.items():
            groups[group] = groups.get(group, ()) + (rank,)
        return groups

    @staticmethod
    def _sum(rates: list[float | None]) -> float | None:
        known = [r for r in rates if r is not None]
        return sum(known) if known else None

    def view(self) -> BoardView:
        rows = []
        for group, ranks in self._groups().items():
            steps = [self._step[r] for r in ranks if r in self._step]
            losses = [self._loss[r] for r in ranks if r in self._loss]
            rows.append(GroupView(group=group, ranks=ranks, step=max(steps) if steps else None,
                                  loss=sum(losses) / len(losses) if losses else None,
                                  samples_per_s=self._sum([self._live_rate(r) for r in ranks])))
        predicted, ideal = predictions(self.plan)
        return BoardView(groups=tuple(rows), samples_per_s=self._sum([g.samples_per_s for g in rows]),
                         predicted_samples_per_s=predicted, ideal_samples_per_s=ideal,
                         accuracy=self.accuracy)

    def samples_total(self) -> int:
        """Every training sample the ranks reported, this plan's and the earlier plans' of the job."""
        return self.carried + int(sum(self._total.values()))

    def finished(self) -> dict[int, tuple[float, float, float | None]]:
        """Each worker's compute samples/s, mean batch and compute noise (None: not measured) from
        its finish record, for the workers that reported the first two."""
        return {r: (rate, self._mean_batch[r], self._noise.get(r)) for r, rate in self._compute_rate.items()
                if r in self._mean_batch}

    def live(self, recent: bool = False) -> dict[int, tuple[float, float, float | None]]:
        """Each worker's compute samples/s, mean batch and compute noise so far (``rates`` records);
        with ``recent``, the samples/s and noise of its last steps."""
        return dict(self._live_recent if recent else self._live)

    def _training_rate(self, ranks: list[int]) -> float | None:
        """Samples per second of the job's training: every worker's samples after its first step,
        over the time from the first worker's first step to the last worker's last step. Not the
        sum of the groups' rates, which counts a group that finished its share early as if it
        still trained."""
        span = self._span(ranks)
        done = sum(self._total[r] - self._first[r][1] for r in ranks if r in self._first)
        return done / span if span else None

    def _span(self, ranks: Sequence[int]) -> float | None:
        """Seconds from the first of ``ranks``' first steps to the last of their last steps."""
        stepped = [r for r in ranks if r in self._first]
        if not stepped:
            return None
        return max(self._last[r] for r in stepped) - min(self._first[r][0] for r in stepped)

    def summary(self, elapsed_s: float, rates_stored: bool = False) -> Summary:
        groups, spans = {}, {}
        for group, ranks in self._groups().items():
            rate, span = self._sum([self._job_rate(r) for r in ranks]), self._span(ranks)
            if rate is not None:
                groups[group] = rate
            if span is not None:
                spans[group] = span
        predicted, ideal = predictions(self.plan)
        group_predicted, derived = group_predictions(self.plan)
        return Summary(elapsed_s=elapsed_s, samples=self.samples_total(),
                       samples_per_s=self._training_rate([r for g in self._groups().values() for r in g])
                       if groups else None, group_spans=spans,
                       predicted_samples_per_s=predicted, ideal_samples_per_s=ideal,
                       accuracy=self.accuracy, groups=groups, strategy=self.plan.strategy,
                       predictions=dict(self.plan.predicted_samples_per_s),
                       group_predicted=group_predicted, group_predicted_derived=derived,
                       device_measured={str(r): v for r, v in sorted(self._compute_rate.items())},
                       device_benched={str(r.rank): r.benched_samples_per_s for r in self.plan.workers
                                       if r.benched_samples_per_s},
                       fitted_to=self.plan.fitted_to,
                       from_bench=any(r.benched_samples_per_s for r in self.plan.workers),
                       rates_stored=rates_stored, bench_together=self.plan.bench_together)
