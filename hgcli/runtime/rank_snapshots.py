"""A rank's side of an all-reduce job's training-state snapshots (snapshot.py holds the files and
their writer): which rank takes them, taking one before an optimizer step, and resuming a restarted
job from one, so a restart (``launch --restarts``, ``--nnodes``, a re-grouping) goes on where the job
was without code in the script.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from ..schema import stages as m
from ..schema.records import ResumedRecord, SavedState, SnapshotRecord
from . import snapshot
from .emulate import Emulator
from .env import RankEnv
from .errors import TrainingError
from .exchange.position import DataPosition
from .group.engine import GroupEngine
from .metrics import MetricsSink
from .snapshot import Snapshotter, snapshot_path


def snapshotter_for(env: RankEnv, plan: m.Plan, rank: int) -> Snapshotter | None:
    """This rank's snapshot writer, when the launcher asked for snapshots and it is the first worker
    of its node in a plan without PS ranks, or of the first group in a plan with them (a re-grouped
    job watched for the way back to all-reduce, launch/adapt.py: every group has its own steps, and
    its first group's state is the one the way back resumes)."""
    s = env.snapshots
    if s is None or not (s.every or s.seconds) or env.plan is None:
        return None
    if plan.ps_shards:
        if rank != plan.groups[0].ranks[0]:
            return None
    else:
        node = plan.rank(rank).node
        if min(w.rank for w in plan.workers if w.node == node) != rank:
            return None
    return Snapshotter(Path(s.directory), every=s.every, seconds=s.seconds)


class RankSnapshots:
    """Takes this rank's snapshots before optimizer steps (when it writes them) and resumes the
    model, optimizer, scheduler and data position from one (every worker of a restarted job)."""

    def __init__(self, *, env: RankEnv, plan: m.Plan, group_plan: m.GroupPlan, batches: list[int | None],
                 emulator: Emulator, metrics: MetricsSink, data: DataPosition, device: torch.device,
                 pg: Any, first_worker: bool) -> None:
        self.env, self.plan, self.group_plan = env, plan, group_plan
        self.rank, self.world_size = env.rank, env.world_size
        self.emulator, self.metrics, self.data = emulator, metrics, data
        self.device, self.pg, self.first_worker = device, pg, first_worker
        self.writer = snapshotter_for(env, plan, env.rank)
        # Samples per optimizer step of the group (None: a batch the plan does not give); under PS
        # ranks the group's samples are not the job's.
        known = [b for b in batches if b]
        self.per_step = (group_plan.accumulate * sum(known) if len(known) == len(batches) and not plan.ps_shards
                         else None)
        self.model: torch.nn.Module | None = None
        self.scheduler: Any = None
        self.engine: GroupEngine | None = None    # set once the group engine exists (wrap)
        self.step_base = 0                        # the group's steps and samples before this attempt
        self.samples_base = 0

    @property
    def resume_step(self) -> int | None:
        """The snapshot's step this attempt resumes from (the launcher's choice), if any."""
        return self.env.snapshots.resume_step if self.env.snapshots is not None else None

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """Snapshot ``model``, ``optimizer`` and ``scheduler``: called first of ``wrap``'s pre-hooks,
        so a snapshot is the state between two steps, before the data position counts the next
        step's batch and before the aggregation applies its gradient."""
        self.model, self.scheduler = model, scheduler
        if self.writer is not None:
            optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        engine, snap = self.engine, self.writer
        if engine is None or snap is None or self.model is None or engine.local_step % engine.accumulate:
            return      # not started, or inside an accumulation window
        for written in snap.written():   # the launcher re-groups a job only to a state on disk (launch/adapt.py)
            self.metrics.record(SnapshotRecord(step=written))
        step = self.step_base + engine.local_step // engine.accumulate
        if step == self.step_base or not snap.due(step):
            return
        # Under PS ranks the optimizer that matters is the PS's: the local one steps on nothing, so
        # the way back starts a fresh one.
        asynchronous = bool(self.plan.ps_shards)
        samples = None if self.per_step is None else self.samples_base + (step - self.step_base) * self.per_step
        with self.emulator.untimed():       # a copy to host memory: not the device's training work
            snap.take(step, {
                "samples": samples, "model": self.model.state_dict(),
                "optimizer": None if asynchronous else opt.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "data": self.data.current(), "world_size": self.world_size})

    def resume(self, step: int, engine: GroupEngine) -> None:
        """Load the snapshot of ``step`` into the model, optimizer, scheduler and data position. A
        member whose node lacks the file (it joined at this restart) gets it from the first that has it."""
        assert self.env.snapshots is not None and self.model is not None
        with self.emulator.untimed():       # start-up, not the device's work
            state = self._load(Path(self.env.snapshots.directory), step, engine)
            self.model.load_state_dict(state["model"])
            if state.get("optimizer") is not None:
                engine.opt.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if state.get("data") is not None:
                # Another world (a re-grouped plan) may count other steps per epoch: same share.
                self.data.restore(state["data"], rescale=state.get("world_size") != self.world_size)
        self.step_base = step
        self.samples_base = int(state.get("samples") or 0)
        if self.writer is not None:
            self.writer.start_at(step)
        if self.first_worker:
            self.metrics.record(ResumedRecord(source=SavedState.SNAPSHOT, step=step, samples=state.get("samples")))
        print(f"hgtrain: rank {self.rank} resumed from the snapshot of step {step}", flush=True)

    def _load(self, directory: Path, step: int, engine: GroupEngine) -> dict[str, Any]:
        """The snapshot's state: this node's file, else the first group member's that has one."""
        import torch.distributed as dist

        state: dict[str, Any] | None = None
        problem = f"no file {snapshot_path(directory, step)}"
        if snapshot_path(directory, step).exists():
            try:
                state = snapshot.load(directory, step)
            except ValueError as exc:
                problem = str(exc)
        ranks, group = self.group_plan.ranks, self.group_plan.id
        if len(ranks) > 1:
            have = torch.zeros(len(ranks), dtype=torch.int64, device=self.device)
            have[ranks.index(self.rank)] = int(state is not None)
            engine.link.collective(lambda: dist.all_reduce(have, group=self.pg), "all-reduce")
            holders = [r for r, h in zip(ranks, have.tolist()) if h]
            if not holders:
                raise TrainingError(f"rank {self.rank}: no rank of group {group} has the snapshot of step "
                                    f"{step} to resume from: {problem}")
            if len(holders) < len(ranks):
                box = [state if self.rank == holders[0] else None]
                where = self.device if self.device.type == "cuda" else None
                engine.link.collective(lambda: dist.broadcast_object_list(box, src=holders[0], group=self.pg,
                                                                          device=where), "broadcast")
                state = box[0]
        if state is None:
            raise TrainingError(f"rank {self.rank}: cannot resume from the snapshot of step {step}: {problem}")
        return state

    def close(self) -> None:
        """Wait for the last snapshot's write; a failed write is said on stderr (training is done)."""
        if self.writer is not None:
            self.writer.close()
            if self.writer.error:
                print(f"hgtrain: rank {self.rank}: {self.writer.error}", file=sys.stderr, flush=True)
