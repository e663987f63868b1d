"""``ctx.sampler`` and ``ctx.loader``: this rank's batches of any map-style dataset through a DataLoader.

``RankBatchSampler`` yields index lists with the arithmetic of ``data.shard_batches`` (one contiguous
block of a seeded permutation per step, each worker its slice of the plan's size, the same number of
steps on every worker), so it needs only ``len(dataset)``: the DataLoader's workers load the samples.

It also knows the **data position**: (epoch, step within the epoch) of the next batch training takes.
The position advances when training consumes a batch (``note_step``: the runtime calls it from the
optimizer's step pre-hook, one batch per ``opt.step()``), not when the sampler yields one: a DataLoader
with workers asks for ``num_workers * prefetch_factor`` batches ahead, which training has not seen.
``state_dict``/``load_state_dict`` save and restore it; after a restore, passes over earlier epochs
yield nothing and the restored epoch starts at the restored step, so an unchanged loop
(``for epoch in range(E): sampler.set_epoch(epoch); ...``) continues where the position says.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

from torch.utils.data import DataLoader, IterableDataset, Sampler

from .blocks import epoch_order, group_sizes, micro_slices, step_slice, steps_per_epoch
from ..errors import TrainingError
from ..adapt.rebalance import GroupSplit

# DataLoader arguments ctx.loader sets itself (through its batch sampler): given again, they would
# contradict it, and torch's own error ("mutually exclusive") would not say which call to change.
_LOADER_OWNS = ("sampler", "batch_sampler", "batch_size", "shuffle", "drop_last")


class RankBatchSampler(Sampler[list[int]]):
    """Index lists of worker ``index``'s batches; ``batch_sizes`` are every worker's, in plan order.
    ``micro``: each of this worker's batches as that many micro-batches (data/blocks.py)."""

    def __init__(self, n: int, batch_sizes: Sequence[int], index: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, split: GroupSplit | None = None,
                 micro: int = 1) -> None:
        if not 0 <= index < len(batch_sizes):
            raise ValueError(f"worker index {index} outside {len(batch_sizes)} workers")
        self.n = n
        self.batch_sizes = list(batch_sizes)
        self.index = index
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.micro = max(1, micro)
        self.steps = steps_per_epoch(n, self.batch_sizes, drop_last)
        self.epoch = 0                          # the epoch of the next pass: set_epoch, else +1 per pass
        self._resume = (0, 0)                   # restored position: earlier batches are skipped
        self._pass: tuple[int, int] | None = None   # (epoch, first step) of the latest pass
        self._yielded = 0                       # batches of that pass handed to the DataLoader
        self._consumed = 0                      # ... and taken by training (note_step)
        # The group's rebalanced sizes by data step (adapt/rebalance.py); None: the plan's batches always.
        self.split = split
        if split is not None:
            split.attach()

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (deterministic: the same on every rank)."""
        self.epoch = epoch

    def _first_step(self, epoch: int) -> int:
        resume_epoch, resume_step = self._resume
        if epoch < resume_epoch:
            return self.steps                   # an epoch before the restored position: nothing left
        return resume_step if epoch == resume_epoch else 0

    def __len__(self) -> int:
        """Batches of the next pass (fewer than ``steps`` only right after a restore), micro-batches
        counted one by one."""
        return (self.steps - self._first_step(self.epoch)) * self.micro

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        first = self._first_step(epoch)
        self._pass, self._yielded, self._consumed = (epoch, first), 0, 0
        if first < self.steps:
            order = epoch_order(self.n, epoch, self.seed, self.shuffle)
            for step in range(first, self.steps):
                data_step = epoch * self.steps + step
                start, stop = step_slice(self.n, self.batch_sizes, self.index, step,
                                         group_sizes(self.split, data_step))
                if self.split is not None:
                    self.split.handed_out(data_step)
                for lo, hi in micro_slices(start, stop, self.micro):
                    self._yielded += 1
                    yield order[lo:hi].tolist()
        # A finished pass moves to the next epoch, so a loop that never calls set_epoch still
        # reshuffles (and still counts epochs after a restore); a set_epoch meanwhile wins.
        if self.epoch == epoch:
            self.epoch = epoch + 1

    def indices(self, epoch: int, step: int) -> list[int]:
        """This worker's batch at ``(epoch, step)``, whatever the position (for checks and tests)."""
        start, stop = step_slice(self.n, self.batch_sizes, self.index, step,
                                 group_sizes(self.split, epoch * self.steps + step))
        return epoch_order(self.n, epoch, self.seed, self.shuffle)[start:stop].tolist()

    # --- the data position ----------------------------------------------------------------------
    def note_step(self) -> None:
        """Training consumed one batch (never more than the sampler handed out in this pass)."""
        if self._pass is not None and self._consumed < self._yielded:
            self._consumed += 1

    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next batch training takes; the end of an epoch is the next one's 0."""
        if self._pass is None:
            return self._resume
        epoch, first = self._pass
        step = first + self._consumed // self.micro
        here = (epoch + 1, 0) if step >= self.steps else (epoch, step)
        # An (empty) pass over an epoch before the restored one has not moved the position.
        return max(here, self._resume)

    def state_dict(self) -> dict[str, int]:
        epoch, step = self.position()
        return {"epoch": epoch, "step": step, "steps_per_epoch": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from ``state_dict``) at the next pass."""
        steps = int(state.get("steps_per_epoch") or self.steps)   # absent/0: not recorded
        if steps != self.steps:
            raise ValueError(f"the saved data position counts {steps} steps per epoch, this sampler "
                             f"{self.steps}: the dataset or the batches changed, the position would "
                             f"point at other samples")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step < self.steps:
            raise ValueError(f"data position epoch {epoch} step {step} is outside 0..{self.steps - 1}")
        self._resume = (epoch, step)
        self._pass, self._yielded, self._consumed = None, 0, 0


def dataset_length(dataset: Any) -> int:
    """``len(dataset)`` of a map-style dataset; an IterableDataset (or anything without a length)
    is refused: its samples cannot be split into per-rank batches without reading the stream."""
    if isinstance(dataset, IterableDataset):
        raise TrainingError(
            f"{type(dataset).__name__} is an IterableDataset: ctx.sampler/ctx.loader split a map-style "
            f"Dataset (__len__ and __getitem__) into every worker's batch of the plan's size. Use a "
            f"map-style Dataset, or split the stream yourself per rank: worker ctx.worker_index of "
            f"len(ctx.batch_sizes(b)) takes batches of ctx.batch_sizes(b)[ctx.worker_index] samples, "
            f"and every worker must make the same number of steps")
    try:
        return len(dataset)
    except TypeError:
        raise TrainingError(f"{type(dataset).__name__} has no len(): ctx.sampler/ctx.loader need a "
                            f"map-style Dataset with __len__ and __getitem__") from None


def make_loader(dataset: Any, sampler: RankBatchSampler, kwargs: dict[str, Any]) -> DataLoader:
    """A DataLoader over ``sampler``; every other DataLoader argument passes through."""
    clash = sorted(k for k in kwargs if k in _LOADER_OWNS)
    if clash:
        raise TypeError(f"ctx.loader() sets {', '.join(clash)} itself (through its batch sampler): pass "
                        f"batch_size/shuffle/drop_last to ctx.loader, or build your own DataLoader "
                        f"with batch_sampler=ctx.sampler(...)")
    return DataLoader(dataset, batch_sampler=sampler, **kwargs)
