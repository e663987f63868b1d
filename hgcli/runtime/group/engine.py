"""The group engine: a synchronous group's gradients, aggregated behind the user's ``optimizer.step()``.

A group of two or more workers trains through torch's ``DistributedDataParallel`` on the group's
process group: DDP's C++ reducer buckets the gradients in the order backward produces them and
all-reduces each bucket while backward still runs; :func:`ddp.engine_hook`, its comm hook, adds what
hgtrain needs on top:

* **the samples-weighted mean.** Rank i's gradient counts with its samples ``n_i``: the group's
  gradient is ``sum_i n_i g_i / N``, the gradient of the union batch, where DDP's plain mean would
  count a rank of 3 samples as much as one of 5. The hook multiplies a bucket by ``1/W`` (as DDP
  does, W members), then by ``n_i W / B`` (B: the plan's batches summed, known on every rank without
  talking) before the sum, and by ``B / N`` after it. With the plan's batches both factors are
  exactly 1.0 and are skipped, so a homogeneous plan computes what DDP computes, bit for bit.
* **one small all-reduce per step** (``broadcast_buffers=False``): with the first bucket it sends
  the rank's samples, its buffers (BatchNorm statistics) weighted by them, for emulated ranks of
  one node their step-time estimates (emulate.py), and what rebalancing needs (adapt/rebalance.py: the
  member's compute seconds and samples since the last check, and its data source's next step). At ``opt.step()`` every member loads the
  samples-weighted mean of the buffers. DDP's default would broadcast rank 0's buffers at every
  forward instead.
* **device emulation's pacing**: a bucket leaves when it would on the emulated device
  (``Emulator.pace``).

A group of one has nothing to reduce: its own gradients are the group's, and no DDP is built.

Gradient accumulation (the plan's ``accumulate`` K > 1; the script still calls ``opt.step()`` after
every micro-batch): the first K - 1 backwards run under DDP's ``no_sync``; their gradients, each
weighted by its samples, wait beside the parameters (the step then sees no gradient: the optimizer
does nothing), and the hook adds them into the K-th backward's buckets, so one all-reduce carries
the window's samples-weighted sum. A GradScaler's scale is taken out of a bucket before that sum
and put back after it, since members' scales may differ by then. A rank with micro-batches
(``RankPlan.micro_batches`` m: the data hands it its batch as m pieces, one ``opt.step()`` each)
accumulates the same way over K * m micro-steps, its own window; every member still all-reduces
once per update, so members with different m stay matched.

After the group's gradient is in ``p.grad``: a step where any member's GradScaler found inf/NaN is
skipped by the whole group (group/amp.py). Otherwise the gradient is clipped (``max_grad_norm``, the
aggregate's norm, torch's own ``clip_grad_norm_``) and either the local optimizer steps on it (an
allreduce plan: exactly DDP), or the group's exchange with the parameter servers (exchange/gradient.py) takes
it and ``p.grad`` is cleared, so the local optimizer steps on nothing.

What DDP does not allow, the engine does not either: a parameter without a gradient needs
``ctx.wrap(..., find_unused_parameters=True)``. Two forward-backward passes before one ``opt.step()``
(a script accumulating itself, without ``no_sync``) would all-reduce twice: the second one's first
bucket raises a TrainingError saying so. A second backward of the same forward is not all-reduced
at all, as under DDP (its gradient stays this rank's).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping

import torch
import torch.distributed as dist

from . import amp
from .. import flat as flatten_
from ..adapt.clock import ClockedMember, ComputeClock
from ..emulate import Emulator
from ..errors import TrainingError
from .grad_window import GradWindow
from .link import GroupLink
from ..metrics import MetricsSink
from ...schema.records import SkipRecord
from .member_slots import MemberSlots
from ..adapt.rebalance import GroupSplit, Rebalancer
# The small all-reduce's layout: the bench sizes its measurement by it (node/bench/group.py).
from .step_reduce import MEMBER_SLOTS, StepReduce, step_reduce_numel  # noqa: F401

BUCKET_MB = 25.0            # DDP's bucket_cap_mb
BUCKET_ENV = "HGTRAIN_BUCKET_MB"
# ctx.wrap's keyword arguments that DDP takes as they are; the rest are the engine's to set.
DDP_OPTIONS = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")


def resolve_bucket_mb(value: float | None, environ: Mapping[str, str]) -> float:
    """The bucket size in MiB: ``value`` (``ctx.wrap(..., bucket_mb=)``), else ``HGTRAIN_BUCKET_MB``,
    else :data:`BUCKET_MB`; 0: one bucket (one all-reduce after backward)."""
    where = "bucket_mb"
    if value is None and environ.get(BUCKET_ENV, "").strip():
        where, text = BUCKET_ENV, environ[BUCKET_ENV].strip()
        try:
            value = float(text)
        except ValueError:
            raise TrainingError(f"{BUCKET_ENV}={text!r} is not a number of MiB (0: one bucket)") from None
    if value is None:
        return BUCKET_MB
    if not value >= 0 or value == float("inf"):
        raise TrainingError(f"{where} must be a finite number of MiB >= 0 (0: one bucket), not {value!r}")
    return float(value)


def sync_buffer_numel(parameters: int, members: int, buffers: int = 0) -> int:
    """Elements a group all-reduces per step: the gradients and the small all-reduce (the bench sizes
    its measurement by it)."""
    return parameters + step_reduce_numel(members, buffers)


@dataclass(frozen=True)
class GroupSpec:
    """Who the engine's rank trains with. ``batches``: the plan's batch of each member (None where
    the plan gives none, as under plain torchrun); ``share_with``: positions in ``ranks`` of the
    members on this rank's node (their emulated steps pool one estimate, emulate.py)."""
    rank: int
    group_id: int
    ranks: tuple[int, ...]
    pg: Any
    batches: tuple[int | None, ...]
    accumulate: int = 1
    micro_batches: int = 1          # this rank's micro-batches per step (data/blocks.py)
    steps_differ: bool = False      # members make different numbers of micro-steps per update
    share_with: tuple[int, ...] = ()
    default_batch: int = 1
    # The group's batches as the data hands them out, re-split as the members' speeds change
    # (adapt/rebalance.py); None: the plan's batches throughout (launch --no-adapt, a group of one).
    split: GroupSplit | None = None


