"""The ``--model SPEC`` of ``hgtrain bench``: which model to time, and how to load it on a node.

SPEC is ``TARGET:FACTORY[@BS,BS,...]`` or a built-in name (``example``, the default: the ResNet the
bundled example ``hgcli.examples.train`` trains; ``example-mlp``: the MLP ``hgcli.examples.train_mlp``
trains; ``mlp``: a 784-512-512-10 MLP):
- TARGET is a module (``mypkg.models``, importable on the node) or a file (``path/to/file.py``,
  present at that path on every node, relative to the node's working directory).
- FACTORY is a function of no arguments returning ``(model, make_batch)`` or
  ``(model, make_batch, loss_fn)``; ``make_batch(batch_size, device)`` returns ``(inputs, targets)``
  on that device (``inputs`` a tensor or a tuple of tensors passed as ``model(*inputs)``);
  ``loss_fn(output, targets)`` defaults to cross-entropy for integer targets, else mean squared error.
- ``@BS,...`` replaces the default batch sizes.
Parsing needs only the standard library (the controller validates SPEC without torch); loading
imports the user's code and torch, on the node.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

BUILTIN = {"mlp": "hgcli.examples.models:mlp", "example": "hgcli.examples.resnet:spec",
           "example-mlp": "hgcli.examples.models:example"}
# The workload that will run when the user names none: the main job's model, so the plan's batches
# fit the step time the job will see (a tiny model's flat time(batch) would favour tiny batches).
DEFAULT_SPEC = "example"

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BATCHES = re.compile(r"^[0-9]+(,[0-9]+)*$")


@dataclass(frozen=True)
class ModelRef:
    """A ``--model`` spec parsed (where the factory is, which batch sizes), before anything is imported."""

    spec: str                              # as the user wrote it (the label in the profiles)
    target: str                            # module name or file path
    factory: str
    is_file: bool
    batch_sizes: tuple[int, ...] | None    # None: the device's defaults


@dataclass(frozen=True)
class LoadedModel:
    """The user's model as the step benchmark drives it: the network, its batches and its loss."""

    model: Any
    make_batch: Callable[[int, Any], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any] | None


def parse_spec(spec: str) -> ModelRef:
    """ModelRef for SPEC; ValueError with a message naming the problem."""
    body, batch_sizes = spec, None
    head, sep, tail = spec.rpartition("@")
    if sep and _BATCHES.match(tail):
        body, batch_sizes = head, tuple(int(b) for b in tail.split(","))
        if any(b <= 0 for b in batch_sizes):
            raise ValueError(f"model spec {spec!r}: batch sizes must be positive")
    body = BUILTIN.get(body, body)
    target, sep, factory = body.rpartition(":")
    if not sep or not target:
        names = ", ".join(sorted(BUILTIN))
        raise ValueError(f"model spec {spec!r}: expected MODULE:FACTORY, FILE.py:FACTORY or one of: {names}")
    if not _IDENT.match(factory):
        raise ValueError(f"model spec {spec!r}: {factory!r} is not a function name")
    is_file = target.endswith(".py") or "/" in target
    if not is_file and not _MODULE.match(target):
        raise ValueError(f"model spec {spec!r}: {target!r} is neither a module name nor a .py file")
    return ModelRef(spec=spec, target=target, factory=factory, is_file=is_file, batch_sizes=batch_sizes)


def load(ref: ModelRef) -> LoadedModel:
    """Import the factory and call it; errors name the spec (they become the device's error)."""
    if ref.is_file:
        path = Path(ref.target).expanduser()
        if not path.is_file():
            raise ValueError(f"model file {ref.target} not found on this node")
        module_spec = importlib.util.spec_from_file_location(f"hgtrain_model_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"model file {ref.target} cannot be imported")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(ref.target)
    factory = getattr(module, ref.factory, None)
    if not callable(factory):
        raise ValueError(f"{ref.target} has no function {ref.factory!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"{ref.spec}: the factory must return (model, make_batch[, loss_fn])")
    return LoadedModel(made[0], made[1], made[2] if len(made) == 3 else None)
