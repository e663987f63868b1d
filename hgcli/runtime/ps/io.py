"""A PS shard's data path: seeds and pushes in, answers out, over each group's pair channel.

The RPC handlers (ps/server.py) hand the bulk work here and return at once, so a transfer never holds an
RPC thread. A push is received into the shard's one staging buffer (the optimizer's ``.grad``; a
bf16 push is widened on the way, ps/transfer.py) on a thread of :attr:`ShardIO.pushes`, then applied
by ``ShardServer.push``. An answer with parameters is delivered in two parts: its RPC result says
that parameters follow, and a thread of :attr:`ShardIO.sends` sends them from the shard's master
copy (no copy of it; narrowed to bf16 on the way under the bf16 wire). Until that send is done it counts as a reader, which keeps the next step waiting.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch
from torch.futures import Future

from . import optim, transfer
from ..errors import TrainingError
from ..adapt.shares import Pace
from ..groups import channel
from .server import MASTER, PARAMS, ShardServer, payload
from .shards import Segment


class ShardIO:
    """A PS shard's data path: receives seeds and pushes over each group's pair channel and sends the
    answers, on threads of its own, so that no RPC thread waits on a transfer."""

    def __init__(self, server: ShardServer, *, leaders: Mapping[int, int]) -> None:
        self.server = server
        self.leaders = dict(leaders)
        workers = len(self.leaders) + 1
        self.pushes = ThreadPoolExecutor(workers, thread_name_prefix="hgtrain-ps-recv")
        self.sends = ThreadPoolExecutor(workers, thread_name_prefix="hgtrain-ps-send")
        self.scratch = transfer.scratch(server.wire_dtype) if server.wire_dtype != torch.float32 else None
        server.deliver = self.deliver

    def _peer(self, group: int) -> tuple[int, Any]:
        if group not in self.leaders:
            raise TrainingError(f"PS shard {self.server.shard}: group {group} is not a group of the plan")
        return self.leaders[group], channel(group, self.server.shard)

    # --- in ----------------------------------------------------------------------------------
    def seed(self, group: int, segments: tuple[Segment, ...], spec: dict[str, Any],
             buffers: torch.Tensor | None) -> Future:
        def work() -> Any:
            leader, pg = self._peer(group)
            flat = torch.empty(sum(s.length for s in segments))
            transfer.recv(flat, leader, pg, torch.float32)
            return self.server.seed(group, flat, segments, spec, buffers)
        return self._run(work)

    def push(self, group: int, samples: float, hyper: optim.Hyperparameters, buffers: torch.Tensor | None,
             data_position: dict[str, int] | None, base: int | None, pace: Pace | None = None) -> Future:
        def work() -> Any:
            leader, pg = self._peer(group)
            with self.server.staging:
                grad = self.server.held.grad
                if grad is None:
                    raise TrainingError(f"PS shard {self.server.shard}: push from group {group} before the seed")
                transfer.recv(grad, leader, pg, self.server.wire_dtype, self.scratch)
                return self.server.push(group, grad, samples, hyper, buffers, data_position, base, pace)
        return self._run(work)

    def _run(self, work: Any) -> Future:
        """``work`` on a receiving thread; its result (a value or a Future) becomes the RPC's."""
        out: Future = Future()

        def run() -> None:
            try:
                result = work()
            except Exception as exc:          # the leader hears it as the RPC's error
                out.set_exception(exc)
                return
            if isinstance(result, Future):
                result.add_done_callback(lambda f: _forward(f, out))
            else:
                out.set_result(result)
        self.pushes.submit(run)
        return out

    # --- out ---------------------------------------------------------------------------------
    def deliver(self, group: int, fut: Future, fields: tuple[Any, ...]) -> None:
        """(server.cv held) The answer's fields, with ``True`` for the parameters, which follow over
        the channel."""
        dtype = payload(fields, self.server.wire_dtype)
        if dtype is None:
            fut.set_result(fields)
            return
        self.server.readers += 1
        try:
            leader, pg = self._peer(group)
            fut.set_result(tuple(True if f is PARAMS or f is MASTER else f for f in fields))
        except Exception:
            self.server.readers -= 1
            raise
        self.sends.submit(self._send, group, leader, pg, dtype)

    def _send(self, group: int, leader: int, pg: Any, dtype: torch.dtype) -> None:
        try:
            master = self.server.held.master
            assert master is not None
            if dtype == master.dtype:
                transfer.wait(transfer.send(master, leader, pg))
            else:
                transfer.send_narrowed(master, leader, pg, dtype)
        except Exception as exc:      # the leader died or the link broke: the wait loop names it
            self.server._trace("send_failed", group=group, error=str(exc).splitlines()[0] if str(exc) else repr(exc))
        finally:
            with self.server.cv:
                self.server.readers -= 1
                self.server.cv.notify_all()

    def close(self) -> None:
        """After the job's final barrier: nothing is left to receive or send."""
        self.pushes.shutdown()
        self.sends.shutdown()


def _forward(src: Future, dst: Future) -> None:
    try:
        dst.set_result(src.value())
    except Exception as exc:
        dst.set_exception(exc)
