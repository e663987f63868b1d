"""A group's collectives outside DDP's reducer (group/engine.py): the broadcasts the PS exchange makes
(exchange.GroupState is this class) and the one error a failed collective of the group raises."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import flat as flatten_
from ..errors import TrainingError


class GroupLink:
    """A group's collectives outside DDP's reducer (the broadcasts of the PS exchange), each failure
    turned into the one TrainingError that names the rank and its group."""

    def __init__(self, *, rank: int, group_id: int, ranks: tuple[int, ...], pg: Any, timeout_s: float,
                 params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        self.rank = rank
        self.group_id = group_id
        self.ranks = ranks
        self.leader = ranks[0]
        self.members = len(ranks)
        self.pg = pg
        self.timeout_s = timeout_s
        self.params = params
        self.buffers = buffers
        self.device = device

    def broadcast_state(self, version: int, words: Sequence[int] = ()) -> tuple[int, list[int]]:
        """The leader's parameters, synchronised buffers, ``version`` and ``words`` (small integers:
        the shares' schedule, exchange/gradient.py) to the group, in one broadcast. The integers travel as the
        bytes of int64s viewed in the vector's dtype: a broadcast copies bytes, and no float type of
        the parameters (bf16 holds integers exactly only up to 256) could carry them as numbers."""
        if self.members <= 1:
            return version, list(words)
        params = flatten_.flatten(self.params, self.device)
        state = torch.cat([params, flatten_.flatten(self.buffers, self.device).to(params.dtype)])
        word = torch.tensor([version, *words], dtype=torch.int64, device=state.device).view(state.dtype)
        whole = torch.cat([state, word])
        self.collective(lambda: dist.broadcast(whole, self.leader, group=self.pg), "broadcast")
        flatten_.load(self.params, whole[:params.numel()])
        flatten_.load(self.buffers, whole[params.numel(): state.numel()])
        heard = whole[state.numel():].clone().view(torch.int64).tolist()   # clone: aligned
        return int(heard[0]), [int(w) for w in heard[1:]]

    def broadcast_flag(self, flag: torch.Tensor) -> None:
        if self.members > 1:
            self.collective(lambda: dist.broadcast(flag, self.leader, group=self.pg), "broadcast")

    def collective(self, op: Callable[[], Any], what: str) -> Any:
        try:
            return op()
        except (RuntimeError, ValueError) as exc:
            raise self.failed(what, exc) from exc

    def failed(self, what: str, exc: BaseException) -> TrainingError:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return TrainingError(f"rank {self.rank} (group {self.group_id}): {what} in group {self.group_id} "
                             f"{list(self.ranks)} failed (a peer died or timed out after {self.timeout_s:g} s): "
                             f"{first}")
