"""The user's optimizer as the parameter servers rebuild it (hybrid plans).

A worker describes its optimizer once, in the seed, as an :data:`OptimizerSpec` per PS shard: the
class by its qualified name (any class the nodes can import: ``torch.optim.*`` or a user's module),
its constructor defaults, and every parameter group with the positions of its tensors on that shard
and its own hyperparameters. The shard builds the same class over its tensors with the same groups.

Schedulers change hyperparameters on the worker, whose optimizer never steps under hybrid (its
state lives on the PS). So every push carries, per group, the learning rate and any other
hyperparameter that now differs from the seeded value (:func:`push_hyperparameters`); the PS
resets each group to its seeded values and applies those (:func:`apply_hyperparameters`). The
push is then stateless: what the PS steps with does not depend on which group pushed before.

Pure functions of torch objects: unit-tested in process.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Mapping, Sequence, TypedDict

import torch

from ..errors import TrainingError

# Constructor flags that choose kernels for the worker's device (CUDA graphs, fused CUDA kernels,
# foreach implementations), not the maths. The PS steps CPU tensors and picks its own
# (build_fast_optimizer).
DEVICE_FLAGS = frozenset({"foreach", "fused", "capturable"})


class GroupSpec(TypedDict):
    """One parameter group of an optimizer as the PS rebuilds it: its tensors in the shard and its
    options."""
    params: list[int]               # positions, in the shard's tensor list, of this group's tensors
    options: dict[str, Any]         # the group's constructor hyperparameters (lr, weight_decay, ...)


class OptimizerSpec(TypedDict):
    """The user's optimizer as a PS shard rebuilds it: its class by module and name, and its
    parameter groups over the shard's tensors."""
    module: str
    qualname: str
    defaults: dict[str, Any]
    groups: list[GroupSpec]


Hyperparameters = list[dict[str, Any]]   # per parameter group, what a push sets on the PS


def class_path(cls: type) -> tuple[str, str]:
    """(module, qualname) under which the PS ranks will import ``cls``; raises TrainingError naming
    the class when it cannot be imported by that name (the PS ranks run ``python -m
    hgcli.runtime.ps``, not the training script, so a class defined in the script is unknown there)."""
    module, qualname = cls.__module__, cls.__qualname__
    name = f"{module}.{qualname}"
    if module == "__main__":
        raise TrainingError(
            f"the optimizer class {qualname} ({name}) is defined in the training script itself: the "
            f"parameter-server ranks run 'python -m hgcli.runtime.ps' and cannot import it. Move it "
            f"into a module of its own that the nodes can import (next to the script or on "
            f"PYTHONPATH) and import it from there")
    if "<locals>" in qualname:
        raise TrainingError(f"the optimizer class {name} is defined inside a function: the "
                            f"parameter-server ranks cannot import it by name; define it at module level")
    try:
        found = resolve_class(module, qualname)
    except TrainingError as exc:
        raise TrainingError(f"{exc} (the parameter-server ranks import it by this name)") from exc
    if found is not cls:
        raise TrainingError(f"the optimizer class {name} is not what that name imports "
                            f"({found!r}): the parameter-server ranks would run another class")
    return module, qualname


