"""A group's one small all-reduce per step (group/engine.py), started with the step's first DDP bucket.

Its vector is [samples | MEMBER_SLOTS per member, in groups of two or more | the samples-weighted
buffers]. The group's samples unweight the gradient buckets (the samples-weighted mean), the
buffers' sum over the samples is every member's new buffers, and the member slots carry what the
emulator pools and the rebalancer reads (group/engine.py reads them).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import flat as flatten_
from ..errors import TrainingError

# Slots of each member in the step's small all-reduce: its batch and emulated estimate (pooled on a
# node), and for rebalancing its compute seconds, samples and data source's next step.
MEMBER_SLOTS = 5


def step_reduce_numel(members: int, buffers: int = 0) -> int:
    """Elements of a group's small all-reduce per step: [samples | MEMBER_SLOTS per member, in
    groups of two or more | the sample-weighted buffers]."""
    return 1 + (MEMBER_SLOTS * members if members > 1 else 0) + buffers


class StepReduce:
    """The group's one small all-reduce per step: samples, members' slots and samples-weighted buffers
    in one vector, started with the step's first DDP bucket."""

    def __init__(self, *, members: int, me: int, pg: Any, buffers: Sequence[torch.Tensor],
                 planned_total: float | None, failed: Callable[[str, BaseException], TrainingError]) -> None:
        """``planned_total``: B, the plan's samples per update over the whole group (None: learnt
        from the first step, when the plan gives no batches); ``failed``: the error of a collective."""
        self.members = members
        self.me = me
        self.pg = pg
        self.buffers = buffers
        self.planned_total = planned_total
        self._failed = failed
        self.small: torch.Tensor | None = None
        self.work: Any = None
        self._total: float | None = None

    def start(self, mine: int, member: Sequence[float], device: torch.device) -> None:
        """Start this step's all-reduce: this rank's samples ``mine``, its ``member`` slots and its
        buffers weighted by ``mine``."""
        small = torch.zeros(step_reduce_numel(self.members, sum(b.numel() for b in self.buffers)),
                            dtype=torch.float32, device=device)
        small[0] = mine
        if self.members > 1:
            at = 1 + MEMBER_SLOTS * self.me
            for k, value in enumerate(member):
                small[at + k] = value
        if self.buffers:
            at = step_reduce_numel(self.members)
            small[at:].copy_(flatten_.flatten(self.buffers, device)).mul_(mine)
        try:
            self.work = dist.all_reduce(small, group=self.pg, async_op=True)
        except (RuntimeError, ValueError) as exc:
            raise self._failed("all-reduce", exc) from exc
        self.small, self._total = small, None
        if self.planned_total is None:
            # No plan batches (plain torchrun without HGTRAIN_BATCH_SIZE): the first step's total is B.
            self.planned_total = self.total()

    def total(self) -> float:
        """The group's samples this step, on the host (waits for the small all-reduce)."""
        if self._total is None:
            try:
                self.work.wait()
            except (RuntimeError, ValueError) as exc:
                raise self._failed("all-reduce", exc) from exc
            assert self.small is not None
            self._total = float(self.small[0])
        return self._total

    def unweight(self, buf: torch.Tensor) -> None:
        """A bucket's sum times B / N (the group's samples this step)."""
        assert self.small is not None and self.planned_total is not None
        if buf.is_cuda:
            # No host sync on a GPU: the factor stays on the device (the small all-reduce went first
            # on the same stream).
            self.work.wait()
            buf.mul_(self.planned_total / self.small[0])
        else:
            factor = self.planned_total / self.total()
            if factor != 1.0:
                buf.mul_(factor)

    def end(self) -> torch.Tensor:
        """The small all-reduce's result, its buffers' samples-weighted mean loaded into the buffers."""
        try:
            self.work.wait()
        except (RuntimeError, ValueError) as exc:
            raise self._failed("all-reduce", exc) from exc
        small = self.small
        assert small is not None
        if self.buffers:
            flatten_.load(self.buffers, small[step_reduce_numel(self.members):] / small[0])
        return small

    def clear(self) -> None:
        self.small = self.work = None
