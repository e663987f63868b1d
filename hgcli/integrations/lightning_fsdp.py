"""``HgtrainFSDPStrategy``: Lightning's ModelParallelStrategy (FSDP2) with each rank's planned batch
and the samples-weighted gradient.

Why ModelParallelStrategy: it is FSDP2 (``fully_shard`` on a DeviceMesh), as hgtrain's own fsdp engine
(runtime/group/fsdp.py), and it runs on the CPU over gloo; Lightning's ``FSDPStrategy`` is FSDP1
(flat parameters, no per-unit reduce-scatter hook to weight a rank by its samples).

**Sharding.** ModelParallelStrategy asks the LightningModule to shard itself in ``configure_model``.
A script that does keeps its own units (only the weighting is added). Otherwise the strategy shards
as ``ctx.wrap`` does, with the rank's options (``--shard-modules``, bf16, offload, activation
checkpointing): each child of every ``nn.ModuleList`` a unit (names as the LightningModule's
``named_modules()`` gives them), and each direct child of the LightningModule a root, since Lightning
calls ``training_step``, not the LightningModule's ``forward``, and FSDP2 gathers a unit's parameters
around its forward. A parameter that would sit in no unit is refused.

**The gradient.** Rank i's loss is its own batch's mean, and FSDP2 averages the ranks' gradients:
``sum_i g_i / W``. The union batch's gradient is ``sum_i n_i g_i / N``. Every unit's reduce-scatter
(``set_custom_reduce_scatter``, as in runtime/group/sharded.py) first multiplies this rank's gradient
by ``n_i W / N``, with N all-reduced before each step (one small all-reduce: a last batch may be
short, and a script's own batch sampler is not known). Lightning's ``accumulate_grad_batches``
reduce-scatters every micro-batch into the sharded gradient, each with its own factor. Where every
rank's share is equal the factor is 1.0 and nothing is all-reduced or scaled: plain FSDP2.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning_fabric.utilities.init import _materialize_distributed_module
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn

from ..runtime.emulate import Emulator
from ..runtime.errors import TrainingError
from ..runtime.group.fsdp import ShardOptions, shard, shard_units
from ..runtime.group.sharded import WeightedReduceScatter
from .job import batch_length, refuse
from .lightning_rank import PlannedRank

# ModelParallelStrategy arguments hgtrain sets: every rank is one data-parallel member of the group.
_HGTRAIN_OWNS = ("data_parallel_size", "tensor_parallel_size")
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)      # no forward: cannot be a root


def accepts(name: str) -> bool:
    """Whether ``HgtrainFSDPStrategy`` takes keyword argument ``name`` (ModelParallelStrategy's own)."""
    return name in inspect.signature(ModelParallelStrategy.__init__).parameters and name not in _HGTRAIN_OWNS


class PacedReduceScatter(WeightedReduceScatter):
    """The weighted reduce-scatter, sent when the emulated device would have computed the gradient
    (``Emulator.pace``, as the DDP hook paces its buckets)."""

    def __init__(self, weight: Callable[[], float], emulator: Emulator | None) -> None:
        super().__init__(weight)
        self.emulator = emulator

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if self.emulator is not None:
            self.emulator.pace()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class HgtrainFSDPStrategy(PlannedRank, ModelParallelStrategy):
    """Lightning's FSDP2 strategy with this rank's planned batch, the samples-weighted gradient,
    emulation and metrics. ``HgtrainStrategy()`` gives it wherever the plan's group trains with fsdp;
    name it to shard whatever the plan says."""

    strategy_name = "hgtrain_fsdp"

    def __init__(self, **kwargs: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        clash = sorted(k for k in kwargs if k in _HGTRAIN_OWNS)
        if clash:
            raise TypeError(f"HgtrainFSDPStrategy sets {', '.join(clash)} itself (every rank one data-parallel "
                            f"member of the plan's group)")
        if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            refuse(f"hgtrain: HgtrainFSDPStrategy weights each rank's gradient through FSDP2's "
                   f"set_custom_reduce_scatter, which torch {torch.__version__} lacks: upgrade torch, or "
                   f"plan with --engine ddp")
        share = self.join_plan("HgtrainFSDPStrategy (Lightning)")
        self._weighted = True          # until the shares are known to be equal
        self._factor = 1.0             # this step's n_i W / N
        self._comm = PacedReduceScatter(lambda: self._factor, share.emulator)
        super().__init__(data_parallel_size=share.env.world_size, tensor_parallel_size=1, **kwargs)

    def shares_known(self, shares: list[int] | None) -> None:
        self._weighted = shares is None or len(set(shares)) > 1
        self._factor = 1.0

    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, less its demand that the LightningModule override
        # configure_model: hgtrain shards a module that did not shard itself.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: torch.nn.Module) -> None:
        """FSDP2 on ``module`` unless its ``configure_model`` applied it; the weighting on every unit."""
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(unit, FSDPModule) for unit in module.modules()):
            options = ShardOptions.from_environ(os.environ)
            try:
                roots = sharding_roots(module, options.pattern)
                shard(module, self.device_mesh["data_parallel"].get_group(), self.root_device, options, roots)
            except TrainingError as exc:
                refuse(f"hgtrain: {exc}")
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_reduce_scatter(self._comm)   # type: ignore[arg-type]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._weighted and args:
            mine = batch_length(args[0])
            total = torch.tensor([float(mine)], dtype=torch.float64, device=self.root_device)
            dist.all_reduce(total)
            self._factor = mine * self.world_size / float(total.item())
        return super().training_step(*args, **kwargs)


def sharding_roots(module: torch.nn.Module, pattern: str | None) -> list[torch.nn.Module]:
    """The direct children of a LightningModule that become FSDP2 roots: those with trained parameters
    that are not units already and have a forward. Refused (TrainingError) where a trained parameter
    would sit in no unit and no root: the LightningModule's own, or a ModuleDict's; and a module
    with no trained parameter (nothing to shard)."""
    if not any(p.requires_grad for p in module.parameters()):
        raise TrainingError(f"{type(module).__name__} has no trained parameters: an fsdp group has nothing to "
                            f"shard (plan it with --engine ddp)")
    units = [unit for _, unit in shard_units(module, pattern)]
    roots = [child for child in module.children()
             if not isinstance(child, _CONTAINERS) and all(child is not u for u in units)
             and any(p.requires_grad for p in child.parameters())]
    covered = {id(p) for owner in units + roots for p in owner.parameters()}
    stray = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
    if stray:
        raise TrainingError(f"{type(module).__name__}.{stray[0]} is in no FSDP unit: HgtrainFSDPStrategy shards the "
                            f"LightningModule's submodules (each child of an nn.ModuleList, then each direct "
                            f"child), so hold parameters in a submodule that training_step calls, or name the "
                            f"units with --shard-modules")
    return roots
