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

Where the plan's group trains with fsdp, ``HgtrainStrategy()`` is the FSDP2 variant instead
(lightning_fsdp.py): the engine is the plan's, as under ``ctx.wrap``, and the script does not change.
"""
from __future__ import annotations

from typing import Any, cast

import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from ..runtime.env import RankEnv
from ..schema import stages as m
from .hook import paced_hook
from .job import refuse
from .lightning_rank import PlannedRank

# DDPStrategy arguments that would replace hgtrain's comm hook.
_HGTRAIN_OWNS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class HgtrainStrategy(PlannedRank, DDPStrategy):
    """Lightning's DDP strategy with this rank's planned batch, the samples-weighted comm hook,
    emulation and metrics: ``Trainer(strategy=HgtrainStrategy())`` is the one changed line.

    Under a plan whose group trains with fsdp, constructing it gives an ``HgtrainFSDPStrategy``
    (Lightning's ModelParallelStrategy, FSDP2) with the same arguments."""

    strategy_name = "hgtrain"

    def __new__(cls, **kwargs: Any) -> HgtrainStrategy:
        if cls is HgtrainStrategy and planned_engine() is m.Engine.FSDP:
            # Not an instance of cls, so Python calls no __init__ of ours on it.
            return cast(HgtrainStrategy, fsdp_strategy(kwargs))
        return super().__new__(cls)

    def __init__(self, **kwargs: Any) -> None:
        clash = sorted(k for k in kwargs if k in _HGTRAIN_OWNS)
        if clash:
            raise TypeError(f"HgtrainStrategy sets {', '.join(clash)} itself (the samples-weighted comm hook)")
        share = self.join_plan("HgtrainStrategy (Lightning)")
        # The rank's batch is known once the training DataLoader is (process_dataloader), after DDP
        # is built; the hook reads it from this state at the first backward.
        self._hook_state = share.hook_state(None)
        super().__init__(**kwargs)

    def shares_known(self, shares: list[int] | None) -> None:
        if shares is not None:
            self._hook_state.batch_size = shares[self._share.index]

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


def planned_engine() -> m.Engine:
    """The engine of the plan's one group (DDP without a plan, as under torchrun; a plan of several
    groups is refused by the strategy itself)."""
    plan = RankEnv.from_environ().plan
    if plan is None or len(plan.groups) != 1:
        return m.Engine.DDP
    return plan.groups[0].engine


def fsdp_strategy(kwargs: dict[str, Any]) -> Any:
    """``HgtrainFSDPStrategy(**kwargs)``, or one line and exit 2 where this Lightning has no FSDP2
    strategy or ``kwargs`` are DDP's."""
    import pytorch_lightning

    try:
        from .lightning_fsdp import HgtrainFSDPStrategy, accepts
    except ImportError as exc:
        refuse(f"hgtrain: the plan trains its group with fsdp, which needs Lightning's ModelParallelStrategy "
               f"(FSDP2; pytorch-lightning >= 2.4), not in pytorch-lightning {pytorch_lightning.__version__} "
               f"({exc}): upgrade it, or plan with --engine ddp")
    ddp_only = sorted(k for k in kwargs if not accepts(k))
    if ddp_only:
        refuse(f"hgtrain: the plan trains its group with fsdp, but HgtrainStrategy was given "
               f"{', '.join(ddp_only)}, which only DDP takes: drop {'it' if len(ddp_only) == 1 else 'them'}, "
               f"or plan with --engine ddp")
    return HgtrainFSDPStrategy(**kwargs)
