"""``Hgtrain``: each rank's planned batch in a plain accelerate loop (docs/frameworks.md)::

    accelerator = Accelerator()
    hg = Hgtrain(accelerator)
    model, opt = accelerator.prepare(model, opt)
    loader = hg.prepare(loader, model)          # instead of accelerator.prepare(loader)
    for x, y in loader:
        with hg.step(len(x)) as step:           # emulation and metrics around the compute
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            step.loss = loss.item()
        opt.step(); opt.zero_grad()
    hg.finish()

``prepare`` gives the loader this rank's share of the global batch (the loader's ``batch_size`` x
ranks, split in proportion to the plan's batches) in accelerate's own device-placing DataLoader,
without accelerate's re-sharding, and registers the samples-weighted comm hook on the DDP that
``accelerator.prepare(model)`` built (accelerate's ``DistributedDataParallelKwargs(comm_hook=...)``
takes only torch's built-in hooks). Where every share is equal the loader goes through
``accelerator.prepare`` unchanged, so a homogeneous plan trains as under torchrun.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .hook import paced_hook
from .job import RankShare, StepMeter, is_shuffled, loader_kwargs, script_batch


@dataclass
class Step:
    """What the loop tells of one step: its loss (optional, for the live table and the summary)."""
    loss: float | None = None


class Hgtrain:
    """hgtrain inside an accelerate loop: ``prepare`` gives this rank its planned batches and the
    samples-weighted comm hook, ``step`` adds emulation and metrics around each step."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self._share = RankShare.from_environ("hgcli.integrations.accelerate")
        self._meter = StepMeter(self._share)

    def prepare(self, loader: DataLoader, model: torch.nn.Module | None = None, *, seed: int = 0) -> DataLoader:
        """``loader`` cut to this rank's batches and placed on the accelerator's device; ``model``:
        the module ``accelerator.prepare`` returned, which gets the comm hook (before its first
        backward). ``seed``: the shuffle's, the same on every rank."""
        batch = script_batch(loader)
        if batch is None:
            raise TypeError("Hgtrain.prepare needs a DataLoader built with batch_size=: its batch sampler "
                            "is hgtrain's to make")
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self._share.hook_state(batch), paced_hook)
        if self._share.uniform(batch):
            prepared: DataLoader = self.accelerator.prepare(loader)
            return prepared
        sampler = self._share.sampler(len(loader.dataset),  # type: ignore[arg-type]
                                      batch, shuffle=is_shuffled(loader), seed=seed, drop_last=loader.drop_last)
        return DataLoaderShard(loader.dataset, device=self.accelerator.device, batch_sampler=sampler,
                               **loader_kwargs(loader))

    @contextlib.contextmanager
    def step(self, samples: int) -> Iterator[Step]:
        """One training step's compute (forward and backward): device emulation stretches it, and
        its step, samples and loss go to hgtrain's metrics pipe."""
        record = Step()
        self._meter.begin()
        yield record
        self._meter.end(samples, record.loss)

    def finish(self) -> None:
        """The rank's totals (the launcher's summary); call once after the loop."""
        self._meter.finish()
