"""The data source of a script that draws its own batches (``ctx.batch_size``, ``ctx.generator``).

A GPT-style script samples random windows of a token array itself, with no ``DataLoader``: it needs
only how many samples to draw this step and a random stream of its own. Both come from here, so that
such a script gets what ``ctx.shard`` gives a script with a dataset:

* **the batch** is this worker's share of the plan, per ``opt.step()``: with the plan's
  ``micro_batches`` m, the step's batch cut into m pieces as ``ctx.shard`` cuts it (7 as 4 + 3), and
  with a re-split of the group's batch (adapt/rebalance.py, adapt/shares.py) the sizes from the data
  step it applies at. Reading the size reports that data step as handed out, which is what lets a
  re-split start only where no member has drawn yet. The engine weights each gradient by the samples
  its forward saw (the first dimension of the wrapped module's first argument), not by this number,
  so a script that draws another size is still weighted right; it only defeats the re-split.
* **the stream** of each worker is seeded from (the script's seed, the worker's index, the data step
  it starts at): workers draw different samples, a rerun draws the same ones, and a run resumed from
  a snapshot or PS checkpoint at data step s re-seeds at s rather than replaying step 0's draws.
* **the position** is the data step (``epoch`` 0, ``steps_per_epoch`` 0: a stream has no epochs),
  moved by every ``opt.step()``, so checkpoints and snapshots record it as they record a sampler's.
"""
from __future__ import annotations

import hashlib

import torch

from ..adapt.rebalance import GroupSplit
from .blocks import micro_slices

SEED_BITS = 63          # torch.Generator.manual_seed takes any 64-bit value; stay clear of the sign


def worker_seed(seed: int, worker_index: int, data_step: int) -> int:
    """A seed for worker ``worker_index``'s stream from ``data_step`` on: unrelated streams for
    neighbouring triples (``seed + rank`` would give worker 1 of seed 0 worker 0's stream of seed 1)."""
    digest = hashlib.blake2b(f"{seed}:{worker_index}:{data_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


class DrawnBatches:
    """This worker's batch sizes and random streams, and its data position (module docstring).

    ``planned``: the worker's batch in the plan (None: the plan gives none, the script's default
    holds); ``index``: its place among the plan's workers; ``micro``: its micro-batches per step."""

    def __init__(self, planned: int | None, index: int, *, micro: int = 1) -> None:
        self.planned, self.index, self.micro = planned, index, max(1, micro)
        self.split: GroupSplit | None = None
        self._resume = 0                # the restored data step
        self._consumed = 0              # opt.step() calls since the start or the restore
        self._generators: list[tuple[torch.Generator, int]] = []

    def follow(self, split: GroupSplit | None) -> None:
        """Take the group's re-split batches from now on (None: the plan's throughout)."""
        self.split = split
        if split is not None:
            split.attach()

    @property
    def data_step(self) -> int:
        """The step whose batch the script draws next."""
        return self._resume + self._consumed // self.micro

    def batch_size(self, default: int) -> int:
        """Samples to draw for the next ``opt.step()``: one micro-batch of the step's batch."""
        step = self.data_step
        size = self.planned or default
        if self.split is not None:
            first, _, sizes = self.split.cut(step)
            size = sizes[self.index - first]
            self.split.handed_out(step)
        lo, hi = micro_slices(0, size, self.micro)[self._consumed % self.micro]
        return hi - lo

    def generator(self, seed: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A new generator on ``device`` for this worker's stream; re-seeded if a position is restored."""
        gen = torch.Generator(device=device)
        gen.manual_seed(worker_seed(seed, self.index, self._resume))
        self._generators.append((gen, seed))
        return gen

    # --- data position (exchange/position.py's Positioned) ----------------------------------------
    def note_step(self) -> None:
        self._consumed += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "step": self.data_step, "steps_per_epoch": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self._consumed:
            raise ValueError("the script has stepped already: a data position is restored before training")
        step = int(state["epoch"]) * int(state.get("steps_per_epoch") or 0) + int(state["step"])
        if step < 0:
            raise ValueError(f"data step {step} is negative")
        self._resume = step
        for gen, seed in self._generators:
            gen.manual_seed(worker_seed(seed, self.index, step))
