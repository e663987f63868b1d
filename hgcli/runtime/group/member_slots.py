"""What the members' slots of a group's small all-reduce (group/step_reduce.py) drive on each member
(group/engine.py): the emulated estimate the members on one node pool (emulate.py), and the rebalancer's
checks (adapt/rebalance.py), which every member runs on the same numbers and so decides alike."""
from __future__ import annotations

import statistics

import torch

from ..adapt.clock import ComputeClock
from ..emulate import Emulator
from ..metrics import MetricsSink
from ..adapt.rebalance import Change, Rebalancer
from ...schema.records import RebalanceRecord
from .step_reduce import MEMBER_SLOTS, step_reduce_numel


class MemberSlots:
    """Reads each member's slots of the step's small all-reduce: pools the emulated estimates of the
    members on one node and runs the rebalancer's checks, alike on every member."""

    def __init__(self, *, rank: int, group_id: int, ranks: tuple[int, ...], share_with: tuple[int, ...],
                 rebalancer: Rebalancer | None, emulator: Emulator, clock: ComputeClock,
                 metrics: MetricsSink) -> None:
        self.rank = rank
        self.group_id = group_id
        self.ranks = ranks
        self.members = len(ranks)
        self._me = ranks.index(rank)
        self.share_with = share_with
        self._pool_estimates = self.members > 1 and len(share_with) > 1
        self.rebalancer = rebalancer
        self.emulator = emulator
        self.clock = clock
        self.metrics = metrics
        self.changes: list[Change] = []

    def read(self, small: torch.Tensor, local_step: int) -> None:
        """The members' slots of the small all-reduce: the estimates the members on this node pool,
        and at the rebalancer's checks their compute, which may re-split the group's batch."""
        check = self.rebalancer is not None and (self.clock.windows + 1) % self.rebalancer.check_every == 0
        if not (check or (self._pool_estimates and small.device.type == "cpu")):
            return
        # On a GPU this reads the device (a host sync): only at the rebalancer's checks.
        k = MEMBER_SLOTS
        slots = small[1: step_reduce_numel(self.members)].tolist()
        if self._pool_estimates and small.device.type == "cpu":
            batch = slots[k * self._me]
            pool = [slots[k * i + 1] for i in self.share_with if slots[k * i] == batch and slots[k * i + 1] > 0]
            if pool:
                self.emulator.share(int(batch), statistics.median(pool))
        if check:
            assert self.rebalancer is not None
            change = self.rebalancer.check(local_step, slots[2::k], slots[3::k], slots[4::k])
            # Every member starts its next sums now (the ones just read were sent before this step).
            self.clock.reset_sums()
            if change is not None:
                self._adapted(change)

    def _adapted(self, change: Change) -> None:
        """The group re-split its batch (every member decided the same): the leader reports it."""
        self.changes.append(change)
        if self.rank == self.ranks[0]:
            self.metrics.record(RebalanceRecord(
                group=self.group_id, step=change.step, data_step=change.from_step, ranks=tuple(self.ranks),
                before=tuple(change.before), batches=tuple(change.after),
                rates=tuple(round(r, 3) for r in change.rates),
                step_before_s=change.step_before_s, step_after_s=change.step_after_s))
