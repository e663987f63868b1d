"""``torch.amp.GradScaler`` with the runtime's step hook: a step is skipped by the whole group or by none.

``scaler.step(opt)`` unscales the gradients, and calls ``opt.step()`` only when this rank found no
inf/NaN. The runtime does its bookkeeping inside ``opt.step()`` (step hooks: samples, emulation,
accumulation micro-steps, the PS push), so a step the scaler skipped would go unseen. Hence, for
optimizers the runtime wrapped, the scaler's decision (``GradScaler._maybe_opt_step``) is replaced:
``opt.step()`` always runs with this rank's found-inf flag known to the engine (group/engine.py), which
skips the update (no local step, no push) when the group's gradient holds an inf/NaN. Inside a DDP
group every member sees the same flag, since an inf in any member's bucket is in the sum; a group of
one carries the flags of its accumulation window's micro-steps. Other optimizers keep torch's
behaviour. ``GradScaler.scale`` is wrapped to remember the live scale tensor: the engine takes it out
of gradients that wait across an accumulation window.

``_maybe_opt_step`` is a private method of torch's GradScaler (in the torch versions hgtrain supports:
``torch.amp.GradScaler`` since 2.3, ``torch.cuda.amp.GradScaler`` before). Should a torch lack it,
nothing is replaced: scripts without a GradScaler must not fail for it.
"""
from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable, Protocol

import torch


class ScalerAware(Protocol):
    """What a wrapped optimizer's GradScaler step calls on the group engine, so that a step is skipped
    by the whole group or by none."""

    def scaler_step(self, found_inf: bool, step: Callable[[], Any], scale: torch.Tensor | None) -> tuple[Any, bool]:
        """Run ``step`` (the optimizer's step) knowing this rank's found-inf flag and the scaler's
        scale (its live tensor: the gradients' scale); returns the step's result and whether the
        group skipped this update."""
        ...


_HOOKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, ScalerAware]" = weakref.WeakKeyDictionary()
_ORIGINAL: Callable[..., Any] | None = None
_ORIGINAL_SCALE: Callable[..., Any] | None = None
# The scale tensor of the GradScaler that last scaled a loss in this process: a DDP bucket is still
# scaled, and nothing else says by how much (group/engine.py).
_last_scale: torch.Tensor | None = None


def _maybe_opt_step(self: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                    *args: Any, **kwargs: Any) -> Any:
    sync = _HOOKED.get(optimizer)
    assert _ORIGINAL is not None
    if sync is None:
        return _ORIGINAL(self, optimizer, optimizer_state, *args, **kwargs)
    found = optimizer_state["found_inf_per_device"]
    retval, skipped = sync.scaler_step(bool(sum(v.item() for v in found.values())),
                                       lambda: optimizer.step(*args, **kwargs), getattr(self, "_scale", None))
    if skipped:
        for v in found.values():
            v.fill_(1.0)        # update() then backs off on every member, not only where it was found
    return retval


def _scale_remembered(self: Any, outputs: Any) -> Any:
    global _last_scale
    assert _ORIGINAL_SCALE is not None
    out = _ORIGINAL_SCALE(self, outputs)
    scale = getattr(self, "_scale", None)
    if isinstance(scale, torch.Tensor):
        _last_scale = scale
    return out


def last_scale() -> torch.Tensor | None:
    """The live scale tensor of the GradScaler that last scaled a loss here (None: none has)."""
    return _last_scale


def hook_scaler(optimizer: torch.optim.Optimizer, sync: ScalerAware) -> None:
    global _ORIGINAL, _ORIGINAL_SCALE, _last_scale
    _last_scale = None          # a scaler used before wrap() scaled nothing this optimizer steps
    if _ORIGINAL is None:
        cls = _grad_scaler_class()
        original = getattr(cls, "_maybe_opt_step", None)
        if cls is None or original is None:
            return
        _ORIGINAL = original
        setattr(cls, "_maybe_opt_step", _maybe_opt_step)
        if callable(getattr(cls, "scale", None)):
            _ORIGINAL_SCALE = getattr(cls, "scale")
            setattr(cls, "scale", _scale_remembered)
    _HOOKED[optimizer] = sync


def _grad_scaler_class() -> type | None:
    # torch.amp's since torch 2.3 (torch.cuda.amp's is a subclass there), torch.cuda.amp's before.
    for module in ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler"):
        try:
            cls = getattr(importlib.import_module(module), "GradScaler")
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type):
            return cls
    return None


def unhook_scaler(optimizer: torch.optim.Optimizer) -> None:
    _HOOKED.pop(optimizer, None)


def scaled_by_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """GradScaler's path for optimizers that unscale inside their own step (``fused=True``): it sets
    ``grad_scale``/``found_inf`` on the optimizer and calls ``step()`` directly with still-scaled
    gradients, which the runtime would aggregate as they are."""
    return getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None
