"""A group's data position through PS checkpoints: recorded with every push, restored at ``wrap()``.

The position is that of the first data source ``ctx.sampler``/``ctx.loader``/``ctx.shard`` made in the
process (the training data; later ones, such as an evaluation loader, are neither recorded nor restored). It
advances in an optimizer step pre-hook registered before the aggregation's own, so the position a
push carries already counts the batch of that step. The group leader sends it with each push; the PS
keeps the latest per group and writes it into its checkpoints (``data_positions``). A PS resumed
from a checkpoint answers ``_data_position(group)``; the leader asks shard 0 once at ``wrap()`` and
broadcasts the answer to its group, whose samplers then continue from it.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from ..errors import TrainingError


class Positioned(Protocol):
    """A data source with a position: ``sampler.RankBatchSampler`` (ctx.sampler/ctx.loader) and
    ``data.ShardStream`` (ctx.shard)."""

    def note_step(self) -> None: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class DataPosition:
    """The group's data position: the first data source's epoch and step, sent with each push, and the
    position a PS checkpoint restored, applied to that source at ``wrap()``."""

    def __init__(self) -> None:
        self.sampler: Positioned | None = None
        self.restored: dict[str, int] | None = None
        self.rescale = False

    def track(self, sampler: Positioned) -> None:
        """The first sampler of the process is the training data's: it is the one recorded."""
        if self.sampler is not None:
            return
        self.sampler = sampler
        if self.restored is not None:
            self._load(self.restored)

    def hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Advance the position at every ``opt.step()``: one batch per step (the runtime's contract)."""
        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self.sampler is not None:
                self.sampler.note_step()

        return optimizer.register_step_pre_hook(before_step)

    def current(self) -> dict[str, int] | None:
        """What a push carries: the position after the batch of the step being pushed."""
        return self.sampler.state_dict() if self.sampler is not None else None

    def restore(self, state: dict[str, int], *, rescale: bool = False) -> None:
        """``rescale``: the position was saved under another plan (a re-grouping), whose batches may
        give another number of steps per epoch; it then keeps its share of the epoch."""
        self.restored = dict(state)
        self.rescale = rescale
        if self.sampler is not None:
            self._load(self.restored)

    def _load(self, state: dict[str, int]) -> None:
        assert self.sampler is not None
        saved, now = int(state.get("steps_per_epoch") or 0), int(self.sampler.state_dict().get("steps_per_epoch") or 0)
        if self.rescale and saved and now and saved != now:
            state = {**state, "step": min(now - 1, int(state["step"]) * now // saved), "steps_per_epoch": now}
        try:
            self.sampler.load_state_dict(state)
        except ValueError as exc:
            raise TrainingError(f"the saved data position does not fit this data source: {exc}") from exc


def fetch_restored(*, rank: int, leader: int, group_id: int, n_members: int, pg: Any, ps_rank: int,
                   device: torch.device, timeout_s: float,
                   collective: Callable[[Callable[[], Any], str], None]) -> dict[str, int] | None:
    """The group's position in the checkpoint the PS resumed from (None: fresh start, or no position
    recorded for it). Every member of the group calls it; the leader asks, the group hears."""
    import torch.distributed as dist

    # [found, epoch, step, steps_per_epoch]; on the group's device, as NCCL needs CUDA tensors.
    answer = torch.zeros(4, dtype=torch.int64, device=device)
    if rank == leader:
        from torch.distributed import rpc

        from ..ps import handlers
        from ..groups import rpc_name

        try:
            pos = rpc.rpc_sync(rpc_name(ps_rank), handlers.data_position, args=(group_id,), timeout=timeout_s)
        except Exception as exc:  # RPC errors arrive as RuntimeError or the PS's own exception
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise TrainingError(f"rank {rank} (group {group_id}): asking the parameter server for the "
                                f"data position failed: {first}") from exc
        if pos is not None:
            answer = torch.tensor([1, pos["epoch"], pos["step"], pos.get("steps_per_epoch", 0)],
                                  dtype=torch.int64, device=device)
    if n_members > 1:
        collective(lambda: dist.broadcast(answer, leader, group=pg), "broadcast")
    found, epoch, step, steps = answer.tolist()
    if not found:
        return None
    return {"epoch": epoch, "step": step, "steps_per_epoch": steps}
