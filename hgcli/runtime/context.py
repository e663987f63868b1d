"""``hg.init()`` -> Context: what a training script sees of hgtrain (see docs/runtime.md).

Without any hgtrain variable the script runs alone (world of one); with only torchrun's variables it
is one all-reduce group over all ranks; with HGTRAIN_PLAN it follows the plan.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from ..schema import stages as m
from .data.blocks import ShardStream
from .data.drawn import DrawnBatches
from .emulate import Emulator
from .env import RankEnv
from .errors import TrainingError
from .groups import group_backend, init_distributed, shutdown
from .group.engine import GroupEngine, GroupSpec, resolve_bucket_mb
from .group.fsdp import ShardOptions
from .group.sharded import ShardedEngine
from .exchange.gradient import PSExchange
from .memory import MemoryWatch
from .metrics import MetricsSink
from .wrapped import like_ddp
from .exchange.position import DataPosition, fetch_restored
from .adapt.rebalance import GroupSplit
from .adapt.shares import group_split
from .data.sampler import RankBatchSampler, dataset_length, make_loader
from ..schema.records import FinishRecord
from .rank_snapshots import RankSnapshots
from .sharded_snapshots import ShardedSnapshots


def _implicit_plan(env: RankEnv) -> m.Plan:
    """torchrun environment: one synchronous group of every rank, as DDP would do, each rank on its
    LOCAL_RANK GPU where CUDA is present (the group then all-reduces with NCCL), else on the CPU."""
    batch = env.batch_size
    device = m.Device.gpu(env.local_rank) if torch.cuda.is_available() else m.CPU
    ranks = tuple(m.RankPlan(rank=r, role=m.Role.WORKER, node="local", device=device, group=0,
                             batch_size=batch) for r in range(env.world_size))
    return m.Plan(strategy=m.Strategy.ALLREDUCE, world_size=env.world_size,
                  groups=(m.GroupPlan(id=0, ranks=tuple(range(env.world_size))),), ranks=ranks,
                  predicted_samples_per_s={}, global_batch=(batch or 0) * env.world_size, cluster="")


def _check_plan(plan: m.Plan) -> None:
    if len(plan.groups) > 1 and not plan.ps_shards:
        raise TrainingError("the plan has several all-reduce groups but no parameter server")
    for g in plan.groups:
        for r in g.ranks:
            if plan.rank(r).group != g.id or plan.rank(r).role is not m.Role.WORKER:
                raise TrainingError(f"plan: rank {r} is listed in group {g.id} but is not its worker")


def rank_device(env: RankEnv, me: m.RankPlan) -> torch.device:
    """A real GPU rank's device: under hgtrain it sees only its own GPU (CUDA_VISIBLE_DEVICES) as
    cuda:0; under plain torchrun every GPU of the node, and takes the LOCAL_RANK one."""
    if not (me.device.startswith("gpu") and not me.emulated and torch.cuda.is_available()):
        return torch.device("cpu")
    index = env.local_rank if env.plan is None else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def same_node(env: RankEnv, plan: m.Plan, rank: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Positions in ``ranks`` of the ranks on ``rank``'s node, by the plan (torchrun's implicit plan
    names no nodes and runs no emulation: just this rank)."""
    if env.plan is None:
        return (ranks.index(rank),)
    node = plan.rank(rank).node
    return tuple(i for i, r in enumerate(ranks) if plan.rank(r).node == node)


