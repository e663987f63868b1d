"""How a model's parameters are cut into PS shards: contiguous ranges of one flat vector.

The exchange lays the trainable parameters out as one flat fp32 vector, ordered by the optimizer's
parameter group (stable within a group), and each PS shard holds one contiguous range of it. A
leader's push to a shard is then one slice of its staging buffer and the shard's answer lands in one
slice of its answer buffer: no per-tensor gathering or scattering on either side.

* For optimizers whose update is elementwise (``torch.optim``'s SGD, Adam, AdamW and the others in
  :data:`ELEMENTWISE`), the ranges are equal shares of the vector (to :data:`ALIGN` elements) and may
  cut a tensor in two: each shard's share of the bytes is the same whatever the layer sizes, and the
  shard's optimizer steps one flat tensor per parameter group of its range (exactly the same update:
  every element is updated on its own).
* For any other optimizer (one that looks at a tensor's shape or norm: Adafactor, LAMB, Shampoo, a
  user's class), the ranges end at tensor edges (the edge nearest each equal share), and the shard
  steps whole tensors in their shapes. One large layer can then make its shard larger than the rest.

Pure functions: unit-tested in process, the same on the leader and the PS.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

# Range edges fall on multiples of this many elements (64 bytes of fp32): aligned slices.
ALIGN = 16

# Optimizer classes whose update of an element depends only on that element's own gradient and
# state (and scalars such as the step count): their shards may cut tensors anywhere. Exact classes,
# not subclasses: a user's subclass may add a per-tensor rule.
ELEMENTWISE: frozenset[type] = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name))


@dataclass(frozen=True)
class Segment:
    """A run of a shard's range that the shard's optimizer steps as one tensor."""
    group: int                          # the optimizer's parameter group (-1: in none; never stepped)
    length: int                         # elements
    shape: tuple[int, ...] | None       # a whole tensor's shape; None: a flat run of one group

    def to_wire(self) -> list[object]:
        return [self.group, self.length, None if self.shape is None else list(self.shape)]

    @staticmethod
    def from_wire(raw: Sequence[object]) -> "Segment":
        group, length, shape = raw
        return Segment(int(group), int(length),           # type: ignore[call-overload]
                       None if shape is None else tuple(int(d) for d in shape))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ShardLayout:
    """How the flat parameter vector is ordered and cut: each parameter's place, each shard's range and
    that range's segments for its optimizer."""
    order: tuple[int, ...]                      # parameter indices (model order) in flat order
    offsets: tuple[int, ...]                    # per flat position: where that parameter starts
    numel: int                                  # elements in the flat vector
    bounds: tuple[int, ...]                     # shard s holds flat[bounds[s]:bounds[s + 1]]
    segments: tuple[tuple[Segment, ...], ...]   # per shard, its range cut for its optimizer
    elementwise: bool

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    def span(self, shard: int) -> tuple[int, int]:
        return self.bounds[shard], self.bounds[shard + 1]

    def size(self, shard: int) -> int:
        lo, hi = self.span(shard)
        return hi - lo

    def views(self, flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Views of ``flat`` (the flat vector) shaped like the parameters, in flat order;
        ``shapes``: the parameters' shapes in model order."""
        return [flat[o: o + _numel(shapes[i])].view(*shapes[i]) for i, o in zip(self.order, self.offsets)]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_layout(shapes: Sequence[Sequence[int]], group_of: Sequence[int], n_shards: int,
                elementwise: bool) -> ShardLayout:
    """The layout of parameters of ``shapes`` (model order) whose optimizer groups are ``group_of``
    (-1 for a parameter in no group) over ``n_shards`` shards."""
    if n_shards < 1:
        raise ValueError(f"a layout needs at least one shard, not {n_shards}")
    numels = [_numel(s) for s in shapes]
    order = sorted(range(len(numels)), key=lambda i: (group_of[i] if group_of[i] >= 0 else 1 << 30, i))
    offsets, at = [], 0
    for i in order:
        offsets.append(at)
        at += numels[i]
    total = at
    edges = [*offsets, total]            # where each parameter starts, and the end
    bounds = [0]
    for k in range(1, n_shards):
        target = total * k // n_shards
        if elementwise:
            cut = min(total, (target + ALIGN // 2) // ALIGN * ALIGN)
        else:
            j = bisect.bisect_left(edges, target)
            candidates = [e for e in edges[max(0, j - 1): j + 1]]
            cut = min(candidates, key=lambda e: (abs(e - target), e)) if candidates else total
        bounds.append(max(bounds[-1], cut))
    bounds.append(total)
    segments = []
    for s in range(n_shards):
        lo, hi = bounds[s], bounds[s + 1]
        mine: list[Segment] = []
        for pos, i in enumerate(order):
            start, end = max(lo, offsets[pos]), min(hi, offsets[pos] + numels[i])
            if start >= end:
                continue
            if not elementwise:
                mine.append(Segment(group_of[i], end - start, tuple(int(d) for d in shapes[i])))
            elif mine and mine[-1].group == group_of[i]:
                mine[-1] = Segment(group_of[i], mine[-1].length + end - start, None)
            else:
                mine.append(Segment(group_of[i], end - start, None))
        segments.append(tuple(mine))
    return ShardLayout(order=tuple(order), offsets=tuple(offsets), numel=total, bounds=tuple(bounds),
                       segments=tuple(segments), elementwise=elementwise)


def segment_views(flat: torch.Tensor, segments: Sequence[Segment]) -> list[torch.Tensor]:
    """A shard's tensors: views of its range ``flat`` cut into ``segments``."""
    out, at = [], 0
    for seg in segments:
        v = flat[at: at + seg.length]
        out.append(v.view(*seg.shape) if seg.shape is not None else v)
        at += seg.length
    return out
