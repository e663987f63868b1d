"""Rebalancing inside a synchronous group: each member's batch follows the speed it measures.

A group steps as slowly as its slowest member. The plan splits the group's batch by speeds benched
before the job; while it trains, a GPU that another job lands on, that throttles, or whose data
loader falls behind, makes the split wrong (LB-BSP, SoCC'20, re-sizes the batches at every barrier
for this reason). Here every member measures its compute per step as it trains (group/engine.py: from the
step's start to its last gradient bucket, which excludes the wait for the others), the group's
small per-step all-reduce carries every member's sums, and every member runs the same decision on
the same numbers, so they agree without another message:

* every ``CHECK_EVERY`` steps (an accumulation window is one step here), each member's rate is its
  *steady* rate since the last check: the lower median of its windows' compute per sample (of four
  windows, the second fastest). A member is slow by it only when most of its windows were: one
  window of contention (another process's burst, a garbage collection, the step a random straggler
  hit it) is not something a split can fix, since the next step's straggler is someone else;
* the proposal splits the group's batch in proportion to the rates (at least one sample each, at
  most ``GROW_LIMIT`` x the plan's batch: the plan sized batches to the device's memory), and its
  predicted step is the slowest member's ``batch / rate``;
* a proposal *qualifies* when that step is at least ``SMALL_GAIN`` shorter than the current split's;
* it is taken when the checks in a row that qualify and move samples the same way (the same members
  gain) are two, each with a gain of at least ``LARGE_GAIN``, or ``SMALL_CHECKS`` of any gain; the
  new split is then cut from those windows' rates together. A window whose proposal does not
  qualify, or moves samples another way, starts the count again. Under random stragglers the
  windows' proposals point every which way, so they move nothing; a lasting change confirms itself
  one check later (a small one three);
* the first check, and the check after a change, are skipped (the job's first steps, and the new
  sizes' first steps, are not what the members run at).

At a fixed point of the rule the members' step times are equal, whatever a step's fixed cost: a
member's rate at its batch is ``b / t(b)``, so ``b`` proportional to it means the same ``t``.

The group's total is kept (the plan's global batch, and what a PS is told), and the engine weights
each member's gradient by the samples it counted, so the mean stays the union batch's.

**The data.** ``ctx.sampler``/``ctx.loader``/``ctx.shard`` hand out the sizes: the group's members
are adjacent in the plan's worker order, so each step's group block of the epoch's order is the
same whatever its split, and a member takes ``[sum(sizes[:j]), sum(sizes[:j+1]))`` of it. A
DataLoader asks for batches ahead of training (``num_workers * prefetch_factor``), so a change
applies from a *data step* no member has handed out yet: every member reports the next data step
its loader will yield (``GroupSplit.next_step``) with its sums, and the change starts at the
largest. A script that splits its data itself (``ctx.batch_sizes``) keeps the plan's sizes: its
members report no data step and the group is never rebalanced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

CHECK_EVERY = 4            # steps between checks
LARGE_GAIN = 0.20          # a proposal this much faster is taken when two checks in a row agree ...
SMALL_GAIN = 0.05          # ... one this much faster when SMALL_CHECKS do
SMALL_CHECKS = 4
GROW_LIMIT = 2.0           # no member above this multiple of its planned batch


@dataclass(frozen=True)
class Change:
    """One re-split of a group's batch, decided at local step ``step`` for data steps from ``from_step``."""

    step: int
    from_step: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    rates: tuple[float, ...]       # each member's measured samples per compute second
    step_before_s: float           # the slowest member's predicted step at the old split ...
    step_after_s: float            # ... and at the new one


