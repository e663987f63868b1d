"""A job's metric records as named series of points: what TensorBoard files and the report draw.

One converter for both ways in: ``hgtrain launch --tensorboard`` feeds it each record as it
arrives, ``hgtrain metrics --format tensorboard`` and ``hgtrain report`` feed it ``metrics.jsonl``
in file order (the order the controller received them). A point belongs to a *run* (``rank3``,
``group0``, ``job``: one TensorBoard run each) and has a *tag*:

* ranks: ``loss`` and ``throughput/samples_per_s`` per training step (the rate over the rank's
  last ``WINDOW_S`` seconds, by its own clock), ``accuracy/<event>`` for records with an accuracy
  (also in the rank's group and the job), and on a parameter server ``staleness`` of each push it
  applied (its ``ps_push`` records);
* groups, once every rank of the group has logged a step: the mean ``loss``, the summed
  ``throughput/samples_per_s`` and beside it the plan's ``throughput/predicted``; ``loss_by_samples``
  whose step is the samples the group has trained on; ``staleness`` of the group's pushes;
* the job, at most once per second of the ranks' clocks (step = seconds since the first record):
  the total ``throughput/samples_per_s`` (of the groups that stepped in the last ``WINDOW_S``)
  with the plan's ``throughput/predicted`` and ``ideal``; and every ``accuracy/<event>``;
* rebalancing (a group leader's ``adapt`` records, checked against the plan): each member's
  ``batch`` from the data step it changed at (the plan's batch at step 0 first), and on the group
  an ``adapt`` point per change (its value: how much shorter the slowest step was predicted);
* re-grouping (the launcher's ``adapt`` record of kind ``regroup``): a ``regroup`` point on the job
  (its value: the new plan's predicted samples/s over the old one's).

Pure Python (no torch, no numpy): the controller imports it.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable

from .events import Adapted
from .metrics import WINDOW_S, group_predictions, predictions
from ..schema import records
from ..schema.records import LARGEST, PsPushRecord, RegroupRecord, UserRecord, number
from ..schema.stages import Plan

PENDING_STEPS = 64   # steps a group waits for a slow (or dead) member before forgetting them


@dataclass(frozen=True)
class Point:
    """One value of a TensorBoard series: a run's tag at a step."""

    run: str        # "rank0", "group1", "job"
    tag: str        # "loss", "throughput/samples_per_s", ...
    value: float
    step: int
    time: float     # seconds since the epoch, by the rank's clock


def group_run(group: str) -> str:
    return "ungrouped" if group == "-" else f"group{group}"


@dataclass
class _Rank:
    group: str
    step: int = 0
    recent: collections.deque[tuple[float, float]] | None = None
    rate: float | None = None


