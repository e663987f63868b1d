"""Gradient accumulation's window (group/engine.py): the micro-steps before the one that completes it.

Their gradients, each weighted by its samples, wait beside the parameters (the optimizer then sees
no gradient and does nothing); the window's last backward adds them in: in the comm hook under DDP
(one all-reduce carries the window's samples-weighted sum), here for a group of one.
"""
from __future__ import annotations

from typing import Sequence

import torch


class GradWindow:
    """The earlier micro-steps of a gradient-accumulation window: their samples-weighted gradients wait
    here until the window's last backward adds them to its buckets."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.samples = 0                  # samples of the window's earlier micro-steps
        self.stash: dict[int, torch.Tensor] | None = None     # their weighted gradients, by id(param)
        self.found_inf = False            # GradScaler found inf/NaN in one of them (group/amp.py)

    def keep(self, n: int, found_inf: bool) -> None:
        """A micro-step of ``n`` samples that does not complete the window: its gradient, weighted by
        its samples, waits beside the parameters, and the optimizer sees none. A copy, not ``p.grad``
        itself: with ``gradient_as_bucket_view`` that tensor is DDP's bucket, which the window's last
        backward overwrites."""
        self.found_inf = found_inf        # a group of one adds this gradient in at the window's end
        stash = self.stash if self.stash is not None else {}
        for p in self.params:
            if p.grad is None:
                continue
            earlier = stash.get(id(p))
            if earlier is None:
                stash[id(p)] = p.grad.mul(n)
            else:
                earlier.add_(p.grad, alpha=n)
            p.grad = None
        self.stash = stash
        self.samples += n

    def close(self, n: int) -> int:
        """The window's last micro-step (``n`` samples): the window's samples."""
        mine, self.samples, self.found_inf = self.samples + n, 0, False
        return mine

    def finish(self, n: int, mine: int, into_grads: bool) -> None:
        """Drop the stash; ``into_grads`` (a group of one): first make ``p.grad`` the window's
        samples-weighted mean (``n``: the last micro-step's samples, ``mine``: the window's)."""
        if into_grads and self.stash is not None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(n)
                    earlier = self.stash.get(id(p))
                    if earlier is not None:
                        p.grad.add_(earlier)
                    p.grad.div_(mine)
        self.stash = None