class GroupSplit:
    """The group's batch of each member by data step: the plan's, then each change from its step.

    ``first``: the group's first member's index in the plan's worker order (the members follow it);
    ``planned``: the members' batches in the plan. The data source (sampler or ``ctx.shard``) asks
    ``cut(data_step)`` for every batch it hands out and records how far it has gone.

    Two schedules make the sizes. The members' split inside the group (``change``: this module's
    rebalancer) and the group's share of each step's block (``share``: every group's total, in
    block order, as the parameter servers' shard 0 re-splits the global batch across groups,
    adapt/shares.py). ``block``: this group's place among ``totals``, the plan's group totals in the
    order their workers come (default: this group alone). When the group's total is not what its
    members' split sums to, the split's proportions are kept (``split_by_rate``)."""

    def __init__(self, first: int, planned: Sequence[int], *, block: int = 0,
                 totals: Sequence[int] | None = None) -> None:
        self.first = first
        self.planned = tuple(planned)
        self.block = block
        self.planned_totals = tuple(totals) if totals is not None else (sum(self.planned),)
        if self.planned_totals[block] != sum(self.planned):
            raise ValueError(f"group total {self.planned_totals[block]} is not its members' "
                             f"{list(self.planned)}")
        self.caps = tuple(max(1, int(GROW_LIMIT * b)) for b in self.planned)
        self._changes: list[tuple[int, tuple[int, ...]]] = []
        self._shares: list[tuple[int, tuple[int, ...]]] = []
        self.next_step = -1        # the next data step the data source yields; -1: no source follows it

    @staticmethod
    def _at(schedule: list[tuple[int, tuple[int, ...]]], data_step: int, default: tuple[int, ...]) -> tuple[int, ...]:
        value = default
        for start, changed in schedule:
            if data_step < start:
                break
            value = changed
        return value

    def totals(self, data_step: int) -> tuple[int, ...]:
        """Every group's share of the step's block at ``data_step``, in block order."""
        return self._at(self._shares, data_step, self.planned_totals)

    def sizes(self, data_step: int) -> tuple[int, ...]:
        inner = self._at(self._changes, data_step, self.planned)
        total = self.totals(data_step)[self.block]
        return inner if sum(inner) == total else split_by_rate(total, inner, self.caps)

    def cut(self, data_step: int) -> tuple[int, int, tuple[int, ...]]:
        """``data.step_slice``'s ``group``: (the first member's worker index, the group's offset in
        the step's block, the members' sizes) at ``data_step``."""
        return self.first, sum(self.totals(data_step)[:self.block]), self.sizes(data_step)

    @property
    def latest(self) -> int:
        """The data step from which the newest change of either schedule applies (0: none)."""
        return max([0] + [s for s, _ in self._changes] + [s for s, _ in self._shares])

    @property
    def current(self) -> tuple[int, ...]:
        return self.sizes(self.latest)

    @property
    def schedule(self) -> list[tuple[int, tuple[int, ...]]]:
        """The members' re-splits: (first data step, sizes)."""
        return list(self._changes)

    @property
    def shares(self) -> list[tuple[int, tuple[int, ...]]]:
        """The groups' re-splits across groups: (first data step, every group's total)."""
        return list(self._shares)

    def change(self, from_step: int, sizes: Sequence[int]) -> None:
        sizes = tuple(sizes)
        total = self.totals(self.latest)[self.block]
        if sum(sizes) != total or len(sizes) != len(self.planned) or min(sizes) < 1:
            raise ValueError(f"a re-split must keep the group's {len(self.planned)} members and "
                             f"{total} samples, got {list(sizes)}")
        if self._changes and from_step < self._changes[-1][0]:
            raise ValueError(f"changes come in data-step order: {from_step} < {self._changes[-1][0]}")
        self._changes.append((from_step, sizes))

    def share(self, from_step: int, totals: Sequence[int]) -> None:
        """Every group's share of the block from ``from_step`` (what shard 0 decided)."""
        totals = tuple(int(t) for t in totals)
        if len(totals) != len(self.planned_totals) or sum(totals) != sum(self.planned_totals):
            raise ValueError(f"a re-split across groups must keep {len(self.planned_totals)} groups and "
                             f"{sum(self.planned_totals)} samples, got {list(totals)}")
        if not len(self.planned) <= totals[self.block] <= sum(self.caps):
            raise ValueError(f"group share {totals[self.block]} outside {len(self.planned)}..{sum(self.caps)}")
        if self._shares and from_step < self._shares[-1][0]:
            raise ValueError(f"changes come in data-step order: {from_step} < {self._shares[-1][0]}")
        self._shares.append((from_step, totals))

    def handed_out(self, data_step: int) -> None:
        """The data source yielded the batch of ``data_step``."""
        self.next_step = max(self.next_step, data_step + 1)

    def attach(self) -> None:
        """A data source follows the split (before it yields anything, it reports data step 0)."""
        self.next_step = max(self.next_step, 0)


