"""Re-splitting the global batch across the groups of a hybrid job while it runs (shard 0 decides).

Groups with a parameter server run the same steps per epoch, each at its own pace: every step is
one block of the epoch's order, cut into the groups' shares (data.step_slice). When a group's share
is small for its speed, it finishes its steps first and waits in ``ctx.finish()`` for the others;
the plan's shares come from a bench, and the speeds a job meets are not the bench's (another job on
a GPU, a card that throttles, the user's model where the bench timed another). Inside a group the
rebalancer fixes this for the members (adapt/rebalance.py); here the same rule re-splits the block across
groups:

* every push of a group's leader carries its **pace** (exchange/gradient.py): the seconds the group spent on
  the step outside its exchange with the PS (its compute, its all-reduce, its data; not the wait
  for an answer, which the staleness rule may hold back), the step's samples, the next data step
  its data source will yield, the data step training has reached, and the data step from which
  its members' newest re-split applies;
* a group that re-splits among its members (adapt/rebalance.py) is about to change speed: its windows
  from before that re-split applies are dropped, and a run of agreeing checks starts again. Both
  rules reacting to one slowed device would otherwise move the block away from its group and,
  once the group's own re-split had fixed it, back;
* shard 0, which every push reaches, keeps each group's per-sample windows. When every group has
  pushed ``CHECK_EVERY`` times since the last check, the rebalancer's rule decides on the groups'
  totals as it does on a group's members (steady rates, a change only when checks in a row agree,
  the check after a change skipped); a group keeps at least one sample per member and at most
  ``GROW_LIMIT`` x its planned total (the plan sized batches to the devices' memory);
* a change applies from a **data step** that no group has handed out and none can reach before it
  hears of it: the furthest-ahead group's next data step plus twice the largest look-ahead of a
  data source (a DataLoader's prefetch) plus ``MARGIN_STEPS`` (an answer in flight under overlap,
  the broadcast to the members);
* every answer of shard 0 carries the schedule; a leader hands new entries to its members with the
  parameters' broadcast (group/link.py), and every member's ``GroupSplit`` cuts its batches by them.

The global batch is kept, so the number of steps per epoch, the PS's weighting (a push counts with
its samples) and the learning rate stay what they were. The schedule is saved in the PS's
checkpoints beside the groups' data positions, so a resumed job cuts the same batches.
"""
from __future__ import annotations

from typing import Any, Sequence

from .rebalance import CHECK_EVERY, Change, GroupSplit, Rebalancer, steady_seconds

MARGIN_STEPS = 4
# (busy seconds, samples, next data step (-1: none), data step reached, data step of the members' newest re-split)
Pace = tuple[float, float, int, int, int]
Schedule = list[tuple[int, tuple[int, ...]]]


def block_layout(plan: Any) -> list[tuple[int, int, tuple[int, ...]]] | None:
    """(group id, its first worker's index, its members' planned batches) for every group, in the
    order of the plan's workers: the order of the groups' shares in a step's block. None when the
    shares cannot be re-split: a group's workers are not adjacent, or a worker has no batch."""
    workers = [w.rank for w in plan.workers]
    out = []
    for g in plan.groups:
        ranks = tuple(g.ranks)
        if not ranks or ranks[0] not in workers:
            return None
        first = workers.index(ranks[0])
        if tuple(workers[first:first + len(ranks)]) != ranks:
            return None
        batches = tuple(plan.rank(r).batch_size for r in ranks)
        if not all(batches):
            return None
        out.append((g.id, first, tuple(int(b) for b in batches)))
    return sorted(out, key=lambda item: item[1])


class GroupShares:
    """Shard 0's schedule of the groups' shares by data step, and the rule that changes it."""

    def __init__(self, layout: Sequence[tuple[int, int, tuple[int, ...]]], *,
                 check_every: int = CHECK_EVERY) -> None:
        self.groups = tuple(g for g, _, _ in layout)
        self.split = GroupSplit(0, [sum(b) for _, _, b in layout])
        self.rebalancer = Rebalancer(self.split, floors=[len(b) for _, _, b in layout])
        self.check_every = check_every
        self._per_sample: dict[int, list[float]] = {g: [] for g in self.groups}
        self._samples: dict[int, float] = {g: 0.0 for g in self.groups}
        self._next: dict[int, int] = {g: -1 for g in self.groups}
        self._ahead: dict[int, int] = {g: 0 for g in self.groups}
        self._resplit: dict[int, int] = {g: 0 for g in self.groups}
        self._checks = 0

    def note(self, group: int, pace: Pace) -> Change | None:
        """A push's pace (module docstring); returns the change it completed a check into, if any."""
        if group not in self._per_sample:
            return None
        busy_s, samples, next_step, reached = float(pace[0]), float(pace[1]), int(pace[2]), int(pace[3])
        resplit = int(pace[4])
        if resplit > self._resplit[group]:
            self._resplit[group] = resplit
            self._per_sample[group], self._samples[group] = [], 0.0
            self.rebalancer.restart()
        if busy_s > 0 and samples > 0 and reached >= resplit:
            self._per_sample[group].append(busy_s / samples)
            self._samples[group] += samples
        self._next[group] = next_step
        self._ahead[group] = max(0, next_step - reached) if next_step >= 0 else 0
        if min(len(w) for w in self._per_sample.values()) < self.check_every:
            return None
        seconds = [steady_seconds(self._per_sample[g], self._samples[g]) for g in self.groups]
        samples_by = [self._samples[g] for g in self.groups]
        margin = 2 * max(self._ahead.values()) + MARGIN_STEPS
        nexts = [self._next[g] + margin if self._next[g] >= 0 else -1 for g in self.groups]
        for g in self.groups:
            self._per_sample[g] = []
            self._samples[g] = 0.0
        self._checks += 1
        return self.rebalancer.check(self._checks, seconds, samples_by, nexts)

    def schedule(self) -> Schedule:
        """Every change so far: (first data step, the groups' totals in block order)."""
        return self.split.schedule

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "planned": list(self.split.planned),
                "schedule": [[start, list(totals)] for start, totals in self.schedule()]}

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """The schedule of a checkpoint written under the same groups and plan totals (False: another
        plan's, e.g. before a re-grouping; this plan's shares start again)."""
        if not state or list(state.get("groups", [])) != list(self.groups) \
                or list(state.get("planned", [])) != list(self.split.planned):
            return False
        for start, totals in state.get("schedule", []):
            self.split.change(int(start), [int(t) for t in totals])
        return True


def group_split(plan: Any, group: int) -> GroupSplit | None:
    """Group ``group``'s re-splittable batches (rebalance.py) when its members are adjacent in the
    plan's worker order (the planner's plans always are) and have plan batches: for a group of two or
    more (its members' split), and in a plan of several groups with PS ranks for every group (their
    shares of the global batch, which the PS's shard 0 moves)."""
    layout = block_layout(plan)
    if layout is None:
        return None
    block = [g for g, _, _ in layout].index(group)
    _, first, planned = layout[block]
    if len(layout) > 1 and plan.ps_shards:
        return GroupSplit(first, planned, block=block, totals=[sum(b) for _, _, b in layout])
    return GroupSplit(first, planned) if len(planned) > 1 else None
