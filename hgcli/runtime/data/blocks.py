"""Per-rank batches from one dataset: every step, the union of all workers' batches is one contiguous
block of a seeded permutation (the global batch), and each worker takes a slice sized by its plan batch.

So ranks with unequal batches run the same number of steps per epoch (collectives stay matched), and
a synchronous run sees exactly the batches a single process would see with the global batch.

The index arithmetic here (``epoch_order``, ``steps_per_epoch``, ``step_slice``) is shared by
``shard_batches`` (tensors in memory, ``ctx.shard``) and ``sampler.RankBatchSampler`` (any map-style
dataset through a DataLoader, ``ctx.sampler``/``ctx.loader``), so both give the same batches.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from ..adapt.rebalance import GroupSplit


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> torch.Tensor:
    """The order of the ``n`` sample indices in ``epoch``: the same on every rank (same seed)."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def steps_per_epoch(n: int, batch_sizes: Sequence[int], drop_last: bool = True) -> int:
    """Steps every worker makes per epoch; with ``drop_last=False`` a last partial step when the rest
    of the dataset still gives every worker at least one sample (see ``tail_shares``)."""
    global_batch = sum(batch_sizes)
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"every worker needs a batch of at least one sample, got {list(batch_sizes)}")
    full, rest = divmod(n, global_batch)
    steps = full + (1 if not drop_last and rest >= len(batch_sizes) else 0)
    if steps == 0:
        raise ValueError(f"global batch {global_batch} is larger than the dataset ({n} samples)")
    return steps


def tail_shares(rest: int, batch_sizes: Sequence[int]) -> list[int]:
    """How the ``rest`` samples of a last partial step are split: in proportion to the batches
    (largest remainder, ties to the lower worker), at least one each so that every worker still
    steps (collectives stay matched). Needs ``len(batch_sizes) <= rest < sum(batch_sizes)``."""
    k = len(batch_sizes)
    total = sum(batch_sizes)
    # One sample each first, the remaining rest - k in proportion (integer arithmetic: every rank
    # must compute the same split): no worker gets an empty batch.
    parts = [divmod((rest - k) * b, total) for b in batch_sizes]
    shares = [1 + whole for whole, _ in parts]
    by_remainder = sorted(range(k), key=lambda i: (-parts[i][1], i))
    for i in by_remainder[:rest - sum(shares)]:
        shares[i] += 1
    return shares


def step_slice(n: int, batch_sizes: Sequence[int], index: int, step: int,
               group: tuple[int, int, Sequence[int]] | None = None) -> tuple[int, int]:
    """Positions ``[start, stop)`` in the epoch's order of worker ``index``'s batch at ``step``: the
    workers' slices of one step are adjacent, in worker order, and together one contiguous block.

    ``group``: (the first worker of ``index``'s group, the group's offset in the step's block, the
    group's current sizes), a re-split of the batch (rebalance.GroupSplit.cut): inside the group by
    its members' speeds, across groups by shard 0's shares. The groups' parts of a block stay
    adjacent in the plan's order, so every group cuts the same block. A last partial step
    (``drop_last=False``) is cut by the plan's batches."""
    global_batch = sum(batch_sizes)
    base = step * global_batch
    rest = n - base
    sizes = list(batch_sizes) if rest >= global_batch else tail_shares(rest, batch_sizes)
    if group is not None and rest >= global_batch:
        first, offset, current = group
        start = base + offset + sum(current[:index - first])
        return start, start + current[index - first]
    start = base + sum(sizes[:index])
    return start, start + sizes[index]


def micro_slices(start: int, stop: int, micro: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``micro`` adjacent micro-batches, as even as can be (the first ones
    one sample larger), so a rank that accumulates still takes exactly its batch's samples; with
    fewer samples than micro-batches, the last ones are empty (the engine still steps them, so the
    group's windows stay matched)."""
    size, extra = divmod(stop - start, micro)
    cuts = [start]
    for k in range(micro):
        cuts.append(cuts[-1] + size + (1 if k < extra else 0))
    return list(zip(cuts[:-1], cuts[1:]))


def shard_batches(tensors: Sequence[torch.Tensor], batch_sizes: Sequence[int], index: int, *,
                  epochs: int, seed: int, split: GroupSplit | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
    """``split``: the group's rebalanced sizes by data step (``epoch * steps + step``), followed."""
    return iter(ShardStream(tensors, batch_sizes, index, epochs=epochs, seed=seed, split=split))


class ShardStream:
    """``ctx.shard``'s batches, with the data position ``sampler.RankBatchSampler`` keeps: (epoch,
    step) of the next batch training takes, advanced by ``note_step`` (the optimizer's step pre-hook),
    saved in PS checkpoints and snapshots and restored before the first batch is drawn. ``micro``: the
    rank's batch of each step comes as that many micro-batches (one ``opt.step()`` each: the engine
    accumulates them), and the position moves one step per ``micro`` of them."""

    def __init__(self, tensors: Sequence[torch.Tensor], batch_sizes: Sequence[int], index: int, *,
                 epochs: int, seed: int, split: GroupSplit | None = None, micro: int = 1) -> None:
        n = len(tensors[0])
        if any(len(t) != n for t in tensors):
            raise ValueError("all tensors of a dataset need the same first dimension")
        self.tensors, self.batch_sizes, self.index = tuple(tensors), list(batch_sizes), index
        self.n, self.epochs, self.seed, self.split = n, epochs, seed, split
        self.micro = max(1, micro)
        self.steps = steps_per_epoch(n, batch_sizes)
        self._resume = 0                  # the restored position, as epoch * steps + step
        self._yielded = 0
        self._consumed = 0
        self._started = False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self._started = True
        split, steps = self.split, self.steps
        if split is not None:
            split.attach()
        for epoch in range(self.epochs):
            if (epoch + 1) * steps <= self._resume:
                continue                  # wholly before the restored position
            perm = epoch_order(self.n, epoch, self.seed)
            for step in range(steps):
                data_step = epoch * steps + step
                if data_step < self._resume:
                    continue
                start, stop = step_slice(self.n, self.batch_sizes, self.index, step, group_sizes(split, data_step))
                if split is not None:
                    split.handed_out(data_step)
                for lo, hi in micro_slices(start, stop, self.micro):
                    idx = perm[lo:hi]
                    self._yielded += 1
                    yield tuple(t[idx] for t in self.tensors)

    def note_step(self) -> None:
        if self._consumed < self._yielded:
            self._consumed += 1

    def position(self) -> tuple[int, int]:
        return divmod(self._resume + self._consumed // self.micro, self.steps)

    def state_dict(self) -> dict[str, int]:
        epoch, step = self.position()
        return {"epoch": epoch, "step": step, "steps_per_epoch": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        steps = int(state.get("steps_per_epoch") or self.steps)
        if steps != self.steps:
            raise ValueError(f"the saved data position counts {steps} steps per epoch, ctx.shard "
                             f"{self.steps}: the data or the batches changed")
        if self._started:
            raise ValueError("ctx.shard's batches were already being drawn")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps:
            raise ValueError(f"data position epoch {epoch} step {step} is outside 0..{self.steps - 1}")
        self._resume = epoch * self.steps + step


def group_sizes(split: GroupSplit | None, data_step: int) -> tuple[int, int, tuple[int, ...]] | None:
    """``step_slice``'s ``group`` at ``data_step`` (None: the plan's batches)."""
    return None if split is None else split.cut(data_step)