def split_by_rate(total: int, rates: Sequence[float], caps: Sequence[int],
                  floors: Sequence[int] | None = None) -> tuple[int, ...]:
    """``total`` samples in proportion to ``rates``, each member floor..cap (floor 1 unless
    ``floors`` says), in integers that sum to it (largest remainder, ties to the lower member; the
    same on every member)."""
    n = len(rates)
    low = list(floors) if floors is not None else [1] * n
    if total < sum(low) or sum(caps) < total:
        raise ValueError(f"cannot split {total} samples over {n} members with caps {list(caps)}")
    shares = [0.0] * n
    free = list(range(n))
    left = float(total)
    while free:
        weight = sum(rates[i] for i in free)
        want = {i: left * rates[i] / weight for i in free}
        pinned = [i for i in free if want[i] > caps[i]] or [i for i in free if want[i] < low[i]]
        if not pinned:
            for i in free:
                shares[i] = want[i]
            break
        for i in pinned:
            shares[i] = float(caps[i]) if want[i] > caps[i] else float(low[i])
            left -= shares[i]
        free = [i for i in free if i not in pinned]
    sizes = [max(low[i], min(caps[i], math.floor(shares[i]))) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    k = 0
    while sum(sizes) < total:
        i = order[k % n]
        if sizes[i] < caps[i]:
            sizes[i] += 1
        k += 1
    while sum(sizes) > total:
        i = order[-1 - (k % n)]
        if sizes[i] > low[i]:
            sizes[i] -= 1
        k += 1
    return tuple(sizes)


class Rebalancer:
    """The decision (module docstring); every member holds one and feeds it the same numbers."""

    def __init__(self, split: GroupSplit, *, check_every: int = CHECK_EVERY,
                 floors: Sequence[int] | None = None) -> None:
        """``floors``: each member's least batch (default 1; across groups, a group's members)."""
        self.split = split
        self.check_every = check_every
        self.caps = split.caps
        self.floors = tuple(floors) if floors is not None else (1,) * len(split.planned)
        # The first check is skipped too: its sums hold the job's first steps (warm-up, first batches).
        self._settle = True
        # The checks in a row whose proposals qualify and move samples the same way: that way, how
        # many, the least gain among them, and their windows' sums.
        self._run: tuple[tuple[int, ...], int, float, list[float], list[float]] | None = None

    def check(self, step: int, seconds: Sequence[float], samples: Sequence[float],
              next_steps: Sequence[float]) -> Change | None:
        """At a check step: every member's steady compute seconds (``steady_seconds``) and samples
        since the last check, and the next data step each one's source will yield (< 0: it follows no
        split)."""
        if min(next_steps) < 0:
            return None
        if self._settle:
            self._settle = False
            return None
        if min(seconds) <= 0 or min(samples) <= 0:
            self._run = None
            return None
        before = self.split.current
        proposal, step_before, step_after = self._propose(before, seconds, samples)
        if 1.0 - step_after / step_before < SMALL_GAIN:
            self._run = None
            return None
        way = tuple((a > b) - (a < b) for a, b in zip(proposal, before))
        gain = 1.0 - step_after / step_before
        if self._run is None or self._run[0] != way:
            self._run = (way, 0, 1.0, [0.0] * len(seconds), [0.0] * len(samples))
        _, checks, least, run_seconds, run_samples = self._run
        checks, least = checks + 1, min(least, gain)
        run_seconds = [a + b for a, b in zip(run_seconds, seconds)]
        run_samples = [a + b for a, b in zip(run_samples, samples)]
        self._run = (way, checks, least, run_seconds, run_samples)
        if checks < (2 if least >= LARGE_GAIN else SMALL_CHECKS):
            return None
        # The split is cut from the run's windows together.
        proposal, step_before, step_after = self._propose(before, run_seconds, run_samples)
        if proposal == before or step_after >= step_before:
            return None
        from_step = int(max(next_steps))
        self.split.change(from_step, proposal)
        self._settle = True
        self._run = None
        return Change(step=step, from_step=from_step, before=before, after=proposal,
                      rates=tuple(s / t for s, t in zip(run_samples, run_seconds)),
                      step_before_s=step_before, step_after_s=step_after)

    def restart(self) -> None:
        """Forget the checks in a row so far (what they measured no longer holds)."""
        self._run = None

    def _propose(self, before: tuple[int, ...], seconds: Sequence[float],
                 samples: Sequence[float]) -> tuple[tuple[int, ...], float, float]:
        """The split by these sums' rates, and the slowest member's step at the current split and at it."""
        rates = [s / t for s, t in zip(samples, seconds)]
        proposal = split_by_rate(sum(before), rates, self.caps, self.floors)
        return (proposal, max(b / r for b, r in zip(before, rates)),
                max(b / r for b, r in zip(proposal, rates)))


def steady_seconds(per_sample: Sequence[float], samples: float) -> float:
    """The seconds a member's ``samples`` since the last check take at its steady rate: the lower
    median of its windows' per-sample compute (of four windows, the second fastest)."""
    ordered = sorted(per_sample)
    return samples * ordered[(len(ordered) - 1) // 2] if ordered else 0.0
