"""A group leader's calls to the PS shards: RPC for the control messages, waits on the pair
channels' transfers, each failure turned into a TrainingError that names the rank, its group and
what failed (the PS's own exception text, first line)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from ..errors import TrainingError
from ..ps import transfer


class ShardCalls:
    """The RPC calls and transfer waits of one group leader against its job's PS shards."""

    def __init__(self, *, rank: int, group_id: int, ps_ranks: tuple[int, ...], timeout_s: float) -> None:
        self.rank = rank
        self.group_id = group_id
        self.ps_ranks = ps_ranks
        self.timeout_s = timeout_s

    def call(self, fn: Any, what: str, args: Callable[[int], tuple[Any, ...]],
             shards: Iterable[int] | None = None) -> list[Any]:
        """``fn(*args(s))`` on every shard ``s`` (all of them by default), at once; their answers."""
        from ..groups import rpc_name

        shards = range(len(self.ps_ranks)) if shards is None else shards
        futs = [rpc_async(rpc_name(self.ps_ranks[s]), fn, args(s), self.timeout_s) for s in shards]
        return [self.wait(f, what) for f in futs]

    def wait(self, fut: Any, what: str) -> Any:
        """The result of an RPC future."""
        try:
            return fut.wait()
        except Exception as exc:  # RPC errors arrive as RuntimeError or the PS's own exception
            raise TrainingError(f"{self._who()}: {what} to the parameter server failed: {_first_line(exc)}") from exc

    def wait_works(self, works: Sequence[Any], what: str) -> None:
        """Every send/recv of a message's data over the pair channels done."""
        try:
            transfer.wait(list(works))
        except (RuntimeError, ValueError) as exc:
            raise TrainingError(f"{self._who()}: the {what}'s data to or from the parameter server failed: "
                                f"{_first_line(exc)}") from exc

    def _who(self) -> str:
        return f"rank {self.rank} (group {self.group_id})"


def rpc_async(to: str, fn: Any, args: tuple[Any, ...], timeout_s: float) -> Any:
    from torch.distributed import rpc

    return rpc.rpc_async(to, fn, args=args, timeout=timeout_s)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)
