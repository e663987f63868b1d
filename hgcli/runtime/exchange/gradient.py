"""A group's exchange with the parameter servers (hybrid and ps plans), beside its group engine.

The group engine (group/engine.py) hands the exchange each completed step's aggregated gradient; the group
leader pushes it to the PS shards and loads their answer, and the group hears the fresh parameters
in one broadcast the engine makes. What the engine offers the exchange is :class:`GroupState`
(group_link.GroupLink).

With ``overlap`` (Plan.overlap) the leader's exchange runs on a thread of its own while the group
computes its next step on the parameters it has: at each push it first waits for the answer to its
previous push, starts the new push (its gradient was computed on the answer before, whose per-shard
versions go with it as the base the PS counts staleness from) and hands the group the answer it
waited for. With ``wire`` "bf16" pushes and pulls travel as bf16; what rounding takes off a push is
added to the next one (error feedback, exchange/staging.py), so no part of a gradient is lost for good.

The parameters are one flat vector cut into contiguous shard ranges (ps/shards.py). The leader copies
its gradients into a reused push buffer and receives answers into a reused answer buffer
(exchange/staging.py); each shard's part travels over the pair's channel with torch.distributed send/recv
(ps/transfer.py), and RPC carries what each message is (push, pull, finish) and the small things
beside it: samples, hyperparameters, buffers, data position, versions.

Parameters reach the PS as fp32 whatever the model's dtype: its master copy and optimizer state are
fp32 (a bf16 model trains on the PS's fp32 values rounded into its bf16 parameters at each answer).
"""
from __future__ import annotations

import time
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from .. import flat as flatten_
from ..ps import optim, transfer
from ..errors import TrainingError
from ..metrics import MetricsSink
from ..adapt.rebalance import GroupSplit
from ..ps.shards import ELEMENTWISE, ShardLayout, plan_layout
from .calls import ShardCalls, rpc_async
from ...schema.records import SyncRecord
from .staging import Staging
from ...schema.stages import Wire

FINISH_POLL_S = 5.0     # how long a leader's "finished?" call waits on the PS before asking again

# What a PS shard answers over RPC: (version, True when its parameters follow over the channel (None
# for an acknowledgement), the buffers (shard 0, when the model has synchronised buffers) or None,
# the groups' shares of the global batch by data step (shard 0 under --adapt, adapt/shares.py) or None).
ShardAnswer = tuple[int, "bool | None", "torch.Tensor | None", "list[tuple[int, tuple[int, ...]]] | None"]
SHARES_SENT = 4         # the newest schedule entries a leader's broadcast carries to its members
Collective = Callable[[Callable[[], Any], str], Any]


class GroupState(Protocol):
    """What the exchange needs of its group engine."""
    rank: int
    group_id: int
    ranks: tuple[int, ...]
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

    def broadcast_state(self, version: int, words: Sequence[int] = ()) -> tuple[int, list[int]]:
        """The leader's parameters, synchronised buffers, ``version`` and ``words`` (small integers)
        to the whole group; returns the version and words every member now holds."""
        ...

    def broadcast_flag(self, flag: torch.Tensor) -> None:
        """The leader's ``flag`` to the whole group (a no-op in a group of one)."""
        ...


