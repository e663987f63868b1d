"""A group's exchange with the parameter servers (hybrid and ps plans), beside its group engine.

The group engine (engine.py) hands the exchange each completed step's aggregated gradient; the group
leader pushes it to the PS shards and loads their answer, and the group hears the fresh parameters
in one broadcast the engine makes. What the engine offers the exchange is :class:`GroupState`.

With ``overlap`` (Plan.overlap) the leader's exchange runs on a thread of its own while the group
computes its next step on the parameters it has: at each push it first waits for the answer to its
previous push, starts the new push (its gradient was computed on the answer before, whose per-shard
versions go with it as the base the PS counts staleness from) and hands the group the answer it
waited for. With ``wire`` "bf16" pushes and pulls travel as bf16; what rounding takes off a push is
added to the next one (error feedback), so no part of a gradient is lost for good.

Parameters reach the PS as fp32 whatever the model's dtype: its master copy and optimizer state are
fp32 (a bf16 model trains on the PS's fp32 values rounded into its bf16 parameters at each answer).
"""
from __future__ import annotations

import time
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from . import flat as flatten_
from . import optim
from .errors import TrainingError
from .metrics import MetricsSink

FINISH_POLL_S = 5.0     # how long a leader's "finished?" call waits on the PS before asking again

# What a PS shard answers: (version, its parameters or None for an acknowledgement, the buffers
# (shard 0, when the model has synchronised buffers) or None).
ShardAnswer = tuple[int, "torch.Tensor | None", "torch.Tensor | None"]
Collective = Callable[[Callable[[], Any], str], Any]


class GroupState(Protocol):
    """What the exchange needs of its group engine."""
    rank: int
    group_id: int
    leader: int
    device: torch.device

    @property
    def params(self) -> Sequence[torch.Tensor]:
        """The parameters the group trains, in the model's order."""
        ...

    @property
    def buffers(self) -> Sequence[torch.Tensor]:
        """The buffers the group synchronises (flat.synced_buffers)."""
        ...

    def broadcast_state(self, version: int) -> int:
        """The leader's parameters, synchronised buffers and ``version`` to the whole group; returns
        the version every member now holds."""
        ...

    def broadcast_flag(self, flag: torch.Tensor) -> None:
        """The leader's ``flag`` to the whole group (a no-op in a group of one)."""
        ...


