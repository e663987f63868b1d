"""Re-grouping a running job (``launch --adapt``, the default): an all-reduce job whose workers
straggle moves to a plan with asynchronous groups when the cost model, fitted to what the job
measures, predicts a gain.

Inside a group, the runtime rebalances the batch as speeds change (runtime/adapt/rebalance.py). What it
cannot fix is noise: a synchronous step waits for the slowest member, and when a different worker
is slow at every step, no split helps. Groups that exchange through parameter servers do not wait
for each other. The planner prices that wait (``plan/delays.py``, ``straggle``) from each device's
compute noise, but at launch it knows only the bench's, taken of each device alone.

So while an all-reduce job runs, each worker reports its compute rate and noise so far every few
seconds (``rates`` records, runtime/group/engine.py). From ``WARMUP_S`` of training on, every
``CHECK_EVERY_S`` the launcher plans the same nodes again from the stored profiles, fitted to those
rates (as the next launch of the script would be, bench/rates.py). When that plan has PS ranks and
predicts at least ``GAIN`` more samples/s than all-reduce under the same rates, the job stops and
starts again on it (one restart, not counted against ``--restarts``), its workers resuming from the
newest training-state snapshot every node has, taken every ``SNAPSHOT_S`` while the job is watched.
The PS starts from those parameters; the optimizer state of the PS update rule starts fresh.

The way back: while the re-grouped plan runs, the first worker of its first group snapshots its
state (its model holds the parameters the PS last answered), and the launcher plans again from the
rates of the workers' last steps (``recent_*`` in the ``rates`` records). When the stragglers have
recovered, so that the asynchronous plan is no longer predicted more than the planner's
``AUTO_MARGIN`` above all-reduce (where ``--strategy auto`` keeps all-reduce, plan/strategy.py), at
``BACK_LOOKS`` looks in a row, the job goes back to all-reduce, resuming that snapshot with a fresh
optimizer state (the PS's is not carried over, as on the way there). Out at a predicted gain of
``GAIN``, back below ``AUTO_MARGIN``: a job whose prediction sits between the two stays as it is.

Only under ``--strategy auto`` with the planner's own plan (not ``--plan``), and once each way per
job: a job whose workers straggle, recover and straggle again stays on all-reduce the second time.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from ..schema.stages import Engine, Plan, Strategy
from .elastic import plan_nodes, same_batch
from .metrics import MetricsBoard, group_predictions
from .request import LaunchRequest

WARMUP_S = 15.0       # of training before the first look: a noise figure needs 10 windows or more
CHECK_EVERY_S = 5.0   # between two looks (the runtime's records come every 5 s)
GAIN = 0.1            # the re-grouped plan's predicted samples/s over all-reduce's, both fitted
SNAPSHOT_S = 10.0     # between two snapshots of a watched job (what a re-grouping redoes at most)
# Fault injection for tests: re-group into a ps plan (groups of one) after this many seconds,
# whatever the prediction (the decision itself is tested on its own, tests/unit/test_regroup.py).
FORCE_ENV = "HGTRAIN_TEST_REGROUP_AFTER"
FORCE_BACK_ENV = "HGTRAIN_TEST_REGROUP_BACK_AFTER"   # the same for the way back, in the re-grouped attempt
BACK_LOOKS = 2        # looks in a row that must predict the way back's gain


@dataclass(frozen=True)
class Regroup:
    """A re-grouping that pays: the plan the next attempt runs and why (an attempt that ends
    ``AttemptEnd.REGROUP`` carries it, launch/ending.py)."""

    plan: Plan                  # the next attempt's
    reason: str                 # one line: what was measured, what is predicted
    predicted_now: float        # all-reduce's samples/s, fitted to the measured rates
    predicted_new: float        # the new plan's


def watched(request: LaunchRequest, plan: Plan) -> bool:
    """Whether this attempt's plan may be re-grouped while it runs (not fsdp groups: a re-grouped
    plan has parameter servers, which sharded groups cannot use yet)."""
    return (request.adapt and request.plan_file is None and request.job.strategy is Strategy.AUTO
            and not request.detach and not plan.ps_shards and len(plan.workers) > 1
            and all(g.engine is Engine.DDP for g in plan.groups))


def watched_back(request: LaunchRequest, plan: Plan) -> bool:
    """Whether a re-grouped attempt's plan may go back to all-reduce while it runs."""
    return (request.adapt and request.plan_file is None and request.job.strategy is Strategy.AUTO
            and not request.detach and bool(plan.ps_shards))


def snapshot_every(plan: Plan, seconds: float = SNAPSHOT_S) -> int:
    """Optimizer steps of about ``seconds`` at the plan's predicted pace: a count, not a clock, so
    that the first worker of every node snapshots the same steps (a re-grouped plan resumes a step
    that every node has). Under a plan with PS ranks, the steps of its first group, whose first
    worker is the one that snapshots."""
    first = plan.groups[0] if plan.ps_shards and plan.groups else None
    if first is None:
        predicted = plan.predicted() or 0.0
        per_step = sum(r.batch_size or 0 for r in plan.workers) or 1
    else:
        predicted = group_predictions(plan)[0].get(str(first.id)) or 0.0
        per_step = sum(plan.rank(r).batch_size or 0 for r in first.ranks) or 1
    return max(1, math.ceil(seconds * predicted / per_step)) if predicted > 0 else 20