class Context:
    """What a training script sees of hgtrain (``hg.init()``): its rank and group, ``wrap`` for the
    model and optimizer, its data (``shard``, ``sampler``, ``loader``), ``log`` and ``finish``."""

    def __init__(self, env: RankEnv, *, echo: bool = False) -> None:
        self.env = env
        self.plan = env.plan or _implicit_plan(env)
        _check_plan(self.plan)
        me = self.plan.rank(env.rank)
        if me.role is not m.Role.WORKER:
            raise TrainingError(f"rank {env.rank} is a parameter-server rank: the launcher runs "
                                f"'python -m hgcli.runtime.ps' there, not the training script")
        self.group_plan = next(g for g in self.plan.groups if g.id == me.group)
        workers = self.plan.workers
        self.worker_index = [w.rank for w in workers].index(env.rank)
        self._batches = [w.batch_size for w in workers]
        self.metrics = MetricsSink(env.metrics_fd, {"rank": env.rank, "group": me.group,
                                                     "role": "worker"}, echo=echo)
        self.emulator = Emulator(env.speed, worker_index=self.worker_index, n_workers=len(workers),
                                 straggler_factor=float(os.environ.get("HGTRAIN_EMULATE_STRAGGLER") or 1),
                                 straggler_seed=int(os.environ.get("HGTRAIN_EMULATE_SEED") or 0),
                                 slowdown=[(s.after_s, s.factor) for s in me.slowdown])
        if me.emulated or env.speed < 1.0:
            torch.set_num_threads(1)        # emulated devices share one CPU
        self.device = rank_device(env, me)
        offloaded = self.group_plan.engine is m.Engine.FSDP and ShardOptions.from_environ(os.environ).offload
        self._memory = MemoryWatch(self.device, cap_mib=env.memory_mib, label=f"{me.device}@{me.node}",
                                   offloaded=offloaded, untimed=self.emulator.untimed)
        self._pgs = init_distributed(env, self.plan) if env.world_size > 1 else {}
        self._sync: GroupEngine | ShardedEngine | None = None
        self._data = DataPosition()
        self.micro_batches = me.micro_batches      # at least 1: the plan refuses less (schema/plan.py)
        # A re-split could cut a batch below its micro-batches: groups that accumulate keep the plan's.
        accumulating = any(self.plan.rank(r).micro_batches > 1 for r in self.group_plan.ranks)
        self._split = group_split(self.plan, self.group) if env.adapt and not accumulating else None
        self._split_taken = False           # the first data source (the training data) follows it
        self._drawn = DrawnBatches(self._batches[self.worker_index], self.worker_index, micro=self.micro_batches)
        # All-reduce snapshots (snapshot.py): taken by the first worker of each node, resumed by all.
        self._snapshots = RankSnapshots(env=env, plan=self.plan, group_plan=self.group_plan, batches=self._batches,
                                        emulator=self.emulator, metrics=self.metrics, data=self._data,
                                        device=self.device, pg=self._pgs.get(self.group),
                                        first_worker=self.worker_index == 0)

    # --- identity -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def group(self) -> int:
        return self.group_plan.id

    @property
    def num_workers(self) -> int:
        """The ranks that train (every group's); ``world_size`` (WORLD_SIZE) also counts the
        parameter-server ranks, so a script's per-worker arithmetic (a global batch over the
        workers, accumulation steps per worker) divides by this."""
        return len(self.plan.workers)

    @property
    def is_leader(self) -> bool:
        return self.group_plan.ranks[0] == self.rank

    @property
    def is_first_worker(self) -> bool:
        return self.worker_index == 0

    @property
    def version(self) -> int:
        """PS version of the parameters this rank holds (0 without a PS)."""
        return self._sync.version if self._sync else 0

    # --- training -------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             max_grad_norm: float | None = None, bucket_mb: float | None = None, scheduler: Any = None,
             **ddp_options: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Join ``model`` and ``optimizer`` to the group's training; returns the module to train
        through, in every plan a module with DDP's shape: ``.module`` is ``model`` and ``no_sync()``
        is there (torch's ``DistributedDataParallel`` around ``model`` in a group of two or more, a
        :class:`~hgcli.runtime.wrapped.Wrapped` around it in a group of one and in an fsdp group,
        where FSDP2 shards ``model`` in place), and the optimizer, whose ``step()`` now takes the group's samples-weighted gradient (and, with
        parameter servers, their answer). An fsdp group returns a new optimizer of the same class,
        parameter groups and hyperparameters over the sharded parameters: step that one.

        ``max_grad_norm``: clip the group's aggregated gradient to this 2-norm before the local step
        or the push; a script's own ``clip_grad_norm_`` before ``opt.step()`` sees the aggregate too.
        ``bucket_mb``: DDP's ``bucket_cap_mb`` (default ``HGTRAIN_BUCKET_MB``, else 25); 0: one
        bucket. ``scheduler``: a learning-rate scheduler (anything with ``state_dict``/``load_state_dict``)
        kept in the training-state snapshots of plans without parameter servers, and restored with
        them after a restart. ``find_unused_parameters``, ``gradient_as_bucket_view`` and
        ``static_graph`` go to DDP as they are."""
        if self._sync is not None:
            raise TrainingError("wrap() was already called in this process")
        on = {p.device.type for p in model.parameters()}
        if self.device.type == "cuda" and on != {"cuda"}:
            where = (f"the model's parameters are on {', '.join(sorted(on)) or 'no device'}: move the "
                     f"model (and its batches) to ctx.device ({self.device}) before ctx.wrap()")
            if len(self.group_plan.ranks) > 1 and group_backend(self.plan, self.group_plan) == "nccl":
                # NCCL takes CUDA tensors only; the first collective would fail with torch's
                # "No backend type associated with device type cpu".
                raise TrainingError(f"rank {self.rank}: group {self.group} all-reduces with NCCL, but {where}")
            print(f"hgtrain: rank {self.rank} has a GPU but trains on the CPU: {where}", file=sys.stderr,
                  flush=True)
        spec = self._group_spec()
        if self.group_plan.engine is m.Engine.FSDP:
            return self._wrap_sharded(model, optimizer, spec, max_grad_norm, scheduler, ddp_options)
        self._snapshots.attach(model, optimizer, scheduler)    # the first of the step's pre-hooks
        self._data.hook(optimizer)      # before the aggregation's hook: a push carries its own batch
        engine = GroupEngine(model=model, optimizer=optimizer, spec=spec, emulator=self.emulator,
                             metrics=self.metrics, timeout_s=self.env.timeout_s, max_grad_norm=max_grad_norm,
                             bucket_mb=resolve_bucket_mb(bucket_mb, os.environ), ddp_options=ddp_options)
        if self.plan.ps_shards:
            engine.exchange = PSExchange(
                group=engine.link, optimizer=optimizer, ps_ranks=self.plan.ps_shards,
                first_worker=self.plan.workers[0].rank, metrics=self.metrics, timeout_s=self.env.timeout_s,
                overlap=self.plan.overlap, wire=self.plan.wire, data_position=self._data.current,
                frozen=engine.frozen, split=self._split)
        resume = self._snapshots.resume_step
        if resume is not None:
            # Before DDP's start broadcasts rank 0's parameters, and before the first group seeds
            # the PS with its own (a plan re-grouped from an all-reduce one: launch/adapt.py).
            self._snapshots.resume(resume, engine)
        self._sync = self._snapshots.engine = engine
        trained = engine.start()
        if self.plan.ps_shards and resume is None:
            self._restore_data_position()
        self._memory.attach(trained, optimizer)
        return like_ddp(trained), optimizer

    def _group_spec(self) -> GroupSpec:
        ranks = self.group_plan.ranks
        return GroupSpec(rank=self.rank, group_id=self.group, ranks=ranks, pg=self._pgs.get(self.group),
                         batches=tuple(self.plan.rank(r).batch_size or self.env.batch_size for r in ranks),
                         accumulate=self.group_plan.accumulate, micro_batches=self.micro_batches,
                         steps_differ=len({self.plan.rank(r).micro_batches for r in ranks}) > 1,
                         share_with=same_node(self.env, self.plan, self.rank, ranks),
                         default_batch=self.env.batch_size or 1, split=self._split)

    def _wrap_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: GroupSpec,
                      max_grad_norm: float | None, scheduler: Any,
                      ddp_options: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """An fsdp group's wrap: the model sharded in place (FSDP2 makes it an ``FSDPModule``, which
        ``wrap`` returns in a ``Wrapped``), and the optimizer rebuilt over its shards, which the
        script steps."""
        if ddp_options:
            raise TrainingError(f"ctx.wrap() of an fsdp group does not take {', '.join(sorted(ddp_options))} "
                                f"(DDP's options)")
        if scheduler is not None:
            raise TrainingError("ctx.wrap(scheduler=) of an fsdp group: the group rebuilds the optimizer "
                                "(FSDP2 replaces the parameters), so a scheduler must be built on the one "
                                "ctx.wrap returns, and its snapshots hold no scheduler state")
        engine = ShardedEngine(model=model, optimizer=optimizer, spec=spec, device=self.device,
                               emulator=self.emulator, metrics=self.metrics, max_grad_norm=max_grad_norm,
                               options=ShardOptions.from_environ(os.environ))
        self._sync = engine
        snaps = self.env.snapshots
        dcp = None if snaps is None else ShardedSnapshots(
            engine=engine, config=snaps, world_size=self.world_size, per_step=self._snapshots.per_step,
            emulator=self.emulator, metrics=self.metrics, data=self._data)
        restore: Callable[[], None] | None = None
        if dcp is not None and snaps is not None and snaps.resume_step is not None:
            restore = functools.partial(dcp.resume, snaps.resume_step)
        trained, opt = engine.start(restore)
        if dcp is not None:
            dcp.attach()
        self._data.hook(opt)
        self._memory.attach(trained, opt)
        return like_ddp(trained), opt

    def shard(self, data: Sequence[torch.Tensor], *, batch_size: int, epochs: int = 1,
              seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        """This rank's batches of ``data`` (a tuple of tensors); ``batch_size`` unless the plan says."""
        stream = ShardStream(data, self._batch_sizes(batch_size), self.worker_index, epochs=epochs, seed=seed,
                             split=self._take_split(batch_size), micro=self._micro(batch_size))
        self._data.track(stream)        # the first data source is the training data: its position is kept
        return iter(stream)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the current parameters and buffers, copied, for a script's own
        checkpoints: the PS's under hybrid plans while training, the local model's otherwise."""
        if self._sync is None:
            raise TrainingError(f"rank {self.rank}: ctx.state_dict() needs ctx.wrap(model, opt) first")
        # Fetching and copying the state is not the device's work: emulation must not stretch it.
        with self.emulator.untimed():
            return self._sync.state_dict()

    @property
    def grad_norm(self) -> float | None:
        """2-norm of the last aggregated gradient before clipping (with ``max_grad_norm``; else None)."""
        return self._sync.grad_norm if self._sync else None

    def sampler(self, dataset: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True) -> RankBatchSampler:
        """A batch sampler of this rank's index lists of a map-style ``dataset`` (only its length
        is read), for ``DataLoader(dataset, batch_sampler=...)``; ``batch_size`` unless the plan says.
        The first one made is the training data: its position is checkpointed and restored."""
        sampler = RankBatchSampler(dataset_length(dataset), self._batch_sizes(batch_size), self.worker_index,
                                   shuffle=shuffle, seed=seed, drop_last=drop_last,
                                   split=self._take_split(batch_size), micro=self._micro(batch_size))
        self._data.track(sampler)
        return sampler

    def loader(self, dataset: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0,
               drop_last: bool = True, **dataloader_kwargs: Any) -> DataLoader:
        """A DataLoader over ``ctx.sampler(...)``; num_workers, pin_memory, collate_fn,
        persistent_workers and the other DataLoader arguments pass through."""
        return make_loader(dataset, self.sampler(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                                 drop_last=drop_last), dataloader_kwargs)

    def batch_sizes(self, default: int) -> list[int]:
        """Every worker's batch in plan order (``default`` where the plan gives none); this rank's is
        ``[ctx.worker_index]``."""
        return self._batch_sizes(default)

    def batch_size(self, default: int) -> int:
        """This worker's batch for the next ``opt.step()``, for a script that draws its own batches:
        the plan's share (``default`` where the plan gives none), one micro-batch of it when the plan
        gives ``micro_batches``, and the group's re-split batch while ``--adapt`` moves samples. Read it
        every step, before drawing. The first call makes these draws the process's training data
        (its data step is the position checkpoints keep)."""
        drawn = self._drawn
        if self._data.sampler is None:
            self._micro(default)            # a batch too small for its micro-batches: one line, now
            drawn.follow(self._take_split(default))
            self._data.track(drawn)
        if self._data.sampler is not drawn:
            raise TrainingError(f"rank {self.rank}: ctx.batch_size() is for scripts that draw their own "
                                f"batches; this one takes its training data from ctx.shard, ctx.sampler or "
                                f"ctx.loader, whose batches are already this worker's (use len(x))")
        return drawn.batch_size(default)

    def generator(self, seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A ``torch.Generator`` for this worker's own random stream: seeded from ``seed`` and the
        worker's index (workers draw different samples, a rerun the same ones), and re-seeded at the
        data step a restart resumes from when the script draws its batches with ``ctx.batch_size``."""
        return self._drawn.generator(seed, device)

    def log(self, **fields: Any) -> None:
        # Logging is not the device's work: emulation must not stretch it (emulate.py).
        with self.emulator.untimed():
            self.metrics.emit(**fields)

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Evaluation or logging inside the loop: not stretched by device emulation."""
        with self.emulator.untimed():
            yield

    def finish(self) -> None:
        """Wait for the other groups, take the final parameters, and leave the job."""
        self._snapshots.close()
        if self._sync is not None:
            self._sync.finish()
            self.metrics.record(FinishRecord(
                samples=self._sync.samples_seen, steps=self._sync.local_step, compute_s=self.emulator.compute_s,
                emulated_sleep_s=self.emulator.slept_s, emulated_step_s=self.emulator.target_s,
                sync_s=self._sync.sync_s, skipped_steps=self._sync.skipped_steps,
                compute_samples_per_s=self._sync.compute_rate, compute_noise=self._sync.compute_noise,
                **self._memory.figures()))
        if self.env.world_size > 1:
            try:
                shutdown(self.plan, self.env.timeout_s)
            except RuntimeError as exc:
                raise TrainingError(f"rank {self.rank}: leaving the job failed: {exc}") from exc

    def _batch_sizes(self, default: int) -> list[int]:
        return [b or default for b in self._batches]

    def _micro(self, default: int) -> int:
        """This rank's micro-batches per step: each of them is one ``opt.step()`` of the script's loop."""
        mine = self._batch_sizes(default)[self.worker_index]
        if mine < self.micro_batches:
            raise TrainingError(f"rank {self.rank}: a batch of {mine} cannot be stepped as "
                                f"{self.micro_batches} micro-batches (the plan's micro_batches)")
        return self.micro_batches

    def _take_split(self, batch_size: int) -> GroupSplit | None:
        """The split, for the process's first data source when it cuts the plan's batches."""
        if self._split is None or self._split_taken or self._batches != self._batch_sizes(batch_size):
            return None
        self._split_taken = True
        return self._split

    def _restore_data_position(self) -> None:
        """After a PS resume, the group continues from the data position its checkpoint recorded."""
        assert isinstance(self._sync, GroupEngine)
        with self.emulator.untimed():       # start-up, not the device's work
            pos = fetch_restored(rank=self.rank, leader=self.group_plan.ranks[0], group_id=self.group,
                                 n_members=len(self.group_plan.ranks), pg=self._pgs.get(self.group),
                                 ps_rank=self.plan.ps_shards[0], device=self._sync.device,
                                 timeout_s=self.env.timeout_s, collective=self._sync.link.collective)
        if pos is not None:
            self._data.restore(pos)
            print(f"hgtrain: rank {self.rank} (group {self.group}): data continues from epoch "
                  f"{pos['epoch']} step {pos['step']} (PS checkpoint)", flush=True)


def init(*, echo: bool = False) -> Context:
    """Join the job described by the environment (launcher, localrun, torchrun or nothing)."""
    return Context(RankEnv.from_environ(), echo=echo)