class ErrorFeedback:
    """Rounding of pushes to a narrower wire format with error feedback: what rounding left out of
    the previous pushes is added before rounding, and what this rounding leaves out is kept, so
    the pushes' sum stays within one rounding of the gradients' sum (without it, a component
    below half a bf16 step of its gradient's scale would never reach the PS)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.residual: torch.Tensor | None = None

    def round(self, grad: torch.Tensor) -> torch.Tensor:
        target = grad if self.residual is None else grad + self.residual
        sent = target.to(self.dtype)
        self.residual = target - sent.to(grad.dtype)
        return sent


class PSExchange:
    """Push, pull, seed and finish of one group with the PS shards ``ps_ranks``. Every member holds
    one (the members' part is to hear the leader's broadcasts at the same points); only the leader
    talks to the PS."""

    def __init__(self, *, group: GroupState, optimizer: torch.optim.Optimizer, ps_ranks: tuple[int, ...],
                 first_worker: int, metrics: MetricsSink, timeout_s: float, overlap: bool = False,
                 wire: str = "fp32", data_position: Callable[[], dict[str, int] | None] | None = None,
                 frozen: Sequence[torch.Tensor] = ()) -> None:
        self.group = group
        self.opt = optimizer
        self.ps_ranks = ps_ranks
        self.first_worker = first_worker
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.overlap = overlap
        if wire not in ("fp32", "bf16"):
            raise TrainingError(f"rank {group.rank}: plan wire {wire!r} is not fp32 or bf16")
        self.wire_dtype = torch.bfloat16 if wire == "bf16" else torch.float32
        self.data_position = data_position
        self.version = 0
        self.sync_s = 0.0
        params = group.params
        # Checked on every worker at wrap time, before anything reaches the PS: each rank fails with
        # the reason, not only the first worker whose seed the PS would refuse.
        from .ps import assign_shards
        try:
            self._opt_class = optim.class_path(type(optimizer))
            self._groups = optim.group_indices(optimizer, list(params), list(frozen))
            optim.build_optimizer(params, optim.shard_spec(optimizer, *self._opt_class, self._groups,
                                                           range(len(params))))
        except TrainingError as exc:
            raise TrainingError(f"rank {group.rank}: hybrid training: {exc}") from exc
        self._seeded = [optim.group_options(g, optimizer.defaults) for g in optimizer.param_groups]
        self._owner = assign_shards([p.numel() for p in params], len(ps_ranks))
        self._offsets = [0]
        for p in params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._numel = self._offsets[-1]
        self._shard_versions: list[int] = [0] * len(ps_ranks)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hgtrain-exchange") if overlap else None
        self._in_flight: "ThreadFuture[list[ShardAnswer]] | None" = None
        self._pushed = False                              # under overlap: every later push hands over an answer
        self._last_answer: torch.Tensor | None = None     # the leader's previous answer (overlap)
        self._feedback = ErrorFeedback(self.wire_dtype) if self.wire_dtype != torch.float32 else None
        self._finished = False

    @property
    def is_leader(self) -> bool:
        return self.group.rank == self.group.leader

    # --- start ----------------------------------------------------------------------------------
    def start(self) -> None:
        """The first worker seeds the PS with its parameters; every leader pulls them, and its group
        hears them."""
        from . import ps

        if self.group.rank == self.first_worker:
            flat, held = self._flat_params().float(), self._flat_buffers()
            bufs = held.float().cpu() if held.numel() else None
            self._call_shards(ps._seed, "seed", lambda s: (
                self.group.group_id, self._shard_flat(flat, s), self._shard_shapes(s), self._spec(s),
                bufs if s == 0 else None))
        if self.is_leader:
            self._load_answers(self._send(None))
        self.version = self.group.broadcast_state(self.version)

    # --- a step ---------------------------------------------------------------------------------
    def step(self, grad: torch.Tensor | None, samples: float, buffers: torch.Tensor | None, *,
             allreduce_s: float = 0.0) -> None:
        """The group's aggregated gradient of a completed step (``grad``: the leader's, the flat
        weighted mean; None on the other members) goes to the PS, and the group takes its answer.
        ``allreduce_s``: what the group's all-reduce cost the step (the engine's), for its metrics."""
        t0 = time.perf_counter()
        if self.overlap:
            if self.is_leader:
                assert grad is not None
                push = self._push_request(grad, samples, buffers)   # based on the parameters held
                answers = self._collect()                           # the previous push's answer
                assert self._pool is not None
                self._in_flight = self._pool.submit(self._send, push)
                if answers is not None:
                    self._load_answers(answers)
                    self._predict()
            t1 = time.perf_counter()
            if self._pushed:        # every member knows: the first push has no answer to hand over
                self.version = self.group.broadcast_state(self.version)
            self._pushed = True
        else:
            if self.is_leader:
                assert grad is not None
                self._load_answers(self._send(self._push_request(grad, samples, buffers)))
            t1 = time.perf_counter()
            self.version = self.group.broadcast_state(self.version)
        t2 = time.perf_counter()
        self.sync_s += t2 - t0
        self.metrics.emit(event="sync", group=self.group.group_id, version=self.version, samples=samples,
                          allreduce_s=allreduce_s, push_s=t1 - t0, broadcast_s=t2 - t1)

    # --- state ----------------------------------------------------------------------------------
    def fill_state(self, state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
        """Put the PS's newest parameters and buffers (each shard's newest; shards may differ by the
        pushes in flight) into ``state``, a copy of the model's state dict; nothing after finish()."""
        if self._finished:
            return
        from . import ps

        _, flat, buffers = self._assemble(self._call_shards(ps._state, "state", lambda s: ()))
        flatten_.fill(state, model.named_parameters(remove_duplicate=False), self.group.params, flat)
        if buffers is not None:
            flatten_.fill(state, model.named_buffers(remove_duplicate=False), self.group.buffers, buffers)

    # --- end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every group is done, then hold the PS's final parameters."""
        from . import ps
        from .groups import rpc_name

        if self.is_leader:
            self._collect()          # the last push's answer: the final parameters come from finish
        if self._pool is not None:
            self._pool.shutdown()
        while True:
            # On the group's device: an NCCL group takes CUDA tensors only.
            flag = torch.zeros(1, device=self.group.device)
            if self.is_leader:
                answers = [self._wait(fut, "finish") for fut in [
                    _rpc_async(rpc_name(r), ps._finish, (self.group.group_id, FINISH_POLL_S), self.timeout_s)
                    for r in self.ps_ranks]]
                if all(done for done, *_ in answers):
                    flag[0] = 1
                    self._load_answers([(v, flat, bufs) for _, v, flat, bufs in answers])
            self.group.broadcast_flag(flag)
            if flag[0]:
                self.version = self.group.broadcast_state(self.version)
                self._finished = True
                return

    # --- helpers --------------------------------------------------------------------------------
    def _spec(self, shard: int) -> optim.OptimizerSpec:
        module, qualname = self._opt_class
        return optim.shard_spec(self.opt, module, qualname, self._groups, self._shard_index(shard))

    def _push_request(self, grad: torch.Tensor, samples: float,
                      buffers: torch.Tensor | None) -> Callable[[int], tuple[Any, ...]]:
        """The arguments of a push to each shard, taken now on the training thread: the gradient in
        the wire format, the optimizer's hyperparameters, the buffers (to shard 0), the data
        position and, under overlap, the version of each shard's parameters the gradient was
        computed on."""
        hyper = optim.push_hyperparameters(self.opt, self._seeded)
        bufs = buffers.float().cpu() if buffers is not None else None
        pos = self.data_position() if self.data_position else None
        wire = self._to_wire(grad.float())
        bases = list(self._shard_versions) if self.overlap else None
        gid = self.group.group_id
        return lambda s: (gid, self._shard_flat(wire, s), samples, hyper, bufs if s == 0 else None,
                          pos, *((bases[s],) if bases is not None else ()))

    def _predict(self) -> None:
        """Under overlap (leader, after loading an answer): the group's next gradient is computed
        now but applied only after the group's own push in flight and what lands meanwhile, about
        the updates between two of its answers. Evaluating it at answer + (answer - previous answer)
        instead of at the answer (weight prediction, as pipelined training does) puts it about where
        the PS will apply it. The PS's parameters are untouched and the next answer replaces the
        prediction, so nothing accumulates; ``finish()`` loads the PS's final parameters exactly."""
        answer = self._flat_params().float()               # a copy
        previous, self._last_answer = self._last_answer, answer
        if previous is not None:
            flatten_.load(self.group.params, 2 * answer - previous)

    def _to_wire(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self._feedback is None else self._feedback.round(grad)

    def _collect(self) -> list[ShardAnswer] | None:
        """Under overlap: wait for the exchange in flight and return its answers (None if none)."""
        fut, self._in_flight = self._in_flight, None
        return None if fut is None else fut.result()

    def _send(self, push: Callable[[int], tuple[Any, ...]] | None) -> list[ShardAnswer]:
        """Push (``push``: the arguments per shard; None: just start) to every shard; shard 0's
        answer may be held back by the staleness rule and carries its parameters and the PS's
        buffers; then the other shards' parameters are pulled."""
        from . import ps

        gid = self.group.group_id
        if push is not None:
            answers = self._call_shards(ps._push, "push", push)
        else:
            answers = self._call_shards(ps._pull, "pull", lambda s: (gid,), shards=[0])
        if len(self.ps_ranks) > 1:
            rest = self._call_shards(ps._pull, "pull", lambda s: (gid,), shards=range(1, len(self.ps_ranks)))
            answers = [answers[0], *rest]
        return answers

    def _call_shards(self, fn: Any, what: str, args: Callable[[int], tuple[Any, ...]],
                     shards: Iterable[int] | None = None) -> list[Any]:
        from .groups import rpc_name

        shards = range(len(self.ps_ranks)) if shards is None else shards
        futs = [_rpc_async(rpc_name(self.ps_ranks[s]), fn, args(s), self.timeout_s) for s in shards]
        return [self._wait(f, what) for f in futs]

    def _wait(self, fut: Any, what: str) -> Any:
        try:
            return fut.wait()
        except Exception as exc:  # RPC errors arrive as RuntimeError or the PS's own exception
            raise TrainingError(f"rank {self.group.rank} (group {self.group.group_id}): {what} to the "
                                f"parameter server failed: "
                                f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc

    def _flat_params(self) -> torch.Tensor:
        return flatten_.flatten(self.group.params, self.group.device)

    def _flat_buffers(self) -> torch.Tensor:
        return flatten_.flatten(self.group.buffers, self.group.device)

    def _shard_index(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self._owner) if s == shard]

    def _shard_flat(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        o = self._offsets
        return torch.cat([flat[o[i]: o[i + 1]] for i in self._shard_index(shard)]).cpu()

    def _shard_shapes(self, shard: int) -> list[tuple[int, ...]]:
        return [tuple(self.group.params[i].shape) for i in self._shard_index(shard)]

    def _assemble(self, answers: Sequence[ShardAnswer]) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The shards' answers as (newest version, the full parameter vector, the PS's buffers)."""
        flat = torch.empty(self._numel)
        o = self._offsets
        for shard, (_, shard_flat, _) in enumerate(answers):
            assert shard_flat is not None
            pos = 0
            for i in self._shard_index(shard):
                n = o[i + 1] - o[i]
                flat[o[i]: o[i + 1]] = shard_flat[pos: pos + n]
                pos += n
        return max(v for v, _, _ in answers), flat, answers[0][2]

    def _load_answers(self, answers: Sequence[ShardAnswer]) -> None:
        self._shard_versions = [v for v, _, _ in answers]
        self.version, flat, buffers = self._assemble(answers)
        flatten_.load(self.group.params, flat.to(self.group.device))
        if buffers is not None and self.group.buffers:
            flatten_.load(self.group.buffers, buffers.to(self.group.device))


def _rpc_async(to: str, fn: Any, args: tuple[Any, ...], timeout_s: float) -> Any:
    from torch.distributed import rpc

    return rpc.rpc_async(to, fn, args=args, timeout=timeout_s)
