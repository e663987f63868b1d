"""Live aggregation of the ranks' metric lines: per group step, loss, samples/s; cluster total.

A training step is a metric with ``step`` and ``samples`` and no ``event`` (what ``ctx.log(step=,
loss=, samples=)`` of the runtime writes); anything else (evaluations, syncs) only updates
``accuracy`` when it carries one. Rates use the ranks' own ``time`` stamps, so a controller that
falls behind does not see a burst of fake throughput.
"""
from __future__ import annotations

import collections
import time
from typing import Any

from .launch_events import BoardView, GroupView, Summary
from .model import Plan

WINDOW_S = 10.0   # the live rate is over the last WINDOW_S seconds


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def predictions(plan: Plan) -> tuple[float | None, float | None]:
    """The plan's predicted samples/s for its own strategy, and the ideal (sum of the devices)."""
    p = plan.predicted_samples_per_s
    return p.get(plan.strategy.value), p.get("ideal")


class MetricsBoard:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._group = {r.rank: ("-" if r.group is None else str(r.group)) for r in plan.workers}
        self._recent: dict[str, collections.deque[tuple[float, float]]] = collections.defaultdict(
            collections.deque)
        self._step: dict[int, int] = {}
        self._loss: dict[int, float] = {}
        self._samples: dict[str, float] = collections.defaultdict(float)
        self._first: dict[str, float] = {}
        self._first_samples: dict[str, float] = {}   # a step's samples count from its own end on
        self._last: dict[str, float] = {}
        self.accuracy: float | None = None

    def add(self, rank: int, data: dict[str, Any]) -> None:
        accuracy = _number(data.get("accuracy"))
        if accuracy is not None:
            self.accuracy = accuracy
        step, samples = _number(data.get("step")), _number(data.get("samples"))
        if step is None or samples is None or "event" in data or rank not in self._group:
            return
        group = self._group[rank]
        at = _number(data.get("time")) or time.time()
        self._step[rank] = int(step)
        loss = _number(data.get("loss"))
        if loss is not None:
            self._loss[rank] = loss
        self._samples[group] += samples
        if group not in self._first or at < self._first[group]:
            self._first[group], self._first_samples[group] = at, samples
        self._last[group] = max(self._last.get(group, at), at)
        recent = self._recent[group]
        recent.append((at, samples))
        while recent and recent[0][0] < at - WINDOW_S:
            recent.popleft()

    def _rate(self, group: str) -> float | None:
        recent = self._recent.get(group)
        if not recent or len(recent) < 2:
            return None
        span = recent[-1][0] - recent[0][0]
        return sum(s for _, s in list(recent)[1:]) / span if span > 0 else None

    def view(self) -> BoardView:
        rows = []
        for group in dict.fromkeys(self._group.values()):
            ranks = tuple(r for r, g in self._group.items() if g == group)
            steps = [self._step[r] for r in ranks if r in self._step]
            losses = [self._loss[r] for r in ranks if r in self._loss]
            rows.append(GroupView(group=group, ranks=ranks, step=max(steps) if steps else None,
                                  loss=sum(losses) / len(losses) if losses else None,
                                  samples_per_s=self._rate(group)))
        rates = [g.samples_per_s for g in rows if g.samples_per_s is not None]
        predicted, ideal = predictions(self.plan)
        return BoardView(groups=tuple(rows), samples_per_s=sum(rates) if rates else None,
                         predicted_samples_per_s=predicted, ideal_samples_per_s=ideal,
                         accuracy=self.accuracy)

    def summary(self, elapsed_s: float) -> Summary:
        """Whole-job rates: every group's samples over its own span, summed (groups overlap in time)."""
        groups = {}
        for group, total in self._samples.items():
            span = self._last[group] - self._first[group]
            if span > 0:
                groups[group] = (total - self._first_samples[group]) / span
        predicted, ideal = predictions(self.plan)
        return Summary(elapsed_s=elapsed_s, samples=int(sum(self._samples.values())),
                       samples_per_s=sum(groups.values()) if groups else None,
                       predicted_samples_per_s=predicted, ideal_samples_per_s=ideal,
                       accuracy=self.accuracy, groups=groups)