class PSExchange:
    """Push, pull, seed and finish of one group with the PS shards ``ps_ranks``. Every member holds
    one (the members' part is to hear the leader's broadcasts at the same points); only the leader
    talks to the PS."""

    def __init__(self, *, group: GroupState, optimizer: torch.optim.Optimizer, ps_ranks: tuple[int, ...],
                 first_worker: int, metrics: MetricsSink, timeout_s: float, overlap: bool = False,
                 wire: Wire = Wire.FP32, data_position: Callable[[], dict[str, int] | None] | None = None,
                 frozen: Sequence[torch.Tensor] = (), split: GroupSplit | None = None) -> None:
        """``split``: the group's batches by data step, whose shares across groups follow shard 0's
        schedule (adapt/shares.py; None: the plan's shares)."""
        self.group = group
        self.opt = optimizer
        self.ps_ranks = ps_ranks
        self.first_worker = first_worker
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._calls = ShardCalls(rank=group.rank, group_id=group.group_id, ps_ranks=ps_ranks, timeout_s=timeout_s)
        self.overlap = overlap
        self.wire_dtype = torch.bfloat16 if Wire(wire) is Wire.BF16 else torch.float32   # Wire() checks it
        self.data_position = data_position
        self.split = split if split is not None and len(split.planned_totals) > 1 else None
        self.version = 0
        self._idle_since = time.perf_counter()            # the end of the last exchange (the pace)
        self.sync_s = 0.0
        params = group.params
        # Checked on every worker at wrap time, before anything reaches the PS: each rank fails with
        # the reason, not only the first worker whose seed the PS would refuse.
        try:
            self._opt_class = optim.class_path(type(optimizer))
            groups = optim.group_indices(optimizer, list(params), list(frozen))
            group_of = [-1] * len(params)
            for g, idx in enumerate(groups):
                for i in idx:
                    group_of[i] = g
            self.layout: ShardLayout = plan_layout([tuple(p.shape) for p in params], group_of, len(ps_ranks),
                                                   elementwise=type(optimizer) in ELEMENTWISE)
            for s in range(len(ps_ranks)):
                optim.build_optimizer(_probe(self.layout, s), self._spec(s))
        except TrainingError as exc:
            raise TrainingError(f"rank {group.rank}: hybrid training: {exc}") from exc
        self._seeded = [optim.group_options(g, optimizer.defaults) for g in optimizer.param_groups]
        self._shard_versions: list[int] = [0] * len(ps_ranks)
        self._staging: Staging | None = None              # the leader's buffers, made at start
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hgtrain-exchange") if overlap else None
        self._in_flight: "ThreadFuture[list[ShardAnswer]] | None" = None
        self._pushed = False                              # under overlap: every later push hands over an answer
        self._last_answer: torch.Tensor | None = None     # the leader's previous answer (overlap)
        self._finished = False

    @property
    def is_leader(self) -> bool:
        return self.group.rank == self.group.leader

    # --- start ----------------------------------------------------------------------------------
    def start(self) -> None:
        """The leader of the first worker's group seeds the PS with its parameters; every leader pulls
        them, and its group hears them."""
        from ..ps import handlers

        if not self.is_leader:
            self._broadcast()
            self._idle_since = time.perf_counter()
            return
        staging = self._staging = Staging(self.layout, self.group.params, self.wire_dtype, self.group.device)
        if self.first_worker in self.group.ranks:
            flat = staging.seed(self.group.params)
            held = self._flat_buffers()
            bufs = held.float().cpu() if held.numel() else None
            sends = [w for s in range(len(self.ps_ranks)) for w in self._send_part(flat, s)]
            self._calls.call(handlers.seed, "seed", lambda s: (
                self.group.group_id, [seg.to_wire() for seg in self.layout.segments[s]], self._spec(s),
                bufs if s == 0 else None))
            self._calls.wait_works(sends, "seed")
            staging.seeded(flat)
        self._load_answers(self._send(None))
        self._broadcast()
        self._idle_since = time.perf_counter()

    # --- a step ---------------------------------------------------------------------------------
    def step(self, grads: Sequence[torch.Tensor] | None, samples: float, buffers: torch.Tensor | None, *,
             allreduce_s: float = 0.0) -> None:
        """The group's aggregated gradient of a completed step (``grads``: the leader's, the weighted
        mean, one tensor per parameter; None on the other members) goes to the PS, and the group takes
        its answer. ``allreduce_s``: what the group's all-reduce cost the step (the engine's), for its
        metrics."""
        t0 = time.perf_counter()
        busy_s, self._idle_since = t0 - self._idle_since, t0
        if self.overlap:
            if self.is_leader:
                assert grads is not None
                # The previous push's answer, then this step's gradient (computed on the parameters
                # held) into the push buffer, which that exchange has sent; the answer is loaded
                # before the next exchange may receive into the answer buffer.
                answers = self._collect()
                push = self._push_request(grads, samples, buffers, busy_s)
                if answers is not None:
                    self._load_answers(answers)
                    self._predict()
                assert self._pool is not None
                self._in_flight = self._pool.submit(self._send, push)
            t1 = time.perf_counter()
            if self._pushed:        # every member knows: the first push has no answer to hand over
                self._broadcast()
            self._pushed = True
        else:
            if self.is_leader:
                assert grads is not None
                self._load_answers(self._send(self._push_request(grads, samples, buffers, busy_s)))
            t1 = time.perf_counter()
            self._broadcast()
        t2 = time.perf_counter()
        self._idle_since = t2
        self.sync_s += t2 - t0
        self.metrics.record(SyncRecord(group=self.group.group_id, version=self.version, samples=samples,
                                       allreduce_s=allreduce_s, push_s=t1 - t0, broadcast_s=t2 - t1))

    # --- state ----------------------------------------------------------------------------------
    def fill_state(self, state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
        """Put the PS's newest parameters and buffers (each shard's newest; shards may differ by the
        pushes in flight) into ``state``, a copy of the model's state dict; nothing after finish().
        Over RPC (a script's own checkpoints, on any rank), not the leader's channel."""
        if self._finished:
            return
        from ..ps import handlers

        answers = self._calls.call(handlers.state, "state", lambda s: ())
        flat = torch.cat([part for _, part, _ in answers])         # the shards' ranges, in order
        ordered = [self.group.params[i] for i in self.layout.order]   # the flat vector's order
        flatten_.fill(state, model.named_parameters(remove_duplicate=False), ordered, flat)
        buffers = answers[0][2]
        if buffers is not None:
            flatten_.fill(state, model.named_buffers(remove_duplicate=False), self.group.buffers, buffers)

    # --- end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every group is done, then hold the PS's final parameters."""
        from ..ps import handlers
        from ..groups import rpc_name

        if self.is_leader:
            self._collect()          # the last push's answer: the final parameters come from finish
        if self._pool is not None:
            self._pool.shutdown()
        while True:
            # On the group's device: an NCCL group takes CUDA tensors only.
            flag = torch.zeros(1, device=self.group.device)
            if self.is_leader:
                answers = [self._calls.wait(fut, "finish") for fut in [
                    rpc_async(rpc_name(r), handlers.finish, (self.group.group_id, FINISH_POLL_S), self.timeout_s)
                    for r in self.ps_ranks]]
                if all(done for done, *_ in answers):
                    flag[0] = 1
                    final = [(v, follows, bufs, None) for _, v, follows, bufs in answers]
                    # The fp32 master copy, whatever the wire.
                    assert self._staging is not None
                    master = self._staging.final()
                    self._receive(final, range(len(answers)), into=master)
                    self._load_answers(final, source=master)
            self.group.broadcast_flag(flag)
            if flag[0]:
                self._broadcast()
                self._finished = True
                return

    # --- helpers --------------------------------------------------------------------------------
    def _spec(self, shard: int) -> optim.OptimizerSpec:
        module, qualname = self._opt_class
        return optim.segment_spec(self.opt, module, qualname, [seg.group for seg in self.layout.segments[shard]])

    def _push_request(self, grads: Sequence[torch.Tensor], samples: float, buffers: torch.Tensor | None,
                      busy_s: float) -> Callable[[int], tuple[Any, ...]]:
        """The push buffer filled with this step's gradients (the wire format), and the arguments of
        the push's control message to each shard, taken now on the training thread: the optimizer's
        hyperparameters, the buffers (to shard 0), the data position, under overlap the version
        of each shard's parameters the gradient was computed on, and (to shard 0, when the shares
        across groups can move) the group's pace: ``busy_s``, the step's time outside the exchange."""
        assert self._staging is not None
        self._staging.fill(grads)
        hyper = optim.push_hyperparameters(self.opt, self._seeded)
        bufs = buffers.float().cpu() if buffers is not None else None
        pos = self.data_position() if self.data_position else None
        bases = list(self._shard_versions) if self.overlap else None
        pace = self._pace(busy_s, samples, pos)
        gid = self.group.group_id
        return lambda s: (gid, samples, hyper, bufs if s == 0 else None, pos,
                          bases[s] if bases is not None else None, pace if s == 0 else None)

    def _pace(self, busy_s: float, samples: float,
              pos: dict[str, int] | None) -> tuple[float, float, int, int, int] | None:
        """group_shares.Pace: the step's seconds outside the exchange, its samples, the next data step
        the leader's data source yields, the data step training reached and the one from which the
        members' newest re-split applies (None: no split to move)."""
        if self.split is None:
            return None
        reached = int(pos["epoch"]) * int(pos.get("steps_per_epoch") or 0) + int(pos["step"]) if pos else 0
        resplit = self.split.schedule[-1][0] if self.split.schedule else 0
        return (busy_s, float(samples), self.split.next_step, reached, resplit)

    def _broadcast(self) -> None:
        """The leader's parameters, buffers and version to the group, with the newest entries of the
        shares' schedule, which every member's split takes."""
        words: list[int] = []
        split = self.split
        if split is not None:
            width = 1 + len(split.planned_totals)
            entries = split.shares[-SHARES_SENT:]
            words = [len(split.shares)] + [w for start, totals in entries for w in (start, *totals)]
            words += [0] * (1 + SHARES_SENT * width - len(words))
        self.version, heard = self.group.broadcast_state(self.version, words)
        if split is not None and not self.is_leader and heard[0] > len(split.shares):
            count, width = heard[0], 1 + len(split.planned_totals)
            entries = [(heard[1 + k * width], tuple(heard[2 + k * width: 1 + (k + 1) * width]))
                       for k in range(min(count, SHARES_SENT))]
            # (More new entries than a broadcast carries cannot happen: shard 0 decides at most one per
            # two checks, and every group hears an answer per push.)
            for start, totals in entries[max(0, len(entries) - (count - len(split.shares))):]:
                split.share(start, totals)

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

    def _collect(self) -> list[ShardAnswer] | None:
        """Under overlap: wait for the exchange in flight and return its answers (None if none)."""
        fut, self._in_flight = self._in_flight, None
        return None if fut is None else fut.result()

    def _send(self, push: Callable[[int], tuple[Any, ...]] | None) -> list[ShardAnswer]:
        """Push (``push``: the control arguments per shard; None: just start) to every shard, the
        push buffer's parts over the channels; shard 0's answer may be held back by the staleness
        rule and carries the PS's buffers; then the other shards' parameters are pulled. Every
        answer's parameters are received into the answer buffer."""
        from ..ps import handlers

        assert self._staging is not None
        gid, shards = self.group.group_id, len(self.ps_ranks)
        sends: list[Any] = []
        if push is not None:
            self._staging.push_ready()
            sends = [w for s in range(shards) for w in self._send_part(self._staging.push, s)]
            answers = self._calls.call(handlers.push, "push", push)
        else:
            answers = self._calls.call(handlers.pull, "pull", lambda s: (gid,), shards=[0])
        self._staging.answer_free()
        self._receive(answers, [0])
        if shards > 1:
            rest = self._calls.call(handlers.pull, "pull", lambda s: (gid,), shards=range(1, shards))
            self._receive(rest, range(1, shards), offset=1)
            answers = [answers[0], *rest]
        self._calls.wait_works(sends, "push")
        return answers

    def _send_part(self, flat: torch.Tensor, shard: int) -> list[Any]:
        from ..groups import channel

        lo, hi = self.layout.span(shard)
        return transfer.send(flat[lo:hi], self.ps_ranks[shard], channel(self.group.group_id, shard))

    def _receive(self, answers: Sequence[ShardAnswer], shards: Iterable[int], offset: int = 0,
                 into: torch.Tensor | None = None) -> None:
        """The parameters that follow the answers of ``shards`` (``answers[k - offset]``: shard k's),
        into the answer buffer (or ``into``)."""
        from ..groups import channel

        assert self._staging is not None
        dst = self._staging.answer if into is None else into
        works = []
        for s in shards:
            if answers[s - offset][1]:
                lo, hi = self.layout.span(s)
                works += transfer.irecv(dst[lo:hi], self.ps_ranks[s],
                                        channel(self.group.group_id, s))
        self._calls.wait_works(works, "answer")

    def _flat_params(self) -> torch.Tensor:
        return flatten_.flatten(self.group.params, self.group.device)

    def _flat_buffers(self) -> torch.Tensor:
        return flatten_.flatten(self.group.buffers, self.group.device)

    def _load_answers(self, answers: Sequence[ShardAnswer], source: torch.Tensor | None = None) -> None:
        """The answer buffer (or ``source``), every shard's parameters received, into the group's
        parameters."""
        assert self._staging is not None
        self._shard_versions = [v for v, _, _, _ in answers]
        self.version = max(self._shard_versions)
        shares = answers[0][3]
        if self.split is not None and shares:
            for start, totals in shares[len(self.split.shares):]:
                self.split.share(int(start), totals)
        self._staging.load(source)
        buffers = answers[0][2]
        if buffers is not None and self.group.buffers:
            flatten_.load(self.group.buffers, buffers.to(self.group.device))


def _probe(layout: ShardLayout, shard: int) -> list[torch.Tensor]:
    """Stand-ins of a shard's tensors (one element each, the segments' ranks), to try its optimizer."""
    return [torch.zeros([1] * len(seg.shape)) if seg.shape is not None else torch.zeros(1)
            for seg in layout.segments[shard]]
