"""Bulk tensors between a group leader and a PS shard: torch.distributed send/recv, not RPC.

Each (group, shard) pair has a process group of its own, the leader and the shard (groups.py makes
them, gloo: the PS's tensors are CPU tensors). On it the two ends exchange the slices of the flat
parameter vector (ps/shards.py) that pushes and answers carry; RPC carries only the small control
messages that say what comes next. A pair has at most one exchange in flight (the leader waits for
each answer before its next push), so both ends post their sends and receives in the same order.

A tensor travels as messages of :data:`CHUNK` elements. A receiver that widens (a bf16 push into
the PS's fp32 gradient) and a sender that narrows (a bf16 answer from the PS's fp32 master copy)
take them through two small buffers in turn, so neither holds a second copy of the whole slice;
the others send and receive straight from and into their tensors.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CHUNK = 1 << 22        # elements per message: 8 MiB of bf16, 16 MiB of fp32


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)]


def send(tensor: torch.Tensor, peer: int, pg: Any) -> list[Any]:
    """Start sending the 1-D contiguous ``tensor`` to global rank ``peer``; returns the works to wait
    for (the tensor must not change until they complete)."""
    return [dist.isend(tensor[a:b], peer, group=pg) for a, b in _chunks(tensor.numel())]


def send_narrowed(src: torch.Tensor, peer: int, pg: Any, wire: torch.dtype) -> None:
    """Send the 1-D contiguous ``src`` to ``peer`` as ``wire`` (bf16 answers from the PS's fp32
    master copy), converting chunk by chunk through two small buffers; returns when sent."""
    bufs = scratch(wire)
    works: list[list[Any]] = [[], []]
    for k, (a, b) in enumerate(_chunks(src.numel())):
        wait(works[k % 2])               # that buffer's previous chunk has left
        buf = bufs[k % 2][: b - a]
        buf.copy_(src[a:b])
        works[k % 2] = [dist.isend(buf, peer, group=pg)]
    wait(works[0] + works[1])


def wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def irecv(dst: torch.Tensor, peer: int, pg: Any) -> list[Any]:
    """Start receiving into the 1-D contiguous ``dst`` (the sender's type); returns the works."""
    return [dist.irecv(dst[a:b], peer, group=pg) for a, b in _chunks(dst.numel())]


def recv(dst: torch.Tensor, peer: int, pg: Any, wire: torch.dtype,
         scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Receive into the 1-D contiguous ``dst`` what ``peer`` sends as ``wire``: straight into it when
    the types agree, else through ``scratch`` (two buffers of CHUNK elements of ``wire``), converting."""
    parts = _chunks(dst.numel())
    if wire == dst.dtype:
        wait(irecv(dst, peer, pg))
        return
    bufs = scratch if scratch is not None else (torch.empty(CHUNK, dtype=wire), torch.empty(CHUNK, dtype=wire))
    pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
    for k, (a, b) in enumerate(parts):
        buf = bufs[k % 2][: b - a]
        work = dist.irecv(buf, peer, group=pg)
        if pending is not None:          # widen the chunk before while this one arrives
            pending[0].wait()
            pending[2].copy_(pending[1])
        pending = (work, buf, dst[a:b])
    if pending is not None:
        pending[0].wait()
        pending[2].copy_(pending[1])


def scratch(wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(CHUNK, dtype=wire), torch.empty(CHUNK, dtype=wire)
