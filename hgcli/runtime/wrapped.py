"""What ``ctx.wrap`` returns where no DDP is built, so that it returns one kind of module in every
plan: a module with DDP's shape (issue 52). A DDP script reaches its model through ``model.module``
and accumulates under ``model.no_sync()``; both must work in a group of one (a ps plan, a world of
one) and in an fsdp group as they do in a group of two, where ``ctx.wrap`` returns torch's DDP.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class Wrapped(torch.nn.Module):
    """The model as DDP holds it: ``.module`` is the model, calling this calls it (its hooks, an
    fsdp group's sharding and a group engine's sample counting are the model's own), and the
    state dict's names carry DDP's ``module.`` prefix."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: nothing to skip here (a group of one all-reduces nothing; an fsdp group
        accumulates as its plan says), so a script's own accumulation runs unchanged."""
        yield


def like_ddp(trained: torch.nn.Module) -> torch.nn.Module:
    """``trained`` when it is DDP (it has ``.module`` and ``no_sync``), else it in a :class:`Wrapped`."""
    from torch.nn.parallel import DistributedDataParallel

    return trained if isinstance(trained, DistributedDataParallel) else Wrapped(trained)
