"""Imported by training scripts: ``ctx = hgcli.runtime.init()``; see docs/runtime.md.

Hybrid aggregation (weighted all-reduce inside a group, asynchronous parameter servers across groups)
on torch.distributed. Imports only torch and the standard library: it runs on nodes.

The names below load on first use (PEP 562), so the launcher can import ``hgcli.runtime.env`` (the
rank environment contract) without importing torch on the controller.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import Context, init
    from .group.ddp import WeightedDDPState, weighted_ddp_hook
    from .errors import TrainingError

__all__ = ["Context", "TrainingError", "WeightedDDPState", "init", "weighted_ddp_hook"]


def __getattr__(name: str) -> Any:
    if name in ("Context", "init"):
        from . import context

        return getattr(context, name)
    if name in ("weighted_ddp_hook", "WeightedDDPState"):
        from .group import ddp

        return getattr(ddp, name)
    if name == "TrainingError":
        from .errors import TrainingError

        return TrainingError
    raise AttributeError(f"module 'hgcli.runtime' has no attribute {name!r}")
