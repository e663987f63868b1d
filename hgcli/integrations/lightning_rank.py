"""What both of hgtrain's Lightning strategies add to a rank, whatever builds its model (DDP in
lightning.py, FSDP2 in lightning_fsdp.py): the ranks from the environment, this rank's share of the
global batch in its DataLoader, device emulation and metrics around each step.

The strategy's own gradient weighting needs every rank's share; it gets them through
:meth:`PlannedRank.shares_known`, once the training DataLoader is known.
"""
from __future__ import annotations

from typing import Any

import torch
from pytorch_lightning.strategies.parallel import ParallelStrategy
from torch.utils.data import DataLoader

from .job import RankShare, StepMeter, batch_length, is_shuffled, refuse, script_batch, with_batch_sampler


class PlannedRank(ParallelStrategy):
    """The part of a Lightning strategy that follows the plan's per-device batches. It stands before
    Lightning's own strategy in the bases (``class S(PlannedRank, DDPStrategy)``) and calls
    :meth:`join_plan` in ``__init__`` before Lightning's."""

    _share: RankShare
    _meter: StepMeter
    _samples: int

    def join_plan(self, framework: str) -> RankShare:
        """This rank's place in the plan (hybrid and ps plans, and micro-batches, refused here)."""
        share = RankShare.from_environ(framework)
        split = [w for w in share.env.plan.workers if w.micro_batches > 1] if share.env.plan else []
        if split:
            first = split[0]
            refuse(f"hgtrain: the plan splits rank {first.rank}'s batch into {first.micro_batches} micro-batches "
                   f"(its memory), but {framework} takes one batch per rank and step: Lightning's "
                   f"accumulate_grad_batches is the same on every rank. Plan with a smaller --global-batch "
                   f"(or more devices), so that every rank's batch fits its memory")
        self._share, self._meter, self._samples = share, StepMeter(share), 0
        return share

    def shares_known(self, shares: list[int] | None) -> None:
        """Every rank's samples per step from now on (None: the script's own batch sampler, unknown)."""

    @property
    def root_device(self) -> torch.device:
        # Under hgtrain a GPU rank sees only its own GPU and an emulated one the CPU: one device, which
        # Lightning's parallel_devices[local_rank] would look for past its end.
        assert self.parallel_devices is not None
        if len(self.parallel_devices) == 1:
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        # The ranks' environment (TorchElasticEnvironment under hgtrain and torchrun) is the truth;
        # num_nodes x devices is not where nodes hold different numbers of ranks.
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
        from pytorch_lightning.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        batch = script_batch(dataloader)
        if batch is None:
            self.shares_known(None)
            return dataloader       # a batch sampler of the script's own: its sizes are the script's
        self.shares_known(self._share.batches(batch))
        if self._share.uniform(batch):
            return dataloader
        seed = int(getattr(dataloader.sampler, "seed", 0))
        sampler = self._share.sampler(len(dataloader.dataset),  # type: ignore[arg-type]
                                      batch, shuffle=is_shuffled(dataloader), seed=seed,
                                      drop_last=dataloader.drop_last)
        return with_batch_sampler(dataloader, sampler)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._samples = batch_length(args[0]) if args else 0
        self._meter.begin()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        # Lightning divides the step's loss by the accumulation before backward: report the step's own.
        self._meter.end(self._samples, float(closure_loss.detach()) * accumulate)
        return loss

    def teardown(self) -> None:
        if self._meter.steps:
            self._meter.finish()
            self._meter.steps = 0
        super().teardown()
