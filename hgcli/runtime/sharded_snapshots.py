"""Training-state snapshots of an fsdp group, with torch's distributed checkpoint (DCP), so that
``launch --restarts`` and an elastic re-plan resume an fsdp job where it was, on as many ranks as the
new attempt has.

**Why DCP, and not the all-reduce snapshots' one file (snapshot.py).** No rank of an fsdp group holds
the whole state: each holds its shards of the parameters and of the optimizer's state. Gathering them
to one rank would need the whole state in one rank's memory, which is what the group exists to avoid.
``get_state_dict`` (torch.distributed.checkpoint.state_dict) gives each rank's shards as DTensors,
and ``dcp.save`` writes each rank's own into one directory with the global layout beside them; a
``dcp.load`` on another number of ranks reads back each new rank's shards of the same tensors
(re-sharding), and ``set_state_dict`` loads them into the model and the rebuilt optimizer.

**Layout.** Every rank of the group writes into ``snapshot-s{step:010d}.dcp.part``; once all have
(``dcp.save`` is collective), the group's first rank adds ``hgtrain.pt`` (the step, the samples, the
data position, the world size) and renames the directory to its final
name, which ``snapshot.steps_in`` lists for the launcher: a kill leaves no half-written snapshot under
that name. The newest ``snapshot.KEEP`` are kept. Every rank must read the same directory, so an fsdp
group spread over several nodes needs its checkpoint directory on storage they share.

**When.** After ``opt.step()`` at the end of an update, every ``every`` updates or ``seconds``
seconds: the group's first rank decides by the clock and the group follows its decision (one small
broadcast per update, only with ``seconds``), since every rank must take part in the save. Writing
is synchronous: the step waits for it.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..schema.records import ResumedRecord, SavedState, SnapshotRecord
from ..state import make_private_dirs
from . import snapshot
from .emulate import Emulator
from .env import SnapshotEnv
from .errors import TrainingError
from .exchange.position import DataPosition
from .group.sharded import ShardedEngine
from .metrics import MetricsSink

EXTRA = "hgtrain.pt"        # the snapshot's own fields, beside DCP's files


class ShardedSnapshots:
    """One rank's part of its fsdp group's snapshots: all of them write, all of them resume."""

    def __init__(self, *, engine: ShardedEngine, config: SnapshotEnv, world_size: int, per_step: int | None,
                 emulator: Emulator, metrics: MetricsSink, data: DataPosition) -> None:
        rank, ranks = engine.rank, engine.spec.ranks
        self.config, self.rank, self.ranks, self.world_size = config, rank, ranks, world_size
        self.directory = Path(config.directory)
        self.leader = rank == ranks[0]
        self.per_step = per_step            # the group's samples per update (None: not from the plan)
        self.emulator, self.metrics, self.data = emulator, metrics, data
        self.clock = snapshot.Snapshotter(self.directory, every=config.every, seconds=config.seconds)
        self.engine = engine
        self.step_base = self.samples_base = 0

    def attach(self) -> None:
        """Take snapshots after the updates of the engine's (rebuilt) optimizer, when the launcher
        asked for them."""
        if self.clock.enabled:
            self.engine.opt.register_step_post_hook(self._after_step)

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        engine = self.engine
        if engine.local_step % engine.accumulate:
            return          # inside an accumulation window: not between two updates
        step = self.step_base + engine.local_step // engine.accumulate
        if not self._due(step, engine):
            return
        self.clock.start_at(step)
        with self.emulator.untimed():       # saving is not the device's training work
            self.save(step)

    def _due(self, step: int, engine: ShardedEngine) -> bool:
        due = self.clock.due(step)
        if not self.config.seconds or len(self.ranks) == 1:
            return due          # on a count of updates: every rank decides alike
        flag = torch.tensor([int(due)], dtype=torch.int64, device=engine.device)
        try:
            dist.broadcast(flag, src=self.ranks[0], group=engine.spec.pg)
        except (RuntimeError, ValueError) as exc:
            raise TrainingError(f"rank {self.rank}: the group's snapshot clock failed (a member of ranks "
                                f"{list(self.ranks)} is gone?): {exc}") from exc
        return bool(flag.item())

    def save(self, step: int) -> None:
        """Write the snapshot of ``step`` (every rank of the group calls it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        engine = self.engine
        final = snapshot.dcp_path(self.directory, step)
        part = final.with_name(final.name + ".part")
        model_state, optim_state = get_state_dict(engine.module, engine.opt)
        try:
            # A kill's leftover .part is written over (other ranks may be creating it already).
            make_private_dirs(part)       # 0700 whatever the umask (DCP's files inside follow it)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=part,
                     process_group=engine.spec.pg)
            if self.leader:
                samples = (None if self.per_step is None
                           else self.samples_base + (step - self.step_base) * self.per_step)
                torch.save({"format": snapshot.FORMAT, "step": step, "samples": samples,
                            "data": self.data.current(), "world_size": self.world_size}, part / EXTRA)
                shutil.rmtree(final, ignore_errors=True)
                part.rename(final)
                for old in snapshot.steps_in(self.directory)[:-snapshot.KEEP]:
                    shutil.rmtree(snapshot.dcp_path(self.directory, old), ignore_errors=True)
        except OSError as exc:
            raise TrainingError(f"rank {self.rank}: snapshot of step {step} not written to "
                                f"{self.directory}: {exc.strerror or exc}") from exc
        if self.leader:
            self.metrics.record(SnapshotRecord(step=step))

    def resume(self, step: int) -> None:
        """Load the snapshot of ``step`` into the sharded model and the rebuilt optimizer, re-sharded
        onto this attempt's ranks (called inside ``ShardedEngine.start``, before its hooks exist:
        DCP's optimizer set-up steps the optimizer once, with zero gradients, which the engine must
        not count)."""
        model, opt = self.engine.module, self.engine.opt
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = snapshot.dcp_path(self.directory, step)
        if not (path / EXTRA).is_file():
            raise TrainingError(f"rank {self.rank}: cannot resume from the snapshot of step {step}: no "
                                f"{path / EXTRA} (an fsdp group's snapshots are read by every rank: on "
                                f"several nodes their checkpoint directory must be shared storage)")
        with self.emulator.untimed():       # start-up, not the device's work
            model_state, optim_state = get_state_dict(model, opt)
            state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
            try:
                dcp.load(state, checkpoint_id=path, process_group=self.engine.spec.pg)
                extra = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
            except (OSError, RuntimeError, ValueError) as exc:
                raise TrainingError(f"rank {self.rank}: cannot resume from {path}: {exc}") from exc
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self._resumed(step, extra)

    def _resumed(self, step: int, extra: dict[str, Any]) -> None:
        if extra.get("data") is not None:
            # Another world (a re-plan) may count other steps per epoch: the same share of it.
            self.data.restore(extra["data"], rescale=extra.get("world_size") != self.world_size)
        self.step_base, self.samples_base = step, int(extra.get("samples") or 0)
        self.clock.start_at(step)
        if self.leader:
            self.metrics.record(ResumedRecord(source=SavedState.SNAPSHOT, step=step, samples=extra.get("samples")))
        print(f"hgtrain: rank {self.rank} resumed from the snapshot of step {step} (distributed checkpoint)",
              flush=True)