class GroupEngine(ClockedMember):
    """One rank's part of its group: the hooks on the module and optimizer, DDP and its comm hook.

    It owns the step's small all-reduce (``reduce``) and what its member slots drive (``slots``:
    pooled estimates, rebalancing), the accumulation window (``window``) and the member's compute
    timing (``clock``); the exchange with the parameter servers, set before ``start()``
    (exchange.PSExchange), reaches the group through ``link`` (group/link.py)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: GroupSpec,
                 emulator: Emulator, metrics: MetricsSink, timeout_s: float,
                 max_grad_norm: float | None = None, bucket_mb: float = BUCKET_MB,
                 ddp_options: Mapping[str, Any] | None = None) -> None:
        _check_options(max_grad_norm, ddp_options)
        self.module = model
        self.opt = optimizer
        self.spec = spec
        self.rank = spec.rank
        self.group_id = spec.group_id
        self.ranks = spec.ranks
        self.leader = spec.ranks[0]
        self.members = len(spec.ranks)
        self.pg = spec.pg
        # This rank's micro-steps (opt.step() calls) per update: the plan's accumulation times its
        # micro-batches.
        self.accumulate = max(1, spec.accumulate) * max(1, spec.micro_batches)
        self.emulator = emulator
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        self.buffers = flatten_.synced_buffers(model)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.exchange: Any = None          # the PS exchange (exchange.PSExchange), set before start()
        self.link = GroupLink(rank=self.rank, group_id=self.group_id, ranks=self.ranks, pg=self.pg,
                              timeout_s=timeout_s, params=self.params, buffers=self.buffers, device=self.device)
        self._failed = self.link.failed
        self.reduce = StepReduce(members=self.members, me=spec.ranks.index(spec.rank), pg=self.pg,
                                 buffers=self.buffers, planned_total=_planned_total(spec, max(1, spec.accumulate)),
                                 failed=self._failed)
        self.window = GradWindow(self.params)
        self.clock = ComputeClock()
        self.local_step = 0
        self.samples_seen = 0
        self.skipped_steps = 0
        self.buckets_reduced = 0          # DDP buckets this rank all-reduced (its comm hook's calls)
        self._samples = 0                 # training samples counted by forwards since the last step
        self._found_inf = False           # GradScaler found inf/NaN in this rank's step (group/amp.py)
        self._skipped = False
        self._grad_norm: torch.Tensor | None = None
        self._nosync: ContextManager[Any] | None = None
        self.slots = MemberSlots(rank=self.rank, group_id=self.group_id, ranks=self.ranks,
                                 share_with=spec.share_with, emulator=emulator, clock=self.clock, metrics=metrics,
                                 rebalancer=_rebalancer(spec))
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._ddp_options = dict(ddp_options or {})
        self._bucket_mb = bucket_mb
        self._hooks = [
            model.register_forward_pre_hook(self._count_samples),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        amp.hook_scaler(optimizer, self)

    # --- start --------------------------------------------------------------------------------
    def start(self) -> torch.nn.Module:
        """Every member starts from the same parameters and buffers (the PS's under hybrid plans, then
        rank 0's of the group: DDP's own start); returns the module the script trains through."""
        if self.exchange is not None:
            self.exchange.start()
        if self.members > 1 and self.params:
            self.ddp = build_ddp(self, self._bucket_mb, self._ddp_options)
            self._set_sync(self.accumulate == 1)
        self.emulator.begin_compute()
        self.clock.begin_window()
        return self.ddp if self.ddp is not None else self.module

    # --- hooks ----------------------------------------------------------------------------------
    def _count_samples(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            self._samples += args[0].shape[0] if args[0].dim() else 1

    def scaler_step(self, found_inf: bool, step: Callable[[], Any],
                    scale: torch.Tensor | None = None) -> tuple[Any, bool]:
        """GradScaler's step for a wrapped optimizer (group/amp.py): always step, so the engine sees every
        step; returns the step's result and whether the group skipped the update."""
        self._found_inf = found_inf
        return step(), self._skipped

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's comm hook (ddp.engine_hook): weight this rank's bucket, start its all-reduce, and
        unweight the sum when it lands."""
        self.emulator.pace()
        self.buckets_reduced += 1
        with self.emulator.untimed():
            buf = bucket.buffer()
            last = self._samples or self.spec.default_batch
            mine = self.window.samples + last
            if bucket.index() == 0:
                if self.reduce.small is not None:
                    raise TrainingError(
                        f"rank {self.rank}: two backward passes in one step, without an opt.step() between "
                        f"them: DDP would all-reduce twice. Accumulate by "
                        f"calling opt.step() after each backward (the plan's accumulation), or run the "
                        f"earlier backwards under `with model.no_sync():`")
                self._start_small(mine, last, buf.device)
            total = self.reduce.planned_total
            assert total is not None        # _start_small learnt it
            scale = None
            stash = self.window.stash
            if stash is not None:
                scale = amp.last_scale()
                for view, p in zip(bucket.gradients(), bucket.parameters()):
                    if scale is not None:
                        view.div_(scale)
                    view.mul_(last)
                    earlier = stash.get(id(p))
                    if earlier is not None:
                        view.add_(earlier)
                buf.mul_(1.0 / total)
            else:
                buf.mul_(1.0 / self.members)         # DDP's own op, for bitwise equality
                factor = mine * self.members / total
                if factor != 1.0:
                    buf.mul_(factor)
            try:
                fut = dist.all_reduce(buf, group=self.pg, async_op=True).get_future()
            except (RuntimeError, ValueError) as exc:
                raise self._failed("all-reduce", exc) from exc
            if bucket.is_last():
                self.clock.bucket_left()
        return fut.then(lambda f: self._unweight(f, scale))

    def _start_small(self, mine: int, last: int, device: torch.device) -> None:
        split = self.spec.split
        self.reduce.start(mine, (last, self.emulator.estimate(last), self.clock.steady_s, self.clock.computed,
                                 split.next_step if split is not None else -1), device)

    def _unweight(self, fut: torch.futures.Future[list[torch.Tensor]],
                  scale: torch.Tensor | None) -> torch.Tensor:
        try:
            buf = fut.value()[0]
        except RuntimeError as exc:
            raise self._failed("all-reduce", exc) from exc
        self.reduce.unweight(buf)
        if scale is not None:
            buf.mul_(scale)
        return buf

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if amp.scaled_by_optimizer(opt) and (self.exchange is not None or self.max_grad_norm is not None
                                             or self.accumulate > 1):
            raise TrainingError(f"rank {self.rank}: GradScaler hands this optimizer still-scaled "
                                f"gradients (it unscales inside its own step, e.g. fused=True), which "
                                f"hgtrain's clipping, accumulation and parameter servers cannot take; "
                                f"use it without fused=True")
        waited, bucket_at = self.clock.reduce_waited()
        n = self._samples or self.spec.default_batch
        if self.emulator.end_compute(self.local_step, n) > 0 and bucket_at is not None:
            # An emulated device still computing after its last bucket left: its compute ends now.
            bucket_at = time.perf_counter()
        self._samples = 0
        self.samples_seen += n
        self.local_step += 1
        self._skipped = False
        found_inf, self._found_inf = self._found_inf or self.window.found_inf, False
        if self.local_step % self.accumulate:
            self.window.keep(n, found_inf)
            return
        mine = self.window.close(n)
        self._end_window(bucket_at, mine)
        self.window.finish(n, mine, into_grads=self.ddp is None)   # a group of one: the window's mean
        if found_inf:
            # Some member's scaler found inf/NaN in the group's gradient: nobody steps, nothing is
            # pushed, the parameters stay as they are.
            self._skipped = True
            self.skipped_steps += 1
            self._clear_grads()
            self.metrics.record(SkipRecord(group=self.group_id, step=self.local_step, version=self.version))
            return
        if self.max_grad_norm is not None:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if self.exchange is not None:
            samples = self.reduce.total() if self.ddp is not None else float(mine)
            grads = [_grad(p) for p in self.params] if self.rank == self.leader else None
            buffers = flatten_.flatten(self.buffers, self.device) if self.buffers else None
            self.exchange.step(grads, samples, buffers, allreduce_s=waited)
            self._clear_grads()

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.reduce.clear()
        self._set_sync((self.local_step + 1) % self.accumulate == 0)
        self.emulator.begin_compute()
        if self.local_step % self.accumulate == 0:
            self.clock.begin_window()

    # --- pieces of a step -----------------------------------------------------------------------
    def _end_window(self, bucket_at: float | None, mine: int) -> None:
        """The window's group reduction is done; its compute timed."""
        if self.ddp is not None:
            if self.reduce.small is None:
                raise TrainingError(
                    f"rank {self.rank}: the step's gradients were never all-reduced: a trained parameter "
                    f"got no gradient on this rank (pass ctx.wrap(..., find_unused_parameters=True)), "
                    f"the model trained outside the module ctx.wrap() returned (use `model, opt = "
                    f"ctx.wrap(model, opt)` and train `model`), or opt.step() came without a backward")
            self.slots.read(self.reduce.end(), self.local_step)
            # The window's compute: from its start to its last bucket (or its emulated end), the
            # wait for the others left out.
            self._computed_window(0.0 if bucket_at is None else bucket_at - self.clock.window_began, mine)
        else:
            # A group of one waits for nobody before its optimizer step: its compute ends here.
            self._computed_window(time.perf_counter() - self.clock.window_began, mine)

    def _computed_window(self, seconds: float, samples: float) -> None:
        due = self.clock.rates_due(seconds, samples, group=self.group_id, step=self.local_step,
                                   samples_seen=self.samples_seen)
        if due is not None:
            self.metrics.record(due)

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _set_sync(self, sync: bool) -> None:
        """DDP's ``no_sync`` for the backwards that do not complete an accumulation window."""
        if self.ddp is None:
            return
        if not sync and self._nosync is None:
            self._nosync = self.ddp.no_sync()
            self._nosync.__enter__()
        elif sync and self._nosync is not None:
            self._nosync.__exit__(None, None, None)
            self._nosync = None

    # --- what the exchange and the script's context read ----------------------------------------
    @property
    def version(self) -> int:
        return self.exchange.version if self.exchange is not None else 0

    # --- state and end --------------------------------------------------------------------------
    @property
    def grad_norm(self) -> float | None:
        """2-norm of the last aggregated gradient before clipping (read only when asked: a host sync)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def sync_s(self) -> float:
        """Wall seconds this rank waited on its group's all-reduces (after backward's last bucket
        left) and, with a PS, on the exchange and its broadcast."""
        return self.clock.reduce_wait_s + (self.exchange.sync_s if self.exchange is not None else 0.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (copies, the model's own names, no DDP prefix): the PS's parameters
        under hybrid while training, the local model's otherwise and after ``finish()``."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.exchange is not None:
            self.exchange.fill_state(state, self.module)
        return state

    def finish(self) -> None:
        """Remove the hooks; with a PS, wait until every group is done and hold its final parameters."""
        for h in self._hooks:
            h.remove()
        self._set_sync(True)
        amp.unhook_scaler(self.opt)
        if self.exchange is not None:
            self.exchange.finish()


def build_ddp(engine: GroupEngine, bucket_mb: float,
              ddp_options: Mapping[str, Any]) -> torch.nn.parallel.DistributedDataParallel:
    """DDP over the engine's module and process group, with the engine as its comm hook's state
    (``bucket_mb`` 0: one bucket)."""
    from torch.nn.parallel import DistributedDataParallel

    from .ddp import engine_hook

    cap = bucket_mb
    if cap <= 0:        # one bucket: every gradient in it
        cap = sum(p.numel() * p.element_size() for p in engine.params) / 2 ** 20 + 1.0
    on_gpu = engine.device.type == "cuda"
    # Buffers synchronised at the start (as DDP does), then averaged by the engine, not broadcast
    # from rank 0 at every forward: torch 2.13 renamed the switch (and warns on the old name).
    no_forward_sync: dict[str, Any] = ({"forward_sync_buffers": False}
                       if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                       else {"broadcast_buffers": False})
    options: dict[str, Any] = {**no_forward_sync, **ddp_options}
    try:
        ddp = DistributedDataParallel(
            engine.module, device_ids=[engine.device] if on_gpu else None, process_group=engine.pg,
            bucket_cap_mb=cap, **options)
    except (RuntimeError, ValueError) as exc:
        raise engine.link.failed("DDP's start (broadcast of rank 0's parameters)", exc) from exc
    ddp.register_comm_hook(engine, engine_hook)
    return ddp


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _planned_total(spec: GroupSpec, accumulate: int) -> float | None:
    """B: the plan's samples per update over the whole group; None (learnt from the first step)
    when the plan gives no batches (every member then uses the same value)."""
    return float(accumulate * sum(b for b in spec.batches if b)) if spec.batches and all(spec.batches) else None


def _rebalancer(spec: GroupSpec) -> Rebalancer | None:
    """The group's rebalancer: members that share a split of the plan's batches."""
    split = spec.split
    members = len(spec.ranks)
    return Rebalancer(split) if split is not None and members > 1 and len(split.planned) == members else None


def _check_options(max_grad_norm: float | None, ddp_options: Mapping[str, Any] | None) -> None:
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise TrainingError(f"max_grad_norm must be positive, not {max_grad_norm!r}")
    unknown = sorted(set(ddp_options or {}) - set(DDP_OPTIONS))
    if unknown:
        raise TrainingError(f"ctx.wrap() does not take {', '.join(unknown)}: hgtrain sets DDP's process "
                            f"group, devices, buckets and buffers itself (it takes {', '.join(DDP_OPTIONS)})")

