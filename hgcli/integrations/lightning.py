"""``HgtrainStrategy``: Lightning's DDP strategy with each rank's planned batch.

``Trainer(strategy=HgtrainStrategy())`` under ``hgtrain launch --strategy allreduce`` (docs/frameworks.md).
Lightning builds the DDP; this strategy adds what hgtrain knows:

* the training DataLoader's sampler is replaced by this rank's share of the global batch
  (``process_dataloader``, right after Lightning put its DistributedSampler in): the script's
  global batch split in proportion to the plan's batches, disjoint shares, the same steps on
  every rank. Where every rank's share is equal, Lightning's own sampler stays (a homogeneous plan
  trains as under torchrun, to the bit);
* the samples-weighted comm hook, on gloo too (DDPStrategy registers comm hooks on CUDA only);
* device emulation's stretch and pacing, and step, loss and samples on hgtrain's metrics pipe;
* ranks from the environment, not ``num_nodes x devices``: the script need not set ``devices``, and a
  heterogeneous cluster's nodes may run different numbers of ranks.
"""
from __future__ import annotations

from typing import Any

import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .hook import paced_hook
from .job import RankShare, StepMeter, batch_length, is_shuffled, script_batch, with_batch_sampler

# DDPStrategy arguments that would replace hgtrain's comm hook.
_HGTRAIN_OWNS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class HgtrainStrategy(DDPStrategy):
    """Lightning's DDP strategy with this rank's planned batch, the samples-weighted comm hook,
    emulation and metrics: ``Trainer(strategy=HgtrainStrategy())`` is the one changed line."""

    strategy_name = "hgtrain"

    def __init__(self, **kwargs: Any) -> None:
        clash = sorted(k for k in kwargs if k in _HGTRAIN_OWNS)
        if clash:
            raise TypeError(f"HgtrainStrategy sets {', '.join(clash)} itself (the samples-weighted comm hook)")
        self._share = RankShare.from_environ("HgtrainStrategy (Lightning)")
        self._meter = StepMeter(self._share)
        # The rank's batch is known once the training DataLoader is (process_dataloader), after DDP
        # is built; the hook reads it from this state at the first backward.
        self._hook_state = self._share.hook_state(None)
        self._samples = 0
        super().__init__(**kwargs)

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

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        env = self.cluster_environment
        if env is not None and env.creates_processes_externally:
            # The ranks are started already (hgtrain, torchrun) and numbered by the environment: the
            # launcher only checks devices x num_nodes against WORLD_SIZE, which fails wherever the
            # script leaves ``devices`` to Lightning (one CPU) or nodes hold different numbers of ranks.
            from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

            self._launcher = _SubprocessScriptLauncher(env, num_processes=env.world_size(), num_nodes=1)

    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.register_comm_hook(self._hook_state, paced_hook)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        batch = script_batch(dataloader)
        if batch is None:
            return dataloader       # a batch sampler of the script's own: its sizes are the script's
        self._hook_state.batch_size = self._share.batches(batch)[self._share.index]
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
