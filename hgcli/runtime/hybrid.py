"""Gradient aggregation behind a user's ``optimizer.step()``: weighted all-reduce inside the group,
then either the local optimizer (allreduce plans: no PS) or a push to the PS shards (hybrid plans).

It hooks the user's optimizer instead of replacing it, so LR schedulers and ``zero_grad`` keep
working. Before each step it takes the gradients (weighted by the samples the model saw in training
forwards since the last step) into its own accumulator and clears ``p.grad``; on the step that
completes the group's accumulation it all-reduces ``[sum n_r*g_r, sum n_r]`` once (plus two slots per
member: its last step's batch and its emulator's stable estimate, which the members on one node pool,
emulate.py) and either puts
the weighted mean back into ``p.grad`` (the local optimizer then steps, like DDP) or, for hybrid,
the group leader pushes it to the PS and broadcasts the fresh parameters to its group.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .emulate import Emulator
from .errors import TrainingError
from .metrics import MetricsSink

FINISH_POLL_S = 5.0     # how long a leader's "finished?" call waits on the PS before asking again


def sync_buffer_numel(parameters: int, members: int) -> int:
    """Elements of a group's synchronising all-reduce: [weighted gradients | total samples | (batch,
    estimate) per member]. The members' slots ride on the all-reduce the step makes anyway, so
    pooling estimates costs no extra round trip; a group of one has none (it does no all-reduce)."""
    return parameters + 1 + (2 * members if members > 1 else 0)


class GroupSync:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group_ranks: tuple[int, ...], pg: Any, rank: int, group_id: int, accumulate: int,
                 ps_ranks: tuple[int, ...], first_worker: int, default_batch: int,
                 emulator: Emulator, metrics: MetricsSink, timeout_s: float,
                 share_with: tuple[int, ...] = (),
                 data_position: Callable[[], dict[str, int] | None] | None = None) -> None:
        self.model = model
        self.opt = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ranks = group_ranks
        self.pg = pg
        self.rank = rank
        self.group_id = group_id
        self.leader = group_ranks[0]
        self.accumulate = max(1, accumulate)
        self.ps_ranks = ps_ranks
        self.first_worker = first_worker
        self.default_batch = default_batch
        self.emulator = emulator
        self.metrics = metrics
        self.timeout_s = timeout_s
        # Positions in ``group_ranks`` of the members on this rank's node (itself included): their
        # emulated steps share one stable estimate (emulate.py).
        self.share_with = share_with
        # The group's data position, sent with each push so PS checkpoints record it (position.py).
        self.data_position = data_position
        self._me = group_ranks.index(rank)
        self.version = 0
        self.local_step = 0
        self.samples_seen = 0
        # Wall seconds this rank spent synchronising in the loop (all-reduce, PS exchange, the
        # broadcast of fresh parameters): with compute and emulated sleep, where its steps went.
        self.sync_s = 0.0
        self._samples = 0
        device = self.params[0].device if self.params else torch.device("cpu")
        self._numel = sum(p.numel() for p in self.params)
        self._acc = torch.zeros(sync_buffer_numel(self._numel, len(group_ranks)), device=device)
        if ps_ranks:
            from .ps import assign_shards
            self._owner = assign_shards([p.numel() for p in self.params], len(ps_ranks))
        self._hooks = [
            model.register_forward_pre_hook(self._count_samples),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    # --- start --------------------------------------------------------------------------------
    def start(self) -> None:
        """Make every worker start from the same parameters: rank 0's (DDP) or the PS's (hybrid)."""
        if not self.ps_ranks:
            self._broadcast_params()
        else:
            if self.rank == self.first_worker:
                from . import ps

                flat, spec = self._flat_params(), self._optimizer_spec()
                self._call_shards(ps._seed, "seed", lambda s: (self.group_id, self._shard_flat(flat, s),
                                                              self._shard_shapes(s), spec))
            if self.rank == self.leader:
                self._set_params_from_shards(self._exchange(None, 0.0))
            self._broadcast_params()
        self.emulator.begin_compute()

    # --- hooks ----------------------------------------------------------------------------------
    def _count_samples(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            self._samples += args[0].shape[0] if args[0].dim() else 1

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        n = self._samples or self.default_batch
        self.emulator.end_compute(self.local_step, n)
        self._samples = 0
        self.samples_seen += n
        offset = 0
        for p in self.params:
            if p.grad is not None:
                self._acc[offset: offset + p.numel()].add_(p.grad.reshape(-1), alpha=float(n))
            offset += p.numel()
            p.grad = None
        self._acc[self._numel] += n
        self.local_step += 1
        if self.local_step % self.accumulate:
            return                              # still accumulating: the optimizer sees no grads
        if len(self.ranks) > 1:
            mine = self._numel + 1 + 2 * self._me
            self._acc[mine] = n
            self._acc[mine + 1] = self.emulator.estimate(n)
        t0 = time.perf_counter()
        self._allreduce(self._acc)
        t1 = time.perf_counter()
        self._pool_estimates(n)
        total = float(self._acc[self._numel])
        grad = self._acc[:self._numel] / max(total, 1e-12)
        if not self.ps_ranks:
            offset = 0
            for p in self.params:
                p.grad = grad[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            self.sync_s += t1 - t0
        else:
            if self.rank == self.leader:
                self._set_params_from_shards(self._exchange(grad, total))
            t2 = time.perf_counter()
            self._broadcast_params()
            t3 = time.perf_counter()
            self.sync_s += t3 - t0
            self.metrics.emit(event="sync", group=self.group_id, version=self.version, samples=total,
                              allreduce_s=t1 - t0, push_s=t2 - t1, broadcast_s=t3 - t2)
        self._acc.zero_()

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.emulator.begin_compute()

    def _pool_estimates(self, batch: int) -> None:
        """The median estimate of this node's members whose last step had the same batch (none to pool
        with when it is the only one there: its own estimate stays current)."""
        if len(self.ranks) < 2 or len(self.share_with) < 2:
            return
        slots = self._acc[self._numel + 1:].tolist()
        pool = [slots[2 * i + 1] for i in self.share_with if slots[2 * i] == batch and slots[2 * i + 1] > 0]
        if pool:
            self.emulator.share(batch, statistics.median(pool))

    # --- end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every group is done, then hold the PS's final parameters (hybrid)."""
        for h in self._hooks:
            h.remove()
        if not self.ps_ranks:
            return
        from . import ps
        from .groups import rpc_name

        while True:
            # On the rank's device: an NCCL group takes CUDA tensors only (a CPU flag failed on an
            # H200 with "No backend type associated with device type cpu").
            flag = torch.zeros(1, device=self._acc.device)
            if self.rank == self.leader:
                answers = [self._wait(fut, "finish") for fut in [
                    _rpc_async(rpc_name(r), ps._finish, (self.group_id, FINISH_POLL_S), self.timeout_s)
                    for r in self.ps_ranks]]
                if all(done for done, _, _ in answers):
                    flag[0] = 1
                    self._set_params_from_shards([(v, flat) for _, v, flat in answers])
            if len(self.ranks) > 1:
                self._collective(lambda: dist.broadcast(flag, self.leader, group=self.pg), "broadcast")
            if flag[0]:
                self._broadcast_params()
                return

    # --- helpers --------------------------------------------------------------------------------
    def _exchange(self, grad: torch.Tensor | None, samples: float) -> list[tuple[int, torch.Tensor]]:
        """Push ``grad`` (None: just start) to every shard; shard 0's answer may be held back by
        the staleness rule and carries its parameters; then the other shards' parameters are pulled."""
        from . import ps

        if grad is not None:
            lr = float(self.opt.param_groups[0]["lr"])
            pos = self.data_position() if self.data_position else None
            answers = self._call_shards(ps._push, "push", lambda s: (self.group_id, self._shard_flat(grad, s),
                                                                    samples, lr, pos))
        else:
            answers = self._call_shards(ps._pull, "pull", lambda s: (self.group_id,), shards=[0])
        if len(self.ps_ranks) > 1:
            rest = self._call_shards(ps._pull, "pull", lambda s: (self.group_id,),
                                     shards=range(1, len(self.ps_ranks)))
            answers = [answers[0], *rest]
        return answers

    def _call_shards(self, fn: Any, what: str, args: Callable[[int], tuple[Any, ...]],
                     shards: Any = None) -> list[Any]:
        from .groups import rpc_name

        shards = range(len(self.ps_ranks)) if shards is None else shards
        futs = [_rpc_async(rpc_name(self.ps_ranks[s]), fn, args(s), self.timeout_s) for s in shards]
        return [self._wait(f, what) for f in futs]

    def _wait(self, fut: Any, what: str) -> Any:
        try:
            return fut.wait()
        except Exception as exc:  # RPC errors arrive as RuntimeError or the PS's own exception
            raise TrainingError(f"rank {self.rank} (group {self.group_id}): {what} to the parameter "
                                f"server failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc

    def _allreduce(self, buf: torch.Tensor) -> None:
        if len(self.ranks) > 1:
            self._collective(lambda: dist.all_reduce(buf, group=self.pg), "all-reduce")

    def _broadcast_params(self) -> None:
        if len(self.ranks) <= 1:
            return
        flat = self._flat_params()
        self._collective(lambda: dist.broadcast(flat, self.leader, group=self.pg), "broadcast")
        self._load_flat(flat)
        for b in self.model.buffers():
            self._collective(lambda: dist.broadcast(b, self.leader, group=self.pg), "broadcast")

    def _collective(self, op: Callable[[], Any], what: str) -> None:
        try:
            op()
        except (RuntimeError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise TrainingError(f"rank {self.rank} (group {self.group_id}): {what} in group "
                                f"{self.group_id} {list(self.ranks)} failed (a peer died or timed out "
                                f"after {self.timeout_s:g} s): {first}") from exc

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _load_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def _shard_index(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self._owner) if s == shard]

    def _shard_flat(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        return torch.cat([flat[offsets[i]: offsets[i + 1]] for i in self._shard_index(shard)]).cpu()

    def _shard_shapes(self, shard: int) -> list[tuple[int, ...]]:
        return [tuple(self.params[i].shape) for i in self._shard_index(shard)]

    def _set_params_from_shards(self, answers: list[tuple[int, torch.Tensor]]) -> None:
        flat = torch.empty(self._numel)
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        for shard, (version, shard_flat) in enumerate(answers):
            pos = 0
            for i in self._shard_index(shard):
                n = offsets[i + 1] - offsets[i]
                flat[offsets[i]: offsets[i + 1]] = shard_flat[pos: pos + n]
                pos += n
        self.version = max(v for v, _ in answers)
        self._load_flat(flat.to(self._acc.device))

    def _optimizer_spec(self) -> dict[str, Any]:
        if len(self.opt.param_groups) != 1:
            raise TrainingError("hybrid training needs an optimizer with one parameter group "
                                "(the PS runs one optimizer over all parameters)")
        # Constructor arguments only (schedulers add keys such as initial_lr to param groups).
        group = self.opt.param_groups[0]
        kwargs = {k: group.get(k, v) for k, v in self.opt.defaults.items() if k != "params"}
        return {"name": type(self.opt).__name__, "kwargs": kwargs}


def _rpc_async(to: str, fn: Any, args: tuple[Any, ...], timeout_s: float) -> Any:
    from torch.distributed import rpc

    return rpc.rpc_async(to, fn, args=args, timeout=timeout_s)
