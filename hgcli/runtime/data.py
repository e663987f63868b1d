"""Per-rank batches from one dataset: every step, the union of all workers' batches is one contiguous
block of a seeded permutation (the global batch), and each worker takes a slice sized by its plan batch.

So ranks with unequal batches run the same number of steps per epoch (collectives stay matched), and
a synchronous run sees exactly the batches a single process would see with the global batch.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch


def shard_batches(tensors: Sequence[torch.Tensor], batch_sizes: Sequence[int], index: int, *,
                  epochs: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
    n = len(tensors[0])
    if any(len(t) != n for t in tensors):
        raise ValueError("all tensors of a dataset need the same first dimension")
    global_batch = sum(batch_sizes)
    if global_batch > n:
        raise ValueError(f"global batch {global_batch} is larger than the dataset ({n} samples)")
    offset = sum(batch_sizes[:index])
    mine = batch_sizes[index]
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=gen)
        for step in range(n // global_batch):
            idx = perm[step * global_batch + offset: step * global_batch + offset + mine]
            yield tuple(t[idx] for t in tensors)