class RegroupWatch:
    """Looks at the board of one attempt; ``check`` returns a re-grouping once, when it pays.
    ``back``: the attempt runs a re-grouped plan, and the way back to all-reduce is watched."""

    def __init__(self, request: LaunchRequest, plan: Plan, job_id: str,
                 clock: Callable[[], float] = time.monotonic, back: bool = False) -> None:
        self.request, self.plan, self.job_id, self.clock, self.back = request, plan, job_id, clock, back
        self.started = clock()
        self.forced = float(os.environ.get(FORCE_BACK_ENV if back else FORCE_ENV) or 0)
        self.next_at = self.started + (self.forced or WARMUP_S)
        self.done = False
        self.looks = 0                  # looks in a row that predicted the way back's gain
        self.last: str | None = None    # the last look's verdict (tests, --debug)

    def check(self, board: MetricsBoard) -> Regroup | None:
        now = self.clock()
        if self.done or now < self.next_at:
            return None
        if board.snapshot_step is None:
            self.last = "no snapshot to resume from yet"
            return None
        self.next_at = now + CHECK_EVERY_S
        if self.forced:
            return self._forced()
        live = board.live(recent=self.back)
        if any(live.get(w.rank, (0, 0, None))[2] is None for w in self.plan.workers):
            self.last = "not every worker has reported its noise yet"
            return None
        from ..bench.profiles import load_profiles
        from ..bench.rates import rates_of_job
        from ..plan.pipeline import replan_on
        from ..plan.slowdowns import with_slowdowns

        profiles = load_profiles(self.plan.cluster)
        if profiles is None:
            self.done, self.last = True, "no stored bench to plan from"
            return None
        rates = rates_of_job(self.plan, self.job_id, self.request.command, profiles.measured_at, live)
        if rates is None:
            self.last = "no rates"
            return None
        request = self.request
        plan = with_slowdowns(replan_on(request.cluster, same_batch(request, self.plan),
                                        list(plan_nodes(self.plan)), rates=rates), request.cluster)
        noise = max((r.noise or 0.0) for r in rates.rates)
        if self.back:
            return self._back(plan, noise)
        now_rate = plan.predicted(Strategy.ALLREDUCE) or 0.0
        new_rate = plan.predicted() or 0.0
        self.last = (f"{plan.strategy.value} {new_rate:,.0f} samples/s against allreduce {now_rate:,.0f} "
                     f"(measured noise up to {noise:.2f})")
        if not plan.ps_shards or now_rate <= 0 or new_rate < now_rate * (1 + GAIN):
            return None
        self.done = True
        groups = "+".join(str(len(g.ranks)) for g in plan.groups)
        reason = (f"workers straggle (compute noise up to {noise:.2f} of their step): {plan.strategy.value} "
                  f"with groups of {groups} is predicted {new_rate:,.0f} samples/s against "
                  f"{now_rate:,.0f} for allreduce, fitted to the rates measured so far")
        return Regroup(plan=plan, reason=reason, predicted_now=now_rate, predicted_new=new_rate)

    def _back(self, plan: Plan, noise: float) -> Regroup | None:
        """The way back: ``plan`` is the planner's choice on the same nodes, fitted to the rates
        of the workers' last steps."""
        from ..plan.strategy import AUTO_MARGIN

        now_rate = plan.predicted(self.plan.strategy) or 0.0
        new_rate = plan.predicted(Strategy.ALLREDUCE) or 0.0
        self.last = (f"allreduce {new_rate:,.0f} samples/s against {self.plan.strategy.value} {now_rate:,.0f} "
                     f"(recent noise up to {noise:.2f})")
        if plan.ps_shards or new_rate <= 0 or now_rate > new_rate * (1 + AUTO_MARGIN):
            self.looks = 0
            return None
        self.looks += 1
        if self.looks < BACK_LOOKS:
            return None
        self.done = True
        reason = (f"workers no longer straggle (recent compute noise up to {noise:.2f} of their step): "
                  f"{self.plan.strategy.value} is predicted {now_rate:,.0f} samples/s against {new_rate:,.0f} for "
                  f"allreduce, not more than {AUTO_MARGIN:.0%} faster, fitted to the rates of their last steps")
        return Regroup(plan=plan, reason=reason, predicted_now=now_rate, predicted_new=new_rate)

    def _forced(self) -> Regroup:
        from ..plan.pipeline import replan_on
        from ..plan.slowdowns import with_slowdowns

        self.done = True
        strategy = Strategy.ALLREDUCE if self.back else Strategy.PS
        job = dataclasses.replace(same_batch(self.request, self.plan), strategy=strategy)
        plan = with_slowdowns(replan_on(self.request.cluster, job, list(plan_nodes(self.plan))),
                              self.request.cluster)
        return Regroup(plan=plan, reason=f"{FORCE_BACK_ENV if self.back else FORCE_ENV} (a test)", predicted_now=0.0,
                       predicted_new=plan.predicted() or 0.0)