def resolve_class(module: str, qualname: str) -> type[torch.optim.Optimizer]:
    name = f"{module}.{qualname}"
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise TrainingError(f"optimizer class {name} cannot be imported: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise TrainingError(f"{name} is not a torch.optim.Optimizer class")
    return obj


def group_options(group: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's constructor hyperparameters: only keys the optimizer declares in its
    defaults (schedulers add their own keys, such as ``initial_lr``, which are the worker's business)."""
    return {k: group[k] for k in defaults if k in group and k != "params" and k not in DEVICE_FLAGS}


def group_indices(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                  frozen: Sequence[torch.Tensor] = ()) -> list[list[int]]:
    """For each parameter group, the indices in ``params`` (the model's trainable parameters, the
    order the runtime flattens them in) of its tensors. Frozen parameters are skipped (they never have
    a gradient); a tensor that is not the model's cannot live on the PS and is an error."""
    index = {id(p): i for i, p in enumerate(params)}
    skip = {id(p) for p in frozen}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        mine = []
        for p in group["params"]:
            if id(p) in index:
                mine.append(index[id(p)])
            elif id(p) not in skip:
                raise TrainingError(f"parameter group {g} of the optimizer holds a tensor of shape "
                                    f"{tuple(p.shape)} that is not a parameter of the wrapped model: "
                                    f"the parameter servers hold only the model's parameters")
        out.append(mine)
    return out


def segment_spec(optimizer: torch.optim.Optimizer, module: str, qualname: str,
                 segment_groups: Sequence[int]) -> OptimizerSpec:
    """The spec one shard builds its optimizer from; ``segment_groups``: the parameter group of each
    of the shard's tensors (shards.Segment.group; -1: in no group, never stepped). Every group is
    kept, empty ones too, so group i is group i on every shard and in every push."""
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "params" and k not in DEVICE_FLAGS}
    groups: list[GroupSpec] = [
        {"params": [pos for pos, sg in enumerate(segment_groups) if sg == g],
         "options": group_options(group, optimizer.defaults)}
        for g, group in enumerate(optimizer.param_groups)]
    return {"module": module, "qualname": qualname, "defaults": defaults, "groups": groups}


def normalise_spec(spec: Mapping[str, Any], n_params: int) -> OptimizerSpec:
    """Specs of older checkpoints (``{"name": "SGD", "kwargs": {...}}``: a torch.optim class, one group)."""
    if "groups" in spec:
        return spec  # type: ignore[return-value]
    return {"module": "torch.optim", "qualname": spec["name"], "defaults": dict(spec["kwargs"]),
            "groups": [{"params": list(range(n_params)), "options": {}}]}


def constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the constructor accepts. ``defaults`` is what the optimizer stored, which is not
    always what its constructor takes (AdamW stores ``decoupled_weight_decay`` for Adam's sake but does
    not accept it); every group carries all its options anyway, so nothing is lost."""
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}


def build_optimizer(params: Sequence[torch.Tensor], spec: Mapping[str, Any],
                    kernel: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
    """The PS's optimizer over its shard's tensors (the worker builds one too, at wrap time, to refuse
    a spec the PS could not build before anything is sent); ``kernel``: implementation flags
    (``{"fused": True}``) on top of the spec's defaults."""
    full = normalise_spec(spec, len(params))
    cls = resolve_class(full["module"], full["qualname"])
    groups = [{"params": [params[i] for i in g["params"]], **g["options"]} for g in full["groups"]]
    try:
        return cls(groups, **{**constructor_kwargs(cls, full["defaults"]), **(kernel or {})})
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TrainingError(f"optimizer {full['module']}.{full['qualname']} cannot be built on the "
                            f"parameter server: {exc}") from exc


def build_fast_optimizer(params: Sequence[torch.Tensor], spec: Mapping[str, Any]
                         ) -> tuple[torch.optim.Optimizer, str]:
    """The PS's optimizer, as :func:`build_optimizer` builds it but with torch's fused implementation
    where the class has one (Adam, AdamW, SGD, Adagrad: one multi-threaded kernel over each tensor),
    else its foreach one; returns it and the implementation's name ("fused", "foreach", "default")."""
    full = normalise_spec(spec, len(params))
    try:
        accepted = inspect.signature(resolve_class(full["module"], full["qualname"])).parameters
    except (TypeError, ValueError):
        accepted = {}   # type: ignore[assignment]
    for impl in ("fused", "foreach"):
        if impl in accepted:
            try:
                return build_optimizer(params, spec, {impl: True}), impl
            except TrainingError:
                continue     # not for these tensors (or this torch): the next implementation
    return build_optimizer(params, spec), "default"


def same_structure(a: OptimizerSpec, b: OptimizerSpec) -> bool:
    """Whether a checkpointed optimizer's state fits the optimizer a new job seeds: same class,
    same groups over the same tensors."""
    return (resolve_class(a["module"], a["qualname"]) is resolve_class(b["module"], b["qualname"])
            and [g["params"] for g in a["groups"]] == [g["params"] for g in b["groups"]])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu())))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def push_hyperparameters(optimizer: torch.optim.Optimizer, seeded: Sequence[dict[str, Any]]
                         ) -> Hyperparameters:
    """Per group: its learning rate (what schedulers change nearly every step) and whatever else
    differs from the seeded options (OneCycleLR's momentum, say); nothing else travels."""
    out = []
    for group, base in zip(optimizer.param_groups, seeded):
        lr = group["lr"]
        changed = {k: group[k] for k, v in base.items() if k != "lr" and k in group and not _same(group[k], v)}
        out.append({"lr": float(lr) if isinstance(lr, torch.Tensor) else lr, **changed})
    return out


def apply_hyperparameters(optimizer: torch.optim.Optimizer, seeded: Sequence[GroupSpec],
                          hyper: Hyperparameters) -> None:
    """On the PS, before its step: each group back to its seeded options, then the push's values."""
    if len(hyper) != len(optimizer.param_groups):
        raise TrainingError(f"a push carries hyperparameters for {len(hyper)} parameter groups, the "
                            f"parameter server's optimizer has {len(optimizer.param_groups)}")
    for group, spec, values in zip(optimizer.param_groups, seeded, hyper):
        group.update(spec["options"])
        group.update(values)
