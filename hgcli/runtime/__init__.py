"""Imported by training scripts: ``ctx = hgcli.runtime.init()``; see docs/runtime.md.

Hybrid aggregation (weighted all-reduce inside a group, asynchronous parameter servers across groups)
on torch.distributed. Imports only torch and the standard library: it runs on nodes.
"""
from .context import Context, init
from .errors import TrainingError

__all__ = ["Context", "TrainingError", "init"]
