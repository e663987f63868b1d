"""A parameter-server shard: what it holds, and the rule that decides which group waits.

Each PS rank holds one shard of the parameters, a contiguous range of the model's flat parameter
vector (ps/shards.py), and the optimizer state for it. Group leaders send it control messages over torch
RPC and the bulk data (gradients in, parameters out) over a process group of the pair (ps/io.py,
ps/transfer.py): ``push`` applies a group's gradient at once and answers with fresh parameters when the
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
  a fixed one-step pipeline delay: ``Admission.damping_delay``, ps/admission.py). A group then
  always has a gradient pending, and the rule (``Admission._may_answer_overlapped``) counts for each
  pending gradient, and each answered group's next one, every push that may still
  come before it; when no group is answered, the held group with the oldest base is (which moves
  nobody else's count): no deadlock.
* wire format (plan.wire): answers carry the parameters as bf16 under "bf16"; pushes may arrive as
  bf16 and are widened: parameters and optimizer state stay fp32 here.
Other shards apply pushes and answer at once (an acknowledgement; the leader pulls their parameters
after shard 0 answers), so one shard alone decides who waits and shards cannot deadlock each other.

The optimizer is the worker's class with its parameter groups (ps/optim.py), built with torch's fused
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

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.futures import Future

from . import optim
from .admission import Admission
from ..adapt.shares import GroupShares, Pace, block_layout
from .checkpoints import ShardCheckpoints
from .state import ShardState
from .trace import Trace
from ..adapt.rebalance import Change
from .shards import Segment
from ...schema.stages import Wire
from ..errors import TrainingError
from ..metrics import MetricsSink
from ...schema.records import PsEndRecord, PsPushRecord, SharesRecord


# In an answer's fields: "the shard's parameters in the wire format". How they reach the group is the
# delivery's business (``ShardServer.deliver``): a copy in process, a send over the pair's channel.
PARAMS = object()
MASTER = object()        # ... the fp32 master copy itself, whatever the wire (the final parameters)
Delivery = Callable[[int, Future, tuple[Any, ...]], None]


class ShardServer:
    """One PS shard: its RPC handlers (called on RPC threads) and the rule that decides who waits.

    It owns what it holds (``held``: parameters, optimizer, buffers), the staleness bookkeeping
    (``admission``) and its checkpoints (``checkpoints``); ``cv`` guards all three."""

    def __init__(self, *, shard: int, ps_ranks: Sequence[int], group_ids: Sequence[int],
                 staleness_bound: int, global_batch: int, timeout_s: float, metrics: MetricsSink,
                 checkpoint_dir: Path | None = None, checkpoint_every: int = 0,
                 checkpoint_seconds: float = 0.0, trace: Path | None = None,
                 accumulate: Mapping[int, int] | None = None, overlap: bool = False,
                 wire: Wire = Wire.FP32, shares: GroupShares | None = None) -> None:
        self.shard = shard
        self.ps_ranks = list(ps_ranks)
        self.global_batch = global_batch
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.cv = threading.Condition()
        self.held = ShardState(shard=shard, shards=len(self.ps_ranks), global_batch=global_batch,
                               accumulate={g: (accumulate or {}).get(g, 1) for g in group_ids})
        # Answers being sent and snapshots being copied from master and the optimizer state:
        # a step waits until there are none (self.cv held). Nothing else blocks on them.
        self.readers = 0
        self.staging = threading.Lock()                  # one push at a time in the staging buffer
        self.deliver: Delivery = self._deliver_copy
        # How shard 0 tells another shard (by rank) of a checkpoint version every shard takes: an RPC
        # to its handler (handlers.schedule_on, set by rank.main), which this module cannot import
        # without a circle (the handlers serve this class).
        self.schedule_on: Callable[[int, int], None] = _no_other_shards
        self.version = 0
        # Each group's data position after its latest applied push (sent by its leader; see
        # exchange/position.py): checkpointed with the parameters, answered to the group after a resume.
        self.data_positions: dict[int, dict[str, int]] = {}
        self.coordinator = shard == 0
        # Shard 0's re-split of the global batch across groups (adapt/shares.py; None: the plan's).
        self.shares = shares if self.coordinator else None
        self.admission = Admission(group_ids=group_ids, bound=staleness_bound, overlap=overlap,
                                   coordinator=self.coordinator)
        self.wire_dtype = torch.bfloat16 if Wire(wire) is Wire.BF16 else torch.float32   # Wire() checks it
        self.unseeded: list[tuple[int, Future]] = []  # pulls that arrived before the seed
        self.finishing: list[tuple[int, Future]] = []
        self.failure: str | None = None
        self.all_done = threading.Event()
        self._trace = Trace(shard, trace)
        self.checkpoints = ShardCheckpoints(
            shard=shard, shards=len(self.ps_ranks), directory=checkpoint_dir, every=checkpoint_every,
            seconds=checkpoint_seconds, snapshot=self.held.snapshot, read_done=self._read_done,
            saved=lambda version, path: self._trace("checkpoint", version=version, path=str(path)),
            trace=self._trace)
        self._trace("start", pid=os.getpid(), threads=torch.get_num_threads(), rss_kb=memory_kb("VmRSS"))

    # --- events ------------------------------------------------------------------------------
    def _read_done(self) -> None:
        with self.cv:
            self.readers -= 1
            self.cv.notify_all()

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
            self.admission.heard(group)
            self.checkpoints.start_clock()
            if self.held.params is None:
                self.held.install(flat, segments, opt_spec)
                self.held.buffers = buffers
                self._trace("seed", version=self.version, numel=flat.numel(), impl=self.held.opt_impl)
            else:
                self.held.check_resumed(segments, opt_spec, buffers)
            for g, fut in self.unseeded:
                self._request(g, fut)
            self.unseeded.clear()
            return self.version

    def pull(self, group: int) -> Future:
        """Parameters for a group (at its start; after shard 0 answered its push, on other shards)."""
        fut: Future = Future()
        with self.cv:
            self.admission.heard(group)
            self.checkpoints.start_clock()
            if self.held.params is None:
                self.unseeded.append((group, fut))
            else:
                self._request(group, fut)
        return fut

    def push(self, group: int, grad: torch.Tensor, samples: float, hyper: optim.Hyperparameters,
             buffers: torch.Tensor | None = None, data_position: dict[str, int] | None = None,
             base: int | None = None, pace: Pace | None = None) -> Future:
        """``hyper``: per parameter group, the values the worker's optimizer has now (its LR schedule);
        ``buffers`` (shard 0, models with buffers): the group's, averaged over its members;
        ``data_position``: the group's position in its data after this push; ``base``: the version
        of this shard's parameters the gradient was computed on (sent under overlap, where it is
        older than the group's last answer); ``pace``: the group's step outside the exchange, for the
        shares across groups (adapt/shares.py); ``grad`` may arrive in the plan's wire format."""
        fut: Future = Future()
        with self.cv:
            self.held.check_push(group, grad)
            while self.readers:          # answers in flight and snapshots read what this step changes
                self.cv.wait()
            adm = self.admission
            adm.heard(group)
            adm.pushed(group, base)
            staleness = self.version - adm.base[group]
            delay = adm.damping_delay(group, self.version)
            scale = (samples / self.global_batch if self.global_batch else 1.0) / max(1, delay)
            update_s = self.held.step(grad, scale, hyper)
            if buffers is not None:
                self.held.move_buffers(group, buffers, samples)
            self.version += 1
            adm.applied(group)
            if data_position is not None:
                self.data_positions[group] = dict(data_position)
            if self.shares is not None and pace is not None:
                change = self.shares.note(group, pace)
                if change is not None:
                    self._shared(change)
            self._trace("push", group=group, clock=adm.clock[group], base=adm.base[group],
                        version=self.version, staleness=staleness, delay=delay, samples=samples, scale=scale,
                        clocks=dict(adm.clock), active=sorted(adm.active),
                        lr=[h.get("lr") for h in hyper], update_s=update_s)
            self.metrics.record(PsPushRecord(shard=self.shard, group=group, version=self.version,
                                             staleness=staleness, delay=delay, scale=scale, update_s=update_s))
            if self.coordinator:
                self._request(group, fut)
            else:
                self.deliver(group, fut, (self.version, None, None, None))
            schedule = self._checkpoint_due()
        if schedule is not None:
            self._schedule_everywhere(schedule)
        return fut

    def finish(self, group: int, wait_s: float) -> Future:
        """A group is done; answers (done?, version, params, buffers) once all are, or after ``wait_s``."""
        fut: Future = Future()
        with self.cv:
            self.admission.heard(group)
            if self.admission.done(group):
                self._trace("done", group=group, clock=self.admission.clock[group])
                self._release()
            if not self.admission.active:
                self.all_done.set()
                self.deliver(group, fut, (True, self.version, MASTER, self.held.buffers_copy()))
            else:
                self.finishing.append((group, fut))
                threading.Timer(wait_s, self._finish_timeout, args=(group, fut)).start()
        return fut

    def state(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The current parameters and buffers, at once (``ctx.state_dict()``; no effect on scheduling)."""
        with self.cv:
            if self.held.params is None:
                raise TrainingError(f"PS shard {self.shard}: asked for its state before the seed")
            assert self.held.master is not None
            return self.version, self.held.master.clone(), self.held.buffers_copy()

    def data_position(self, group: int) -> dict[str, int] | None:
        with self.cv:
            return self.data_positions.get(group)

    def schedule_checkpoint(self, version: int) -> None:
        with self.cv:
            self.checkpoints.schedule(version, self.version)

    # --- internals (self.cv held) ------------------------------------------------------------
    def _finish_timeout(self, group: int, fut: Future) -> None:
        with self.cv:
            if (group, fut) in self.finishing:
                self.finishing.remove((group, fut))
                self.deliver(group, fut, (False, self.version, None, None))

    def _request(self, group: int, fut: Future) -> None:
        if self.coordinator:
            self.admission.waiting[group] = fut
            self._release()
        else:
            self._answer(group, fut)

    def _release(self) -> None:
        adm = self.admission
        while (g := adm.next_release(self.version)) is not None:
            fut = adm.waiting.pop(g)
            self._trace("release", group=g, version=self.version, computing=sorted(adm.computing),
                        bases={str(h): adm.base[h] for h in adm.computing})
            self._answer(g, fut)
        if not adm.active:
            self.all_done.set()
            for g, fut in self.finishing:
                self.deliver(g, fut, (True, self.version, MASTER, self.held.buffers_copy()))
            self.finishing.clear()

    def _answer(self, group: int, fut: Future) -> None:
        self.admission.answered(group, self.version)
        buffers = self.held.buffers_copy()
        if buffers is not None:
            self.held.answered_buffers[group] = buffers
        master = self.held.master
        if self._trace.on and master is not None:   # (a float64 sum: a debugging aid, slow on large models)
            self._trace("answer", group=group, version=self.version,
                        param_sum=float(master.to(self.wire_dtype).sum(dtype=torch.float64)))
        shares = self.shares.schedule() if self.shares is not None else None
        self.deliver(group, fut, (self.version, PARAMS, buffers, shares))

    def _shared(self, change: Change) -> None:
        """The groups' shares of the global batch changed (adapt/shares.py): traced, and reported as
        an ``adapt`` metric (the launcher's ``[adapt]`` line)."""
        assert self.shares is not None
        groups = list(self.shares.groups)
        self._trace("shares", data_step=change.from_step, groups=groups, before=list(change.before),
                    after=list(change.after))
        self.metrics.record(SharesRecord(
            step=change.step, data_step=change.from_step, groups=tuple(groups), before=tuple(change.before),
            batches=tuple(change.after), rates=tuple(round(r, 3) for r in change.rates),
            step_before_s=change.step_before_s, step_after_s=change.step_after_s))

    def _deliver_copy(self, group: int, fut: Future, fields: tuple[Any, ...]) -> None:
        """In process (tests, tools): the answer with a copy of the parameters."""
        dtype, master = payload(fields, self.wire_dtype), self.held.master
        fut.set_result(tuple(master.to(dtype, copy=True) if (f is PARAMS or f is MASTER) and dtype and master is not None
                             else f for f in fields))

    def _checkpoint_due(self) -> int | None:
        """Snapshot if this version is due; returns a version to schedule on every shard, if any."""
        if self.checkpoints.due(self.version):
            # The writer copies the state outside the lock; until it has, steps wait (readers).
            self.readers += 1
            self.checkpoints.write(self.version, {"data_positions": copy.deepcopy(self.data_positions),
                                                  "buffers": self.held.buffers_copy(),
                                                  "group_shares": self.shares.state_dict() if self.shares else None})
        return self.checkpoints.ahead(self.version, len(self.admission.clock))

    def _schedule_everywhere(self, version: int) -> None:
        for r in self.ps_ranks[1:]:
            self.schedule_on(r, version)

    def resume(self, version: int | None = None) -> int | None:
        """Load a complete checkpoint set (``version``, else the newest: ShardCheckpoints.find);
        returns its version, or None when there is none."""
        found = self.checkpoints.find(version)
        if found is None:
            self._trace("resume", version=None)
            return None
        version, data = found
        self.held.load(data)
        self.version = version
        self.admission.resumed(self.version)
        # Checkpoints written before data positions were recorded have none: groups start their epochs.
        self.data_positions = {int(g): dict(p) for g, p in data.get("data_positions", {}).items()}
        if self.shares is not None:
            self.shares.load_state_dict(data.get("group_shares"))
        self._trace("resume", version=self.version,
                    data_positions={str(g): p for g, p in self.data_positions.items()},
                    shares=self.shares.schedule() if self.shares is not None else None)
        return self.version

    # --- main thread ---------------------------------------------------------------------------
    def wait(self) -> None:
        """Until every group is done; fails when an unfinished group is silent for the timeout."""
        while not self.all_done.wait(1.0):
            with self.cv:
                # 3/4 of the timeout: groups held back by the bound hear this reason before their
                # own RPC timeout fires.
                limit = (0.75 if self.coordinator else 1.0) * self.timeout_s
                waiting = self.admission.waiting
                silent = self.admission.silent(time.monotonic(), limit)
                if silent:
                    msg = (f"PS shard {self.shard}: no message from group(s) {silent} for "
                           f"{limit:g} s; a worker probably died")
                    self.failure = msg
                    for fut in [*waiting.values(), *(f for _, f in self.finishing)]:
                        fut.set_exception(TrainingError(msg))
                    waiting.clear()
                    self.finishing.clear()
                    raise TrainingError(msg)

    def close(self) -> None:
        self.checkpoints.close()
        peak = memory_kb("VmHWM")
        end = {"version": self.version, "update_s": self.held.update_s, "peak_rss_kb": peak, "impl": self.held.opt_impl}
        self._trace("end", **end)
        self.metrics.record(PsEndRecord(shard=self.shard, version=self.version, update_s=self.held.update_s,
                                        peak_rss_kb=peak, impl=self.held.opt_impl))
        self._trace.close()


def payload(fields: tuple[Any, ...], wire_dtype: torch.dtype) -> torch.dtype | None:
    """The type the parameters an answer's fields name travel in (PARAMS: the wire's, ``wire_dtype``;
    MASTER: fp32), if they name any. Either way they are sent from the master copy (stable while
    readers > 0), narrowed on the way under the bf16 wire (transfer.send)."""
    if any(f is MASTER for f in fields):
        return torch.float32
    return wire_dtype if any(f is PARAMS for f in fields) else None


def _no_other_shards(rank: int, version: int) -> None:
    raise TrainingError(f"PS shard asked to tell rank {rank} of checkpoint version {version} without RPC")


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
