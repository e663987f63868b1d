"""The optimizer of a sharded group, rebuilt over the sharded parameters.

FSDP2 replaces every parameter of the module it shards with a new ``nn.Parameter`` holding a DTensor
(this rank's shard), under the same name. An optimizer built before the wrap still holds the old,
full tensors: stepping it would update tensors the model no longer uses. ``ctx.wrap(model, opt)``
therefore builds a new optimizer of the same class, with the same parameter groups (each old
parameter mapped to the new one of the same name) and the same hyperparameters:
``type(opt)(param_groups, **opt.defaults)``, as torch's own ``Optimizer.__init__`` takes them (the
defaults its constructor does not name are left out: AdamW keeps ``decoupled_weight_decay`` among
them but does not take it; every group carries its own values of them anyway).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import TrainingError
from ..ps.optim import constructor_kwargs


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's qualified name, by identity (taken before the wrap replaces them)."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def refuse_unrebuildable(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
    """Raise where :func:`rebuild_optimizer` could not give the same optimizer: it has state already,
    a learning-rate scheduler drives it, or it holds a tensor that is not one of the model's."""
    cls = type(optimizer).__name__
    if any(optimizer.state.values()):
        raise TrainingError(f"{cls} already has state (it stepped before ctx.wrap): an fsdp group rebuilds "
                            f"the optimizer over the sharded parameters, and that state would be lost; "
                            f"call ctx.wrap(model, opt) before the first step")
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        raise TrainingError(f"a learning-rate scheduler was built on the {cls} before ctx.wrap: an fsdp "
                            f"group rebuilds the optimizer, so build the scheduler afterwards, on the "
                            f"optimizer ctx.wrap returns")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise TrainingError(f"{cls} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                                    f"of the wrapped model: an fsdp group can only rebuild an optimizer over "
                                    f"the model's own parameters")


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                      sharded: torch.nn.Module) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and hyperparameters over ``sharded``'s parameters,
    group for group (``names``: :func:`parameter_names` of the model before it was sharded)."""
    refuse_unrebuildable(optimizer, names)
    now = dict(sharded.named_parameters(remove_duplicate=False))
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        try:
            params = [now[names[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise TrainingError(f"parameter {exc} is gone from the sharded model: the optimizer cannot "
                                f"be rebuilt over it") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    cls = type(optimizer)
    try:
        return cls(groups, **constructor_kwargs(cls, optimizer.defaults))
    except (TypeError, ValueError) as exc:
        raise TrainingError(f"cannot rebuild {cls.__name__} over the sharded parameters as "
                            f"{cls.__name__}(param_groups, **defaults) (an fsdp group must: FSDP2 replaces "
                            f"the parameters): {exc}") from None

