"""The parameter-server rank: ``python -m hgcli.runtime.ps [options]`` with the rank environment.

Each PS rank holds one shard of the parameters, a contiguous range of the model's flat parameter
vector (shards.py), and the optimizer state for it. Group leaders send it control messages over torch
RPC and the bulk data (gradients in, parameters out) over a process group of the pair (ps_io.py,
transfer.py): ``push`` applies a group's gradient at once and answers with fresh parameters when the
staleness rule allows (see docs/runtime-reference.md):

* staleness of a push = shard version now - version the group last received; the pushed gradient
  is scaled by samples / global_batch / max(1, delay) before the optimizer step, where delay =
  shard version now - version of the group's newest answer (the staleness without overlap): every sample
  weighs the same whichever group computed it (as in one synchronous step over the global batch,
  and momentum integrates the weighted gradients), and stale updates weigh less;
* bounded staleness: every push is applied at most S (plan.staleness_bound, >= groups - 1) versions
  after the version its gradient was computed on. Shard 0 (the coordinator; every push reaches it)
  holds a group's answer back only when letting it compute again could make a group that is still
  computing exceed S: it answers group g when, for every computing group h,
  (version - base[h]) + (number of computing groups, g included, other than h) <= S. A push moves
  its group from computing to waiting, so the left side never grows without a check; when every
  group waits, the one with the oldest base is answered: no deadlock. A fast group may thus push
  up to S - groups + 2 times per push of the slowest one before it waits.
* with overlap (plan.overlap, S >= groups), a group computes its next gradient while its push is in
  flight, on the answer before; the leader sends that base with the push and the staleness counts
  from it; the damping does not (the versions up to its newest answer, its own push included, are
  a fixed one-step pipeline delay: ``_damping_delay``). A group then always has a gradient pending,
  and the rule (``_may_answer_overlapped``)
  counts for each pending gradient, and each answered group's next one, every push that may still
  come before it; when no group is answered, the held group with the oldest base is (which moves
  nobody else's count): no deadlock.
* wire format (plan.wire): answers carry the parameters as bf16 under "bf16"; pushes may arrive as
  bf16 and are widened: parameters and optimizer state stay fp32 here.
Other shards apply pushes and answer at once (an acknowledgement; the leader pulls their parameters
after shard 0 answers), so one shard alone decides who waits and shards cannot deadlock each other.

The optimizer is the worker's class with its parameter groups (optim.py), built with torch's fused
(or foreach) implementation where the class has one, over one tensor per parameter group of the
range for elementwise optimizers; its intra-op threads are the cores this rank has (``ps_threads``).
Each push carries the groups' current hyperparameters, so the worker's LR schedule drives the PS's
steps. Pushes land in one staging buffer (the optimizer's ``.grad`` views); answers are sent from the
parameters themselves (under the bf16 wire narrowed on the way, through two small buffers), never
rebuilt per answer: a step waits until the answers and snapshots reading them are done (``readers``). Shard 0 also
keeps the model's floating-point buffers (BatchNorm statistics), which its answers return: a push
moves them by the change the group's own steps made to the buffers it was last answered, weighted
by the group's share of the global batch per step (docs/runtime-reference.md).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.distributed import rpc
from torch.futures import Future

from . import checkpoint, optim
from .env import RankEnv
from .shards import Segment, segment_views
from ..schema.stages import Wire
from .errors import TrainingError
from .groups import init_distributed, rpc_name, shutdown
from .metrics import MetricsSink

_SERVER: "ShardServer | None" = None
_IO: Any = None          # ps_io.ShardIO of this rank's server
THREADS_ENV = "HGTRAIN_PS_THREADS"

# In an answer's fields: "the shard's parameters in the wire format". How they reach the group is the
# delivery's business (``ShardServer.deliver``): a copy in process, a send over the pair's channel.
PARAMS = object()
MASTER = object()        # ... the fp32 master copy itself, whatever the wire (the final parameters)
Delivery = Callable[[int, Future, tuple[Any, ...]], None]


class ShardServer:
    def __init__(self, *, shard: int, ps_ranks: Sequence[int], group_ids: Sequence[int],
                 staleness_bound: int, global_batch: int, timeout_s: float, metrics: MetricsSink,
                 checkpoint_dir: Path | None = None, checkpoint_every: int = 0,
                 checkpoint_seconds: float = 0.0, trace: Path | None = None,
                 accumulate: Mapping[int, int] | None = None, overlap: bool = False,
                 wire: Wire = Wire.FP32) -> None:
        self.shard = shard
        self.ps_ranks = list(ps_ranks)
        self.bound = staleness_bound
        self.global_batch = global_batch
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.cv = threading.Condition()
        self.params: list[torch.Tensor] | None = None   # the optimizer's tensors: views of master
        self.master: torch.Tensor | None = None          # this shard's range of the flat parameters, fp32
        self.grad: torch.Tensor | None = None            # the staging buffer of pushes: the params' .grad
        self.segments: tuple[Segment, ...] | None = None
        self.opt_impl = ""
        # Answers being sent and snapshots being copied from master and the optimizer state:
        # a step waits until there are none (self.cv held). Nothing else blocks on them.
        self.readers = 0
        self.staging = threading.Lock()                  # one push at a time in the staging buffer
        self.deliver: Delivery = self._deliver_copy
        self.update_s = 0.0                              # time in optimizer steps (and their scaling)
        self.opt: torch.optim.Optimizer | None = None
        self.opt_spec: dict[str, Any] | None = None
        self.version = 0
        # Shard 0 only, for models with buffers: the shared buffers (what answers carry) and, per
        # group, the buffers of its latest answer (what its pushed buffers moved on from).
        self.buffers: torch.Tensor | None = None
        self.answered_buffers: dict[int, torch.Tensor] = {}
        self.accumulate = {g: (accumulate or {}).get(g, 1) for g in group_ids}
        # Each group's data position after its latest applied push (sent by its leader; see
        # position.py): checkpointed with the parameters, answered to the group after a resume.
        self.data_positions: dict[int, dict[str, int]] = {}
        if len(group_ids) > 1 and staleness_bound < len(group_ids) - 1:
            raise TrainingError(f"plan staleness_bound {staleness_bound} is below groups - 1 = "
                                f"{len(group_ids) - 1}: no schedule of the groups could respect it")
        # Overlap (docs/runtime-reference.md): a group's next gradient is computed while its push is in flight,
        # so its own push always counts once in its staleness; the rule then needs S >= groups.
        self.overlap = overlap
        if overlap and staleness_bound < len(group_ids):
            raise TrainingError(f"plan staleness_bound {staleness_bound} is below groups = {len(group_ids)}: "
                                f"with overlap a group's own push in flight counts once in the staleness "
                                f"of its next gradient, so no schedule could respect it")
        self.wire_dtype = torch.bfloat16 if Wire(wire) is Wire.BF16 else torch.float32   # Wire() checks it
        # Overlap admission (coordinator): per group, the version its last answer carried and the
        # version its next push's gradient was computed on (one answer older than the last).
        self.released: dict[int, int] = {}
        self.next_base: dict[int, int] = {}
        self.coordinator = shard == 0
        self.clock = {g: 0 for g in group_ids}
        self.base = {g: 0 for g in group_ids}
        self.active = set(group_ids)
        self.computing: set[int] = set()               # answered, gradient not yet pushed
        self.last_seen = {g: time.monotonic() for g in group_ids}
        self.waiting: dict[int, Future] = {}          # group -> answer held back (coordinator)
        self.unseeded: list[tuple[int, Future]] = []  # pulls that arrived before the seed
        self.finishing: list[tuple[int, Future]] = []
        self.failure: str | None = None
        self.all_done = threading.Event()
        self.ckpt_dir = checkpoint_dir
        self.ckpt_every = checkpoint_every
        self.ckpt_seconds = checkpoint_seconds
        # The clock of --checkpoint-seconds starts with training (the first seed), not with the process:
        # startup and rendezvous are no work to lose, and a restarted job must not spend its first
        # interval on them before its first checkpoint.
        self.ckpt_last: float | None = None
        self.ckpt_scheduled: set[int] = set()
        self.writes: "queue.Queue[tuple[int, dict[str, Any]] | None]" = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, daemon=True)
        self.writer.start()
        self.trace_fh = open(trace, "a", encoding="utf-8") if trace else None
        self._trace("start", pid=os.getpid(), threads=torch.get_num_threads(), rss_kb=memory_kb("VmRSS"))

    # --- events ------------------------------------------------------------------------------
    def _trace(self, event: str, **fields: Any) -> None:
        if self.trace_fh:
            self.trace_fh.write(json.dumps({"event": event, "shard": self.shard,
                                            "t": time.time(), **fields}) + "\n")
            self.trace_fh.flush()

    # --- RPC handlers (called on RPC threads) -----------------------------------------------
    def seed(self, group: int, flat: torch.Tensor, segments: Sequence[Segment],
             opt_spec: dict[str, Any], buffers: torch.Tensor | None = None) -> int:
        """The first parameters (``flat``: this shard's range, fp32, owned by the shard from now on)
        cut into ``segments`` for the optimizer ``opt_spec``."""
        segments = tuple(segments)
        if flat.numel() != sum(s.length for s in segments):
            raise TrainingError(f"PS shard {self.shard}: the seed carries {flat.numel()} values for segments "
                                f"of {sum(s.length for s in segments)}")
        with self.cv:
            self.last_seen[group] = time.monotonic()
            if self.ckpt_last is None:
                self.ckpt_last = time.monotonic()
            if self.params is None:
                self._install(flat, segments, opt_spec)
                self.buffers = buffers
                self._trace("seed", version=self.version, numel=flat.numel(), impl=self.opt_impl)
            else:
                self._check_resumed(segments, opt_spec, buffers)
            for g, fut in self.unseeded:
                self._request(g, fut)
            self.unseeded.clear()
            return self.version

    def _install(self, master: torch.Tensor, segments: tuple[Segment, ...], opt_spec: dict[str, Any]) -> None:
        """Hold ``master`` and build the optimizer over its segments (refused before anything is held)."""
        master = master.float().contiguous().reshape(-1)
        params = segment_views(master, segments)
        opt, impl = optim.build_fast_optimizer(params, opt_spec)
        grad = torch.zeros_like(master)
        for p, g in zip(params, segment_views(grad, segments)):
            p.grad = g
        self.master, self.grad, self.params, self.segments = master, grad, params, segments
        self.opt, self.opt_spec, self.opt_impl = opt, opt_spec, impl

    def _check_resumed(self, segments: tuple[Segment, ...], opt_spec: dict[str, Any],
                       buffers: torch.Tensor | None) -> None:
        """A seed after a resume: the checkpoint's values win, but the job must be the same model and
        optimizer. Its hyperparameters become the baseline pushes are relative to (optim.py)."""
        assert self.params is not None and self.opt_spec is not None
        if self.segments != segments:
            raise TrainingError(f"PS shard {self.shard}: the model (or its cut into {len(self.ps_ranks)} shards) "
                                f"does not match the checkpointed parameters")
        old = optim.normalise_spec(self.opt_spec, len(self.params))
        new = optim.normalise_spec(opt_spec, len(self.params))
        if not optim.same_structure(old, new):
            raise TrainingError(f"PS shard {self.shard}: the optimizer ({new['module']}.{new['qualname']}, "
                                f"{len(new['groups'])} parameter groups) does not match the checkpointed "
                                f"one ({old['module']}.{old['qualname']}, {len(old['groups'])} groups)")
        self.opt_spec = opt_spec
        if buffers is not None and (self.buffers is None or self.buffers.numel() != buffers.numel()):
            self.buffers = buffers        # a checkpoint without (these) buffers: start from the seed's
            self.answered_buffers = {}

    def pull(self, group: int) -> Future:
        """Parameters for a group (at its start; after shard 0 answered its push, on other shards)."""
        fut: Future = Future()
        with self.cv:
            self.last_seen[group] = time.monotonic()
            if self.ckpt_last is None:
                self.ckpt_last = time.monotonic()
            if self.params is None:
                self.unseeded.append((group, fut))
            else:
                self._request(group, fut)
        return fut

    def push(self, group: int, grad: torch.Tensor, samples: float, hyper: optim.Hyperparameters,
             buffers: torch.Tensor | None = None, data_position: dict[str, int] | None = None,
             base: int | None = None) -> Future:
        """``hyper``: per parameter group, the values the worker's optimizer has now (its LR schedule);
        ``buffers`` (shard 0, models with buffers): the group's, averaged over its members;
        ``data_position``: the group's position in its data after this push; ``base``: the version
        of this shard's parameters the gradient was computed on (sent under overlap, where it is
        older than the group's last answer); ``grad`` may arrive in the plan's wire format."""
        fut: Future = Future()
        schedule = None
        with self.cv:
            if self.params is None or self.opt is None or self.opt_spec is None or self.grad is None:
                raise TrainingError(f"PS shard {self.shard}: push from group {group} before the seed")
            if grad.numel() != self.grad.numel():
                raise TrainingError(f"PS shard {self.shard}: group {group} pushed {grad.numel()} values to a "
                                    f"shard of {self.grad.numel()}")
            while self.readers:          # answers in flight and snapshots read what this step changes
                self.cv.wait()
            self.last_seen[group] = time.monotonic()
            if self.overlap and self.coordinator:
                # The admission rule keeps its own record of the gradient's base: the leader's must agree.
                expected = self.next_base.get(group, self.base[group])
                if base is not None and base != expected:
                    raise TrainingError(f"PS shard 0: group {group} pushed a gradient computed on version "
                                        f"{base}; the admission rule expected {expected}")
                self.base[group] = expected
            elif base is not None:
                self.base[group] = base
            staleness = self.version - self.base[group]
            delay = self._damping_delay(group)
            scale = (samples / self.global_batch if self.global_batch else 1.0) / max(1, delay)
            t0 = time.perf_counter()
            if grad is not self.grad:    # in process; over the channel the push arrived in place
                self.grad.copy_(grad)    # widened: fp32 master copy and optimizer state, whatever the wire
            if scale != 1.0:
                self.grad.mul_(scale)
            optim.apply_hyperparameters(self.opt, optim.normalise_spec(self.opt_spec, len(self.params))["groups"],
                                        hyper)
            self.opt.step()
            update_s = time.perf_counter() - t0
            self.update_s += update_s
            if buffers is not None:
                self._move_buffers(group, buffers, samples)
            self.version += 1
            self.clock[group] += 1
            if data_position is not None:
                self.data_positions[group] = dict(data_position)
            self._trace("push", group=group, clock=self.clock[group], base=self.base[group],
                        version=self.version, staleness=staleness, delay=delay, samples=samples, scale=scale,
                        clocks=dict(self.clock), active=sorted(self.active),
                        lr=[h.get("lr") for h in hyper], update_s=update_s)
            self.metrics.emit(event="ps_push", shard=self.shard, group=group, version=self.version,
                              staleness=staleness, delay=delay, scale=scale, update_s=update_s)
            self.computing.discard(group)
            if self.overlap and group in self.released:
                # Its next gradient is being computed on the parameters of its last answer.
                self.next_base[group] = self.released[group]
            if self.coordinator:
                self._request(group, fut)
            else:
                self.deliver(group, fut, (self.version, None, None))
            schedule = self._checkpoint_due()
        if schedule is not None:
            self._schedule_everywhere(schedule)
        return fut

    def finish(self, group: int, wait_s: float) -> Future:
        """A group is done; answers (done?, version, params, buffers) once all are, or after ``wait_s``."""
        fut: Future = Future()
        with self.cv:
            self.last_seen[group] = time.monotonic()
            if group in self.active:
                self.active.discard(group)
                self.computing.discard(group)
                self._trace("done", group=group, clock=self.clock[group])
                self._release()
            if not self.active:
                self.all_done.set()
                self.deliver(group, fut, (True, self.version, MASTER, self._buffers_copy()))
            else:
                self.finishing.append((group, fut))
                threading.Timer(wait_s, self._finish_timeout, args=(group, fut)).start()
        return fut

    def state(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The current parameters and buffers, at once (``ctx.state_dict()``; no effect on scheduling)."""
        with self.cv:
            if self.params is None:
                raise TrainingError(f"PS shard {self.shard}: asked for its state before the seed")
            assert self.master is not None
            return self.version, self.master.clone(), self._buffers_copy()

    def data_position(self, group: int) -> dict[str, int] | None:
        with self.cv:
            return self.data_positions.get(group)

    def schedule_checkpoint(self, version: int) -> None:
        with self.cv:
            if version > self.version:
                self.ckpt_scheduled.add(version)

    # --- internals (self.cv held) ------------------------------------------------------------
    def _finish_timeout(self, group: int, fut: Future) -> None:
        with self.cv:
            if (group, fut) in self.finishing:
                self.finishing.remove((group, fut))
                self.deliver(group, fut, (False, self.version, None, None))

    def _damping_delay(self, group: int) -> int:
        """The staleness a push is damped by: versions since the group's newest answer. Without
        overlap that is its staleness (the gradient was computed on that answer). Under overlap the
        gradient is one answer older: the versions between that answer and the newest (the group's
        own previous push, and what landed before it was answered) are a fixed one-step pipeline
        delay, present on every push whatever the other groups do (as in delayed SGD), not
        asynchrony between the groups. Damping them too divided every push by the pipeline's
        depth as well, so the same samples made far less progress (benchmarks/hybrid_links.py). Only what
        came after the newest answer counts, the same count as without overlap; the bound still
        counts the full staleness from the older base."""
        return self.version - self.released.get(group, self.base[group])

    def _request(self, group: int, fut: Future) -> None:
        if self.coordinator:
            self.waiting[group] = fut
            self._release()
        else:
            self._answer(group, fut)

    def _may_answer(self, group: int) -> bool:
        if self.overlap:
            return self._may_answer_overlapped(group)
        n = len(self.computing)         # computing groups once ``group`` joins them, minus one
        return all(self.version - self.base[h] + n <= self.bound
                   for h in self.computing if h != group)

    def _may_answer_overlapped(self, group: int) -> bool:
        """The overlap rule (docs/runtime-reference.md): with ``group`` answered, every pending gradient, and
        the next gradient of every free group, must be pushed within the bound even if everything
        that may come before it does. A group is *free* once answered (it may push once without
        asking), else *held* (its next push needs an answer); once answered a first time it always
        has a gradient pending, the one it computes while its push is in flight. Before the pending
        gradient of h (base b, key (b, h)) may come: one push of each other free group, and a
        second one of those whose next base is older than b (held, they are answered first), and
        one push of each held group answered before h (base older than b)."""
        v, free = self.version, set(self.computing) | {group}
        held = {h: self.next_base[h] for h in self.waiting if h != group and h in self.next_base}
        released = {**self.released, group: v}
        pending = {**{h: self.next_base.get(h, v) for h in free}, **held}

        def ahead(key: tuple[int, int], h: int) -> int:
            return (sum(1 + ((released[x], x) < key) for x in free if x != h)
                    + sum((b, x) < key for x, b in held.items() if x != h))

        if any(v - b + ahead((b, h), h) > self.bound for h, b in pending.items()):
            return False
        # A free group's gradient after its pending one is computed on its last answer (+1: its own push).
        return all(v + 1 - released[h] + ahead((released[h], h), h) <= self.bound for h in free)

    def _release(self) -> None:
        progress = True
        while progress and self.waiting:
            progress = False
            for g in sorted(self.waiting, key=self._admission_order):   # oldest base first
                if not self.computing or self._may_answer(g):
                    fut = self.waiting.pop(g)
                    self._trace("release", group=g, version=self.version,
                                computing=sorted(self.computing),
                                bases={str(h): self.base[h] for h in self.computing})
                    self._answer(g, fut)
                    progress = True
                    break
        if not self.active:
            self.all_done.set()
            for g, fut in self.finishing:
                self.deliver(g, fut, (True, self.version, MASTER, self._buffers_copy()))
            self.finishing.clear()

    def _admission_order(self, group: int) -> tuple[int, int]:
        if self.overlap:
            # Held groups by their pending gradient's base (answering the oldest when no group is
            # free moves nobody else's count); groups never answered after them: they have none.
            return (self.next_base.get(group, sys.maxsize), group)
        return (self.base[group], group)

    def _answer(self, group: int, fut: Future) -> None:
        if not self.overlap:
            self.base[group] = self.version
        elif group not in self.next_base:
            # Its first answer (start, resume): its first two gradients are both computed on it.
            self.next_base[group] = self.base[group] = self.version
        self.released[group] = self.version
        if group in self.active:
            self.computing.add(group)
        buffers = self._buffers_copy()
        if buffers is not None:
            self.answered_buffers[group] = buffers
        if self.trace_fh and self.master is not None:   # (a float64 sum: a debugging aid, slow on large models)
            self._trace("answer", group=group, version=self.version,
                        param_sum=float(self.master.to(self.wire_dtype).sum(dtype=torch.float64)))
        self.deliver(group, fut, (self.version, PARAMS, buffers))

    def payload(self, fields: tuple[Any, ...]) -> torch.dtype | None:
        """The type the parameters an answer's fields name travel in (PARAMS: the wire's; MASTER:
        fp32), if they name any. Either way they are sent from the master copy (stable while
        readers > 0), narrowed on the way under the bf16 wire (transfer.send)."""
        if any(f is MASTER for f in fields):
            return torch.float32
        return self.wire_dtype if any(f is PARAMS for f in fields) else None

    def _deliver_copy(self, group: int, fut: Future, fields: tuple[Any, ...]) -> None:
        """In process (tests, tools): the answer with a copy of the parameters."""
        dtype, master = self.payload(fields), self.master
        fut.set_result(tuple(master.to(dtype, copy=True) if (f is PARAMS or f is MASTER) and dtype and master is not None
                             else f for f in fields))

    def _buffers_copy(self) -> torch.Tensor | None:
        # A copy: the answer is serialised later, on an RPC thread, while pushes may replace the average.
        return None if self.buffers is None else self.buffers.clone()

    def _move_buffers(self, group: int, buffers: torch.Tensor, samples: float) -> None:
        """Apply what the group's own steps changed in the buffers it was last answered, weighted by
        its share of the global batch per local step: the shared running statistics then move as
        one synchronous step's would, by the momentum per global batch, whichever group computed it.

        Not an average of the groups' pushed buffers: those are mostly the shared buffers they were
        answered (a group's steps move running statistics by the momentum only), so an average
        keeps echoing whichever group pushes least often, or finished long ago, with the weight of
        one of its pushes, and the statistics lag behind the parameters (benchmarks/RESULTS.md has the
        measurement)."""
        if self.buffers is None:
            self.buffers = buffers          # a seed without buffers: nothing to move from
            return
        base = self.answered_buffers.get(group, self.buffers)
        share = samples / (self.accumulate.get(group, 1) * self.global_batch) if self.global_batch else 1.0
        self.buffers = self.buffers + min(1.0, share) * (buffers - base)

    def _checkpoint_due(self) -> int | None:
        """Snapshot if this version is due; returns a version to schedule on every shard, if any."""
        if self.ckpt_dir is None:
            return None
        v = self.version
        if (self.ckpt_every and v % self.ckpt_every == 0) or v in self.ckpt_scheduled:
            self.ckpt_scheduled.discard(v)
            self.ckpt_last = time.monotonic()
            # The writer copies the state outside the lock; until it has, steps wait (readers).
            self.readers += 1
            self.writes.put((v, {"data_positions": copy.deepcopy(self.data_positions),
                                 "buffers": self._buffers_copy()}))
        if (self.shard == 0 and self.ckpt_seconds and not self.ckpt_scheduled and self.ckpt_last is not None
                and time.monotonic() - self.ckpt_last >= self.ckpt_seconds):
            # Shards may differ by up to one push per group; this version is ahead of all of them.
            target = v + len(self.clock) + 1
            self.ckpt_scheduled.add(target)
            return target
        return None

    def _schedule_everywhere(self, version: int) -> None:
        for r in self.ps_ranks[1:]:
            rpc.rpc_async(rpc_name(r), _schedule_checkpoint, args=(version,))

    def _snapshot(self, taken: dict[str, Any]) -> dict[str, Any]:
        """The state at the version the checkpoint was scheduled on: ``taken`` holds what was copied
        under the lock; master and the optimizer state are copied here, on the writer's thread,
        while the reader it counts keeps steps out."""
        assert self.master is not None and self.opt is not None and self.segments is not None
        state: dict[str, Any] = {"master": self.master.clone(), "segments": [s.to_wire() for s in self.segments],
                                 "opt_spec": self.opt_spec, "optimizer": copy.deepcopy(self.opt.state_dict()),
                                 "data_positions": taken["data_positions"]}
        if taken["buffers"] is not None:
            state["buffers"] = taken["buffers"]
        return state

    def _write_loop(self) -> None:
        while (item := self.writes.get()) is not None:
            version, taken = item
            assert self.ckpt_dir is not None
            try:
                state = self._snapshot(taken)
            finally:
                with self.cv:
                    self.readers -= 1
                    self.cv.notify_all()
            path = checkpoint.save(self.ckpt_dir, self.shard, version, state)
            with self.cv:
                self._trace("checkpoint", version=version, path=str(path))

    def resume(self, version: int | None = None) -> int | None:
        """Load a complete checkpoint set; returns its version, or None when there is none.

        ``version``: the one the launcher chose from every node's files (shards on several nodes
        each keep their own files, so no single directory shows a complete set); without it, the
        newest complete set in this shard's own directory (all shards on one node, ``localrun``)."""
        assert self.ckpt_dir is not None
        checkpoint.remove_temp_files(self.ckpt_dir, self.shard)
        if version is None:
            data = self._newest_readable()
            if data is None:
                self._trace("resume", version=None)
                return None
            version = int(data["version"])
        else:
            try:
                data = checkpoint.load(self.ckpt_dir, self.shard, version)
            except (OSError, ValueError) as exc:
                raise TrainingError(f"PS shard {self.shard}: cannot load checkpoint version {version}: "
                                    f"{exc}") from None
        self._install(data["master"], tuple(Segment.from_wire(s) for s in data["segments"]), data["opt_spec"])
        assert self.opt is not None
        self.opt.load_state_dict(data["optimizer"])
        # Older checkpoints also hold "group_buffers" (each group's last pushed buffers), which the
        # rule no longer needs: groups are answered the buffers again when they pull.
        self.buffers = data.get("buffers")
        self.answered_buffers = {}
        self.version = version
        self.base = {g: self.version for g in self.base}
        self.released, self.next_base = {}, {}      # every group starts again from its first answer
        # Checkpoints written before data positions were recorded have none: groups start their epochs.
        self.data_positions = {int(g): dict(p) for g, p in data.get("data_positions", {}).items()}
        self._trace("resume", version=self.version,
                    data_positions={str(g): p for g, p in self.data_positions.items()})
        return self.version

    def _newest_readable(self) -> dict[str, Any] | None:
        """The newest complete set whose files are all readable: every shard sees the same files
        and makes the same choice, so a corrupt file makes them all fall back to the version
        before (said on stdout, naming the file)."""
        assert self.ckpt_dir is not None
        for version in checkpoint.complete_versions(self.ckpt_dir, len(self.ps_ranks)):
            why = next((w for s in range(len(self.ps_ranks)) if s != self.shard
                        for w in [checkpoint.intact(self.ckpt_dir, s, version)] if w), None)
            if why is None:
                try:
                    return checkpoint.load(self.ckpt_dir, self.shard, version)
                except (OSError, ValueError) as exc:
                    why = str(exc)
            print(f"PS shard {self.shard}: checkpoint version {version} is not usable ({why}); "
                  f"trying the one before", flush=True)
            self._trace("resume_skipped", version=version, why=why)
        return None

    # --- main thread ---------------------------------------------------------------------------
    def wait(self) -> None:
        """Until every group is done; fails when an unfinished group is silent for the timeout."""
        while not self.all_done.wait(1.0):
            with self.cv:
                now = time.monotonic()
                # 3/4 of the timeout: groups held back by the bound hear this reason before their
                # own RPC timeout fires.
                limit = (0.75 if self.coordinator else 1.0) * self.timeout_s
                silent = sorted(g for g in self.active if g not in self.waiting
                                and now - self.last_seen[g] > limit)
                if silent:
                    msg = (f"PS shard {self.shard}: no message from group(s) {silent} for "
                           f"{limit:g} s; a worker probably died")
                    self.failure = msg
                    for fut in [*self.waiting.values(), *(f for _, f in self.finishing)]:
                        fut.set_exception(TrainingError(msg))
                    self.waiting.clear()
                    self.finishing.clear()
                    raise TrainingError(msg)

    def close(self) -> None:
        self.writes.put(None)
        self.writer.join()
        end = {"version": self.version, "update_s": self.update_s, "peak_rss_kb": memory_kb("VmHWM"),
               "impl": self.opt_impl}
        self._trace("end", **end)
        self.metrics.emit(event="ps_end", shard=self.shard, **end)
        if self.trace_fh:
            self.trace_fh.close()


def memory_kb(field: str) -> int | None:
    """A figure of /proc/self/status (VmRSS: resident now; VmHWM: its peak), in KiB; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# RPC entry points: module-level so workers can name them; they run on the PS's RPC threads. They
# carry the control messages; the tensors of seeds, pushes and answers go over the pair's channel.
@rpc.functions.async_execution
def _pull(group: int) -> Future:
    return _server().pull(group)


@rpc.functions.async_execution
def _push(group: int, samples: float, hyper: optim.Hyperparameters, buffers: torch.Tensor | None,
          data_position: dict[str, int] | None = None, base: int | None = None) -> Future:
    return _io().push(group, samples, hyper, buffers, data_position, base)


@rpc.functions.async_execution
def _finish(group: int, wait_s: float) -> Future:
    return _server().finish(group, wait_s)


@rpc.functions.async_execution
def _seed(group: int, segments: list[list[Any]], spec: dict[str, Any], buffers: torch.Tensor | None) -> Future:
    return _io().seed(group, tuple(Segment.from_wire(s) for s in segments), spec, buffers)


def _state() -> tuple[int, torch.Tensor, torch.Tensor | None]:
    return _server().state()


def _data_position(group: int) -> dict[str, int] | None:
    return _server().data_position(group)


def _schedule_checkpoint(version: int) -> None:
    _server().schedule_checkpoint(version)


def _server() -> ShardServer:
    if _SERVER is None:
        raise TrainingError("this rank is not a parameter server")
    return _SERVER


def _io() -> Any:
    if _IO is None:
        raise TrainingError("this rank is not a parameter server")
    return _IO


def ps_threads(plan: Any, rank: int, environ: Mapping[str, str], cores: int) -> int:
    """Intra-op threads of a PS rank (its optimizer steps): HGTRAIN_PS_THREADS, else this node's
    cores shared evenly by the plan's ranks on the node (at least one)."""
    raw = environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise TrainingError(f"{THREADS_ENV}={raw!r} is not a positive whole number of threads")
        return value
    node = plan.rank(rank).node
    here = sum(1 for r in plan.ranks if r.node == node)
    return max(1, cores // max(1, here))


def main(argv: Sequence[str] | None = None) -> int:
    global _SERVER
    parser = argparse.ArgumentParser(prog="python -m hgcli.runtime.ps",
                                     description="hgtrain parameter-server rank (started by the launcher)")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="updates between checkpoints")
    parser.add_argument("--checkpoint-seconds", type=float, default=0.0,
                        help="seconds between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir")
    parser.add_argument("--resume-version", type=int, metavar="V",
                        help="continue from exactly checkpoint version V (the launcher's choice from "
                             "every node's files; implies --resume)")
    parser.add_argument("--trace", type=Path, help="append one JSON line per push/release/checkpoint")
    args = parser.parse_args(argv)
    global _IO
    try:
        env = RankEnv.from_environ()
        plan = env.plan
        if plan is None or env.rank not in plan.ps_shards:
            raise TrainingError(f"rank {env.rank} is not a PS rank of the plan (HGTRAIN_PLAN)")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(ps_threads(plan, env.rank, os.environ, cores))
        resume = args.resume or args.resume_version is not None
        if resume and args.checkpoint_dir is None:
            raise TrainingError("--resume needs --checkpoint-dir")
        shard = plan.ps_shards.index(env.rank)
        metrics = MetricsSink(env.metrics_fd, {"rank": env.rank, "role": "ps"})
        _SERVER = server = ShardServer(
            shard=shard, ps_ranks=plan.ps_shards, group_ids=[g.id for g in plan.groups],
            staleness_bound=plan.staleness_bound, global_batch=plan.global_batch,
            timeout_s=env.timeout_s, metrics=metrics,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
            checkpoint_seconds=args.checkpoint_seconds, trace=args.trace,
            accumulate={g.id: g.accumulate for g in plan.groups}, overlap=plan.overlap, wire=plan.wire)
        if resume:
            version = server.resume(args.resume_version)
            print(f"PS shard {shard}: " + (f"resumed from checkpoint version {version}"
                  if version is not None else "no complete checkpoint, starting fresh"), flush=True)
            if version is not None and shard == 0:   # the launcher's `resumed` event
                metrics.emit(event="resumed", source="checkpoint", step=version, samples=None)
        init_distributed(env, plan)
        from .ps_io import ShardIO

        _IO = ShardIO(server, leaders={g.id: g.ranks[0] for g in plan.groups})
        # Joined the job, nothing held yet: what the shard's state costs is above this.
        ready = {"rss_kb": memory_kb("VmRSS"), "threads": torch.get_num_threads()}
        server._trace("ready", **ready)
        metrics.emit(event="ps_ready", shard=shard, **ready)
        server.wait()
        server.close()
        shutdown(plan, env.timeout_s)     # its barrier: every leader has what was sent to it
        _IO.close()
    except TrainingError as exc:
        print(f"hgtrain PS rank: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # Run the imported module, not __main__: RPC resolves the handlers as hgcli.runtime.ps._push etc.
    from hgcli.runtime.ps import main as _main
    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # do not wait on RPC threads of a failed job
