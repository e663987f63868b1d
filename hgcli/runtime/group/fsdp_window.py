"""Gradient accumulation in an fsdp group (group/sharded.py): the micro-steps of an update whose
gradients FSDP2 keeps unsharded, unreduced (``set_requires_gradient_sync(False)``), until the last
one's backward reduce-scatters their sum.

**Why the scaling.** FSDP2 adds each micro-step's gradient to the ones before it: ``sum_k g_k``, each
``g_k`` the mean over its ``n_k`` samples. The samples-weighted gradient needs ``sum_k n_k g_k``,
which differs wherever the micro-batches do (a batch of 7 as 4 + 3). So the sum FSDP2 keeps is held
as ``S / n_k`` while micro-step k's backward adds ``g_k`` to it (divided at its forward, when ``n_k``
is known), then multiplied by ``n_k`` after it: ``S + n_k g_k``. The last micro-step's backward
reduce-scatters ``S / n_last + g_last``, and the engine's reduce-scatter weights it by ``n_last``
like any step. FSDP2 exposes no hook on its unsharded gradients, so this reads them where FSDP2
keeps them (``FSDPParam.unsharded_accumulated_grad`` where it accumulates in the reduce dtype, else
the unsharded parameter's ``.grad``), as of torch 2.13; :func:`check_window_support` refuses, in one
line, a torch that keeps them elsewhere.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ..errors import TrainingError


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            for group in getattr(unit._get_fsdp_state(), "_fsdp_param_groups", ()):
                yield from group.fsdp_params


def check_window_support(model: torch.nn.Module) -> None:
    """Raise where this torch's FSDP2 keeps its accumulated gradients where :func:`scale_accumulated`
    cannot find them."""
    params = list(_fsdp_params(model))
    if not params or not all(hasattr(p, "unsharded_accumulated_grad") for p in params):
        raise TrainingError(f"torch {torch.__version__}'s FSDP2 keeps accumulated gradients where hgtrain "
                            f"cannot weight them by samples: plan this fsdp group without micro-batches "
                            f"or accumulation, or with --engine ddp")


def scale_accumulated(model: torch.nn.Module, factor: float) -> None:
    """Multiply the unsharded gradients FSDP2 accumulates (without reducing them) by ``factor``."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for p in _fsdp_params(model):
            grad = p.unsharded_accumulated_grad
            if grad is None and hasattr(p, "_unsharded_param"):
                grad = p.unsharded_param.grad
            if grad is not None:
                grad.mul_(factor)
