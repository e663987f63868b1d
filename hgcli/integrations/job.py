"""What a framework integration takes from hgtrain for one rank: its share of the global batch, its
batch sampler, the comm hook's state, device emulation and the metrics pipe.

The framework keeps its own loop and builds its own DDP; this is the part of ``hgcli.runtime`` that
fits beside it (docs/frameworks.md). The script's global batch stays the script's (its per-device
batch times the workers, as under torchrun): the plan says how to split it, in proportion to its
batches, so the learning rate, the optimizer steps and the epochs keep the meaning the script gave
them. A plan whose global batch is that sum gives every rank exactly the plan's batch.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, ContextManager, NoReturn

import torch
from torch.utils.data import BatchSampler, DataLoader

from ..runtime.emulate import Emulator
from ..runtime.env import RankEnv
from ..runtime.metrics import MetricsSink
from ..runtime.adapt.rebalance import split_by_rate
from ..runtime.data.sampler import RankBatchSampler
from ..schema import stages as m
from ..schema.records import FinishRecord, RuntimeRecord
from .hook import PacedState


class PlanRefused(SystemExit):
    """A plan this integration cannot train: exit code 2 after one line on stderr, no traceback (a
    framework's traceback would bury the one thing to change)."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def refuse_groups(plan: m.Plan | None, framework: str) -> None:
    """The integrations train one synchronous group through the framework's DDP; the parameter
    servers' exchange lives in ``ctx.wrap()``, which the framework's loop does not call."""
    if plan is None or (not plan.ps_shards and len(plan.groups) == 1):
        return
    shards = len(plan.ps_shards)
    refuse(f"hgtrain: the plan is {plan.strategy.value} ({len(plan.groups)} groups, {shards} "
           f"parameter-server rank{'' if shards == 1 else 's'}), but {framework} trains one "
           f"all-reduce group: launch with --strategy allreduce")


def refuse(line: str) -> NoReturn:
    """Stop this rank with ``line`` on stderr and exit code 2 (:class:`PlanRefused`)."""
    print(line, file=sys.stderr, flush=True)
    raise PlanRefused(line)


@dataclass
class RankShare:
    """This rank's place in the plan: worker ``index`` of ``len(planned)``; ``planned`` holds every
    worker's plan batch (None where the plan gives none, as under plain torchrun)."""
    env: RankEnv
    index: int
    planned: list[int | None]
    emulator: Emulator | None
    metrics: MetricsSink

    @classmethod
    def from_environ(cls, framework: str) -> "RankShare":
        env = RankEnv.from_environ()
        refuse_groups(env.plan, framework)
        if env.plan is not None:
            workers = env.plan.workers
            index = [w.rank for w in workers].index(env.rank)
            planned: list[int | None] = [w.batch_size for w in workers]
            emulated = workers[index].emulated
            slowdown = [(s.after_s, s.factor) for s in workers[index].slowdown]
        else:
            index, planned, emulated, slowdown = env.rank, [env.batch_size] * env.world_size, False, []
        straggler = float(os.environ.get("HGTRAIN_EMULATE_STRAGGLER") or 1)
        emulator = None
        if env.speed < 1.0 or straggler > 1.0 or slowdown:
            emulator = Emulator(env.speed, worker_index=index, n_workers=len(planned),
                                straggler_factor=straggler,
                                straggler_seed=int(os.environ.get("HGTRAIN_EMULATE_SEED") or 0),
                                slowdown=slowdown)
        if emulated or emulator is not None:
            torch.set_num_threads(1)     # emulated devices share the node's CPU, one thread each
        metrics = MetricsSink(env.metrics_fd, {"rank": env.rank, "group": env.group if env.group is not None else 0,
                                               "role": "worker"})
        atexit.register(_leave)
        return cls(env=env, index=index, planned=planned, emulator=emulator, metrics=metrics)

    def batches(self, batch_size: int) -> list[int]:
        """Every worker's batch: the script's global batch (``batch_size`` x workers) split in
        proportion to the plan's batches; ``batch_size`` each where the plan gives none."""
        total = batch_size * len(self.planned)
        if not all(self.planned):
            return [batch_size] * len(self.planned)
        rates = [float(b or 0) for b in self.planned]
        return list(split_by_rate(total, rates, [total] * len(rates)))

    def uniform(self, batch_size: int) -> bool:
        """Every worker takes ``batch_size``: the framework's own sampler is already right (and keeps
        a homogeneous plan bit for bit what the script computes under torchrun)."""
        return len(set(self.batches(batch_size))) == 1

    def sampler(self, length: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True) -> RankBatchSampler:
        """This rank's index lists of a dataset of ``length`` samples: every step one block of a
        seeded permutation, each worker its slice, the same number of steps on every worker."""
        return RankBatchSampler(length, self.batches(batch_size), self.index, shuffle=shuffle, seed=seed,
                                drop_last=drop_last)

    def hook_state(self, batch_size: int | None, *, weighted: bool = True) -> PacedState:
        """The comm hook's state for a rank training ``batch_size`` per device as the script asked
        (None: set ``state.batch_size`` before the first backward, else the plan's batch is used)."""
        mine = None if batch_size is None else self.batches(batch_size)[self.index]
        return PacedState(batch_size=mine, emulator=self.emulator, weighted=weighted)


def _leave() -> None:
    """Destroy the framework's process group before the interpreter's own teardown, as ctx.finish()
    does: a Trainer rank that left it to the exit once ended with C++'s "terminate called without an
    active exception" after training, failing the job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class StepMeter:
    """Emulation and metrics around each of a framework's training steps: ``begin`` before the
    forward, ``end`` after the backward (the step's compute), ``finish`` when training ends."""
    share: RankShare
    steps: int = 0
    samples: int = 0
    _open: bool = field(default=False, repr=False)

    def begin(self) -> None:
        if self.share.emulator is not None:
            self.share.emulator.begin_compute()
        self._open = True

    def end(self, samples: int, loss: float | None) -> None:
        """The step's backward is done: stretch it to the emulated device, report it."""
        emulator = self.share.emulator
        if emulator is not None and self._open:
            emulator.end_compute(self.steps, samples)
        self._open = False
        self.steps += 1
        self.samples += samples
        record: dict[str, object] = {"step": self.steps, "samples": samples}
        if loss is not None:
            record["loss"] = loss
        self.emit(**record)

    def emit(self, **fields: object) -> None:
        """A record of the script's (a training step)."""
        with self._untimed():
            self.share.metrics.emit(**fields)

    def record(self, record: RuntimeRecord) -> None:
        """One of hgtrain's own records."""
        with self._untimed():
            self.share.metrics.record(record)

    def _untimed(self) -> ContextManager[None]:
        """Reporting is not the device's work: emulation must not stretch it."""
        emulator = self.share.emulator
        return emulator.untimed() if emulator is not None else contextlib.nullcontext()

    def finish(self) -> None:
        emulator = self.share.emulator
        self.record(FinishRecord(samples=self.samples, steps=self.steps,
                                 compute_s=emulator.compute_s if emulator else None,
                                 emulated_sleep_s=emulator.slept_s if emulator else 0.0,
                                 emulated_step_s=emulator.target_s if emulator else 0.0))


def batch_length(batch: object) -> int:
    """Samples in a batch as frameworks hand them over: a tensor, or a dict, list or tuple whose
    first tensor leads with the batch dimension (0 when none does)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_length(item)
        if n:
            return n
    return 0


# What a DataLoader keeps of its arguments under the same names (torch 2.x), and so can pass on.
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
            "generator", "prefetch_factor", "persistent_workers", "in_order")


def script_batch(loader: DataLoader) -> int | None:
    """The per-device batch a DataLoader was built with (``batch_size=``, kept as its BatchSampler's);
    None for a loader with a batch sampler of its own, whose sizes hgtrain cannot know."""
    if loader.batch_size is not None:
        return int(loader.batch_size)
    sampler = loader.batch_sampler
    return int(sampler.batch_size) if type(sampler) is BatchSampler else None


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments ``loader`` was built with that a DataLoader of another batch sampler keeps:
    workers, collate function, seeding and the rest (not a subclass's own: they cannot be known)."""
    accepted = inspect.signature(DataLoader).parameters
    kwargs: dict[str, Any] = {k: getattr(loader, k) for k in _CARRIED if k in accepted and hasattr(loader, k)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


def with_batch_sampler(loader: DataLoader, batch_sampler: RankBatchSampler) -> DataLoader:
    """``loader`` again, drawing its batches from ``batch_sampler`` (a plain DataLoader)."""
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **loader_kwargs(loader))


def is_shuffled(loader: DataLoader) -> bool:
    """Whether ``loader`` draws its samples in a random order (a RandomSampler, or a shuffling
    DistributedSampler as Lightning and accelerate put in)."""
    sampler = loader.sampler
    return bool(getattr(sampler, "shuffle", False)) or isinstance(sampler, torch.utils.data.RandomSampler)
