"""Live aggregation of the ranks' metric lines: per group step, loss, samples/s; cluster total.

Records are read through their contract (schema/records.py): a training step is a script's record
with ``step`` and ``samples`` and no ``event`` (what ``ctx.log(step=, loss=, samples=)`` writes); a
script's other records (evaluations) only update ``accuracy`` when they carry one; of hgtrain's own
records the board reads ``finish``, ``rates`` and ``snapshot``. ``RecordIntake`` is every record's
way in: it tells the user, once, of records that break the contract. Rates use the ranks' own
``time`` stamps, so a controller that falls behind does not see a burst of fake throughput.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Sequence

from .events import BoardView, GroupView, Summary
from ..schema import records
from ..schema.records import FinishRecord, RatesRecord, RecordKind, SnapshotRecord, UserRecord, number
from ..schema.stages import Plan

WINDOW_S = 10.0   # the live rate is over the last WINDOW_S seconds


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
        """One rank record, as it came (an invalid one of hgtrain's kinds is left out)."""
        entry = records.parse(data)
        if isinstance(entry, UserRecord):
            if entry.accuracy is not None:
                self.accuracy = entry.accuracy
            if entry.is_training_step and rank in self._group:
                self._stepped(rank, entry, number(data.get("time")) or time.time())
        elif rank not in self._group:
            return
        elif isinstance(entry, FinishRecord):
            self._finished(rank, entry)
        elif isinstance(entry, SnapshotRecord) and entry.step > 0:
            self.snapshot_step = max(entry.step, self.snapshot_step or 0)
        elif isinstance(entry, RatesRecord):
            self._rates(rank, entry)

    def _finished(self, rank: int, record: FinishRecord) -> None:
        rate = record.compute_samples_per_s
        if not rate:
            return
        self._compute_rate[rank] = rate
        if record.samples > 0 and record.steps > 0:
            self._mean_batch[rank] = record.samples / record.steps
        if record.compute_noise is not None:
            self._noise[rank] = record.compute_noise

    def _rates(self, rank: int, record: RatesRecord) -> None:
        rate = record.compute_samples_per_s
        if not rate or record.samples <= 0 or record.steps <= 0:
            return
        batch = record.samples / record.steps
        self._live[rank] = (rate, batch, record.compute_noise)
        if record.recent_samples_per_s:
            self._live_recent[rank] = (record.recent_samples_per_s, batch, record.recent_noise)

    def _stepped(self, rank: int, step: UserRecord, at: float) -> None:
        assert step.step is not None and step.samples is not None   # is_training_step
        self._step[rank] = step.step
        if step.loss is not None:
            self._loss[rank] = step.loss
        self._total[rank] += step.samples
        self._first.setdefault(rank, (at, step.samples))
        self._last[rank] = at
        recent = self._recent[rank]
        recent.append((at, step.samples))
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


class RecordIntake:
    """Every rank record's way in on the controller, before it is stored, shown and aggregated:
    numbers that are not finite or are beyond 2^63 become null (``clean_record``), and a record of
    hgtrain's kinds that breaks its contract is counted and reported once per kind (a rank may write
    one every step). Such a record is still stored and shown as it came; the readers leave it out."""

    def __init__(self) -> None:
        self.unclean: set[int] = set()     # ranks told their records had bad numbers
        self.invalid: collections.Counter[RecordKind] = collections.Counter()

    def take(self, rank: int, raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The record to store, show and aggregate, and what to tell the user about it (once)."""
        data, bad = records.clean_record(raw)
        notes = []
        if bad and rank not in self.unclean:
            self.unclean.add(rank)
            notes.append(f"rank {rank}: metric values that are not finite numbers, or beyond 2^63, are "
                         f"treated as missing ({', '.join(bad[:5])})")
        try:
            records.decode(data)
        except records.InvalidRecord as exc:
            self.invalid[exc.kind] += 1
            if self.invalid[exc.kind] == 1:
                notes.append(f"rank {rank}: its '{exc.kind.value}' metric record is not one hgtrain can read "
                             f"({exc.reason}): stored as it came, left out of the job's figures (further "
                             f"invalid '{exc.kind.value}' records are not reported)")
        return data, notes
