"""A PS rank's RPC entry points, and the shard they serve.

Module-level functions so that workers can name them in ``rpc_async`` (RPC pickles a function by its
qualified name, ``hgcli.runtime.ps.handlers.push``); they run on the PS's RPC threads. They carry the
control messages; the tensors of seeds, pushes and answers go over the pair's channel (io.py). Kept
apart from ``rank.main`` so that ``python -m hgcli.runtime.ps`` (which runs ``__main__``) and the
workers resolve the handlers in the same module.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed import rpc
from torch.futures import Future

from . import optim
from .io import ShardIO
from .server import ShardServer
from .shards import Segment
from ..adapt.shares import Pace
from ..errors import TrainingError
from ..groups import rpc_name

_SERVER: ShardServer | None = None
_IO: ShardIO | None = None


def serve(server: ShardServer, io: ShardIO | None) -> None:
    """Make ``server`` (and, once the job's process groups exist, its ``io``) what the handlers call."""
    global _SERVER, _IO
    _SERVER, _IO = server, io


@rpc.functions.async_execution
def pull(group: int) -> Future:
    return _server().pull(group)


@rpc.functions.async_execution
def push(group: int, samples: float, hyper: optim.Hyperparameters, buffers: torch.Tensor | None,
         data_position: dict[str, int] | None = None, base: int | None = None,
         pace: Pace | None = None) -> Future:
    return _io().push(group, samples, hyper, buffers, data_position, base, pace)


@rpc.functions.async_execution
def finish(group: int, wait_s: float) -> Future:
    return _server().finish(group, wait_s)


@rpc.functions.async_execution
def seed(group: int, segments: list[list[Any]], spec: dict[str, Any], buffers: torch.Tensor | None) -> Future:
    return _io().seed(group, tuple(Segment.from_wire(s) for s in segments), spec, buffers)


def state() -> tuple[int, torch.Tensor, torch.Tensor | None]:
    return _server().state()


def data_position(group: int) -> dict[str, int] | None:
    return _server().data_position(group)


def schedule_checkpoint(version: int) -> None:
    _server().schedule_checkpoint(version)


def _server() -> ShardServer:
    if _SERVER is None:
        raise TrainingError("this rank is not a parameter server")
    return _SERVER


def _io() -> ShardIO:
    if _IO is None:
        raise TrainingError("this rank is not a parameter server")
    return _IO


def schedule_on(rank: int, version: int) -> None:
    """Tell the PS shard of ``rank`` to checkpoint at ``version`` (shard 0's ``schedule_on``)."""
    rpc.rpc_async(rpc_name(rank), schedule_checkpoint, args=(version,))