class Series:
    """Feed ``add(rank, record)`` in arrival order; each call returns the points it completes."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._ranks = {r.rank: _Rank("-" if r.group is None else str(r.group)) for r in plan.workers}
        self._members: dict[str, set[int]] = collections.defaultdict(set)
        for rank, state in self._ranks.items():
            self._members[state.group].add(rank)
        # group -> step -> rank -> (loss, rate, samples, time) until every member has logged the step
        self._pending: dict[str, dict[int, dict[int, tuple[float | None, float | None, float, float]]]] = {
            g: {} for g in self._members}
        self._group_samples: dict[str, float] = collections.defaultdict(float)
        self._group_rate: dict[str, tuple[float, float]] = {}   # group -> (its last rate, when)
        self._group_predicted, _ = group_predictions(plan)
        self._predicted, self._ideal = predictions(plan)
        self._start: float | None = None
        self._job_second = -1
        self._groups = {g.id: tuple(g.ranks) for g in plan.groups}
        self._coordinator = plan.ps_shards[0] if plan.ps_shards else None
        self._batches_drawn: set[int] = set()      # groups whose plan batches have a point

    @property
    def start(self) -> float | None:
        """The first record's time: the zero of the job's time axis."""
        return self._start

    def add(self, rank: int, data: dict[str, Any]) -> list[Point]:
        """The points one rank record completes (read through schema/records.py: an invalid record
        of hgtrain's kinds adds none)."""
        at = number(data.get("time"))
        entry = records.parse(data)
        if at is None or entry is None:
            return []
        if self._start is None:
            self._start = at
        state = self._ranks.get(rank)
        if isinstance(entry, UserRecord):
            return self._user(rank, state, entry, at)
        if isinstance(entry, PsPushRecord):
            out = [Point(f"rank{rank}", "staleness", entry.staleness, entry.version, at)]
            # A run is a directory of TensorBoard files: its name comes from the plan, never from
            # the record (a group id the plan does not have writes nothing).
            group = str(entry.group)
            if group in self._members and group != "-":
                out.append(Point(group_run(group), "staleness", entry.staleness, entry.version, at))
            return out
        if isinstance(entry, RegroupRecord):
            # The launcher re-grouped the job (launch/adapt.py): a mark on the job's time line, its
            # value the predicted gain.
            gain = entry.predicted_after / entry.predicted_before if entry.predicted_before else 1.0
            return [Point("job", "regroup", gain, int(at - self._start), at)]
        adapted = Adapted.parse("", rank, data, self._groups, self._coordinator)
        return self._adapted(adapted, at) if adapted is not None else []

    def _user(self, rank: int, state: _Rank | None, entry: UserRecord, at: float) -> list[Point]:
        """A script's record: its accuracy (if any) and, for a training step, its loss and rate."""
        out: list[Point] = []
        if entry.accuracy is not None:
            step = entry.step if entry.step is not None else (state.step if state else 0)
            tag = f"accuracy/{entry.event or 'value'}"
            runs = [f"rank{rank}", "job"] + ([group_run(state.group)] if state else [])
            out += [Point(run, tag, entry.accuracy, step, at) for run in runs]
        if state is None or not entry.is_training_step:
            return out
        assert entry.step is not None and entry.samples is not None   # is_training_step
        state.step = entry.step
        return out + self._rank_step(rank, state, entry.step, entry.loss, entry.samples, at)

    def _adapted(self, event: Adapted, at: float) -> list[Point]:
        gain = 1.0 - event.step_after_s / event.step_before_s if event.step_before_s > 0 else 0.0
        if event.group is None:   # AdaptKind.SHARES: every group
            # The groups' shares of the global batch: a mark on the job's time line (as a
            # re-grouping's), its value the predicted gain.
            return [Point("job", "adapt", gain, max(0, int(at - (self._start or at))), at)]
        out = []
        if event.group not in self._batches_drawn:
            self._batches_drawn.add(event.group)
            out += [Point(f"rank{r}", "batch", float(b), 0, at) for r, b in zip(event.ranks, event.before)]
        step = min(int(LARGEST) - 1, event.data_step)
        out += [Point(f"rank{r}", "batch", float(b), step, at) for r, b in zip(event.ranks, event.batches)]
        out.append(Point(group_run(str(event.group)), "adapt", gain, min(int(LARGEST) - 1, event.step), at))
        return out

    def _rank_step(self, rank: int, state: _Rank, step: int, loss: float | None, samples: float,
                   at: float) -> list[Point]:
        out = []
        if loss is not None:
            out.append(Point(f"rank{rank}", "loss", loss, step, at))
        if state.recent is None:
            state.recent = collections.deque()
        recent = state.recent
        recent.append((at, samples))
        while recent and recent[0][0] < at - WINDOW_S:
            recent.popleft()
        span = recent[-1][0] - recent[0][0]
        # samples after the window's first record over the window's span (as launch/metrics.py)
        state.rate = sum(s for _, s in list(recent)[1:]) / span if len(recent) > 1 and span > 0 else None
        if state.rate is not None:
            out.append(Point(f"rank{rank}", "throughput/samples_per_s", state.rate, step, at))
        pending = self._pending[state.group]
        pending.setdefault(step, {})[rank] = (loss, state.rate, samples, at)
        if len(pending[step]) == len(self._members[state.group]):
            out += self._group_step(state.group, step, pending.pop(step))
            for old in [s for s in pending if s < step]:
                del pending[old]   # a member skipped these (restart): they will never complete
        while len(pending) > PENDING_STEPS:
            del pending[min(pending)]
        return out

    def _group_step(self, group: str, step: int,
                    members: dict[int, tuple[float | None, float | None, float, float]]) -> list[Point]:
        run = group_run(group)
        at = max(m[3] for m in members.values())
        self._group_samples[group] += sum(m[2] for m in members.values())
        out = []
        # The group's loss is its union batch's: each member's mean loss weighted by its samples (a
        # 1-sample member counted as much as a 15-sample one skewed it).
        weighted = [(m[0], m[2]) for m in members.values() if m[0] is not None]
        if weighted:
            total = sum(n for _, n in weighted)
            loss = (sum(v * n for v, n in weighted) / total if total > 0
                    else sum(v for v, _ in weighted) / len(weighted))
            out += [Point(run, "loss", loss, step, at),
                    Point(run, "loss_by_samples", loss, int(self._group_samples[group]), at)]
        rates = [m[1] for m in members.values()]
        if all(r is not None for r in rates):
            rate = sum(r for r in rates if r is not None)
            self._group_rate[group] = (rate, at)
            out.append(Point(run, "throughput/samples_per_s", rate, step, at))
            predicted = self._group_predicted.get(group)
            if predicted is not None:
                out.append(Point(run, "throughput/predicted", predicted, step, at))
            out += self._job_rate(at)
        return out

    def _job_rate(self, at: float) -> list[Point]:
        assert self._start is not None
        second = min(int(LARGEST) - 1, max(0, int(at - self._start)))   # an int64 step
        if second <= self._job_second or len(self._group_rate) < len(self._members):
            return []
        self._job_second = second
        # a group that has stopped stepping (done with its share, or failed) no longer adds to the total
        total = sum(rate for rate, when in self._group_rate.values() if when >= at - WINDOW_S)
        out = [Point("job", "throughput/samples_per_s", total, second, at)]
        for tag, value in (("throughput/predicted", self._predicted), ("throughput/ideal", self._ideal)):
            if value is not None:
                out.append(Point("job", tag, value, second, at))
        return out


def points_of(plan: Plan, rows: Iterable[dict[str, Any]]) -> list[Point]:
    """Every point of a job's recorded metrics (``metrics.jsonl`` rows, which carry ``rank``)."""
    series = Series(plan)
    out: list[Point] = []
    for row in rows:
        rank = row.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            out += series.add(rank, row)
    return out
