"""The staleness bookkeeping of a PS shard (ps/server.py): which group has which version, who computes,
who waits, whether answering a waiting group could break the bound, and when each group was last
heard from (a silent one fails the job).

The rules are ps/server.py's (and docs/runtime-reference.md's): without overlap a group is answered when every group
still computing stays within the bound; with overlap (``may_answer_overlapped``) every pending
gradient is counted. Only shard 0, the coordinator, holds answers back; every shard keeps the
versions, since the damping of a push reads them. The caller holds the shard's lock.
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

from torch.futures import Future

from ..errors import TrainingError


class Admission:
    """A PS shard's staleness bookkeeping: which version each group computes on, who waits, whether an
    answer may go out under the bound, and when each group was last heard from."""

    def __init__(self, *, group_ids: Sequence[int], bound: int, overlap: bool, coordinator: bool) -> None:
        if len(group_ids) > 1 and bound < len(group_ids) - 1:
            raise TrainingError(f"plan staleness_bound {bound} is below groups - 1 = "
                                f"{len(group_ids) - 1}: no schedule of the groups could respect it")
        # Overlap (docs/runtime-reference.md): a group's next gradient is computed while its push is in flight,
        # so its own push always counts once in its staleness; the rule then needs S >= groups.
        if overlap and bound < len(group_ids):
            raise TrainingError(f"plan staleness_bound {bound} is below groups = {len(group_ids)}: "
                                f"with overlap a group's own push in flight counts once in the staleness "
                                f"of its next gradient, so no schedule could respect it")
        self.bound = bound
        self.overlap = overlap
        self.coordinator = coordinator
        # Overlap admission (coordinator): per group, the version its last answer carried and the
        # version its next push's gradient was computed on (one answer older than the last).
        self.released: dict[int, int] = {}
        self.next_base: dict[int, int] = {}
        self.clock = {g: 0 for g in group_ids}
        self.base = {g: 0 for g in group_ids}
        self.active = set(group_ids)
        self.computing: set[int] = set()               # answered, gradient not yet pushed
        self.waiting: dict[int, Future] = {}          # group -> answer held back (coordinator)
        self.last_seen = {g: time.monotonic() for g in group_ids}

    def heard(self, group: int) -> None:
        self.last_seen[group] = time.monotonic()

    def silent(self, now: float, limit: float) -> list[int]:
        """The unfinished groups not held back that sent nothing for ``limit`` seconds."""
        return sorted(g for g in self.active if g not in self.waiting and now - self.last_seen[g] > limit)

    def pushed(self, group: int, base: int | None) -> None:
        """A push arrives: the version its gradient was computed on (``base``, sent under overlap)."""
        if self.overlap and self.coordinator:
            # The admission rule keeps its own record of the gradient's base: the leader's must agree.
            expected = self.next_base.get(group, self.base[group])
            if base is not None and base != expected:
                raise TrainingError(f"PS shard 0: group {group} pushed a gradient computed on version "
                                    f"{base}; the admission rule expected {expected}")
            self.base[group] = expected
        elif base is not None:
            self.base[group] = base

    def applied(self, group: int) -> None:
        """The push is applied: the group no longer computes."""
        self.clock[group] += 1
        self.computing.discard(group)
        if self.overlap and group in self.released:
            # Its next gradient is being computed on the parameters of its last answer.
            self.next_base[group] = self.released[group]

    def answered(self, group: int, version: int) -> None:
        if not self.overlap:
            self.base[group] = version
        elif group not in self.next_base:
            # Its first answer (start, resume): its first two gradients are both computed on it.
            self.next_base[group] = self.base[group] = version
        self.released[group] = version
        if group in self.active:
            self.computing.add(group)

    def done(self, group: int) -> bool:
        """The group finished; False when it already had."""
        if group not in self.active:
            return False
        self.active.discard(group)
        self.computing.discard(group)
        return True

    def resumed(self, version: int) -> None:
        self.base = {g: version for g in self.base}
        self.released, self.next_base = {}, {}      # every group starts again from its first answer

    def damping_delay(self, group: int, version: int) -> int:
        """The staleness a push is damped by: versions since the group's newest answer. Without
        overlap that is its staleness (the gradient was computed on that answer). Under overlap the
        gradient is one answer older: the versions between that answer and the newest (the group's
        own previous push, and what landed before it was answered) are a fixed one-step pipeline
        delay, present on every push whatever the other groups do (as in delayed SGD), not
        asynchrony between the groups. Damping them too divided every push by the pipeline's
        depth as well, so the same samples made far less progress (benchmarks/hybrid_links.py). Only what
        came after the newest answer counts, the same count as without overlap; the bound still
        counts the full staleness from the older base."""
        return version - self.released.get(group, self.base[group])

    def next_release(self, version: int) -> int | None:
        """The waiting group to answer now, oldest base first; None when every one must wait."""
        for g in sorted(self.waiting, key=self._order):
            if not self.computing or self._may_answer(g, version):
                return g
        return None

    def _may_answer(self, group: int, version: int) -> bool:
        if self.overlap:
            return self._may_answer_overlapped(group, version)
        n = len(self.computing)         # computing groups once ``group`` joins them, minus one
        return all(version - self.base[h] + n <= self.bound
                   for h in self.computing if h != group)

    def _may_answer_overlapped(self, group: int, version: int) -> bool:
        """The overlap rule (docs/runtime-reference.md): with ``group`` answered, every pending gradient, and
        the next gradient of every free group, must be pushed within the bound even if everything
        that may come before it does. A group is *free* once answered (it may push once without
        asking), else *held* (its next push needs an answer); once answered a first time it always
        has a gradient pending, the one it computes while its push is in flight. Before the pending
        gradient of h (base b, key (b, h)) may come: one push of each other free group, and a
        second one of those whose next base is older than b (held, they are answered first), and
        one push of each held group answered before h (base older than b)."""
        v, free = version, set(self.computing) | {group}
        held = {h: self.next_base[h] for h in self.waiting if h != group and h in self.next_base}
        released = {**self.released, group: v}
        pending = {**{h: self.next_base.get(h, v) for h in free}, **held}

        def ahead(key: tuple[int, int], h: int) -> int:
            return (sum(1 + ((released[x], x) < key) for x in free if x != h)
                    + sum((b, x) < key for x, b in held.items() if x != h))

        if any(v - b + ahead((b, h), h) > self.bound for h, b in pending.items()):
            return False
        # A free group's gradient after its pending one is computed on its last answer (+1: its own push).
        return all(v + 1 - released[h] + ahead((released[h], h), h) <= self.bound for h in free)

    def _order(self, group: int) -> tuple[int, int]:
        if self.overlap:
            # Held groups by their pending gradient's base (answering the oldest when no group is
            # free moves nobody else's count); groups never answered after them: they have none.
            return (self.next_base.get(group, sys.maxsize), group)
        return (self.base[group], group)
