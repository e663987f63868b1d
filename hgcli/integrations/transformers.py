"""``HgtrainTrainer``: ``transformers.Trainer`` with each rank's planned batch; change the import only.

Under ``hgtrain launch --strategy allreduce`` (docs/frameworks.md). The Trainer and accelerate build
the DDP; this subclass adds:

* the training sampler: this rank's share of the global batch (``per_device_train_batch_size`` x
  ranks) in proportion to the plan's batches, disjoint shares, the same steps on every rank. It is
  handed to the Trainer as a rank-aware batch sampler (the Trainer's ``BatchRebalanceSampler``
  path), which the Trainer keeps from accelerate's re-sharding. Where every share is equal the
  Trainer's own sampler stays (a homogeneous plan trains as under torchrun, to the bit);
* the comm hook, registered on the DDP that accelerate wrapped the model in (accelerate's
  ``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's built-in hooks): weighted by
  the ranks' batches, or DDP's plain mean where the Trainer already normalised the loss over every
  rank's tokens (``average_tokens_across_devices`` with a model that takes ``num_items_in_batch``:
  then that mean is the union batch's gradient), paced under device emulation either way;
* device emulation around each training step, and step, loss and samples on hgtrain's metrics pipe.
"""
from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers.trainer_pt_utils import BatchRebalanceSampler

from ..runtime.data.sampler import RankBatchSampler
from .hook import paced_hook
from .job import RankShare, StepMeter, batch_length


class _PlannedBatches(RankBatchSampler, BatchRebalanceSampler):
    """The rank's batch sampler, seen by the Trainer as a rank-aware batch sampler, which it passes
    to the DataLoader as ``batch_sampler`` and shields from accelerate's re-sharding."""


class HgtrainTrainer(transformers.Trainer):
    """A drop-in ``transformers.Trainer`` that trains on this rank's planned batches with the
    samples-weighted comm hook, emulation and metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._share = RankShare.from_environ("HgtrainTrainer (transformers)")
        self._meter = StepMeter(self._share)
        self._hooked = False
        super().__init__(*args, **kwargs)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        batch = self._train_batch_size
        if dataset is None or not hasattr(dataset, "__len__") or self._share.uniform(batch):
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return _PlannedBatches(len(dataset), self._share.batches(batch), self._share.index,
                               shuffle=self.args.train_sampling_strategy != "sequential", seed=seed,
                               drop_last=self.args.dataloader_drop_last)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if not self._hooked:
            self._register_hook(model, num_items_in_batch)
        samples = batch_length(inputs)
        self._meter.begin()
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        self._meter.end(samples, float(loss) * self.current_gradient_accumulation_steps)
        return loss

    def _register_hook(self, model: torch.nn.Module, num_items_in_batch: torch.Tensor | int | None) -> None:
        """Before the first backward (DDP takes a hook only then)."""
        self._hooked = True
        if not isinstance(model, DistributedDataParallel):
            return
        normalised = (num_items_in_batch is not None and self.args.average_tokens_across_devices
                      and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))
        state = self._share.hook_state(self._train_batch_size, weighted=not normalised)
        model.register_comm_hook(state, paced_hook)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        result = super().train(*args, **kwargs)
        self._meter.finish()
        return result
