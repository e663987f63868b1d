"""Shard a model over its group with torch's FSDP2 (``fully_shard`` on a DeviceMesh of the group's
own process group).

Which modules become FSDP units: each child of every ``nn.ModuleList`` (a transformer's blocks), then
the root, as torchtitan wraps a model. Each unit all-gathers its parameters just before its forward
and frees them after, so a rank holds one block's full parameters at a time besides its own shards;
the root holds what is left (embeddings, heads, norms). A name pattern (``--shard-modules``, i.e.
``HGTRAIN_SHARD_MODULES``; ``fnmatch`` on ``named_modules()`` names, e.g. ``encoder.layer.*``)
chooses the units instead. Units are wrapped deepest first, as FSDP2 requires of nested units.

Activation checkpointing (``--activation-checkpointing``, i.e. ``HGTRAIN_ACTIVATION_CHECKPOINT=1``):
each unit below the root keeps only its input from the forward and recomputes its activations in
backward, trading about one more forward for the activations of all but one block at a time. It is
torch's composable ``checkpoint`` (torch.distributed._composable), applied to each unit before
``fully_shard`` as torchtitan does; unlike ``checkpoint_wrapper`` it keeps the modules' names, so the
optimizer's rebuild and the state dicts see the same parameter names. Units nested in one another
are checkpointed at the outermost only (a recomputation inside a recomputation saves nothing).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..env import ACTIVATION_CHECKPOINT_ENV, FSDP_BF16_ENV, FSDP_OFFLOAD_ENV, SHARD_ENV, flag
from ..errors import TrainingError


@dataclass(frozen=True)
class ShardOptions:
    """How a group shards its model: ``pattern`` (None: each child of every ModuleList), ``bf16``
    (FSDP2's mixed precision: bf16 parameters in forward and backward, the fp32 shards kept),
    ``offload`` (the shards, their gradients and the optimizer's step on the CPU),
    ``checkpoint_activations`` (each unit's activations recomputed in backward)."""

    pattern: str | None = None
    bf16: bool = False
    offload: bool = False
    checkpoint_activations: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "ShardOptions":
        pattern = environ.get(SHARD_ENV, "").strip() or None
        return cls(pattern=pattern, bf16=flag(environ, FSDP_BF16_ENV), offload=flag(environ, FSDP_OFFLOAD_ENV),
                   checkpoint_activations=flag(environ, ACTIVATION_CHECKPOINT_ENV))


def shard_units(model: torch.nn.Module, pattern: str | None) -> list[tuple[str, torch.nn.Module]]:
    """The modules that become FSDP units below the root, by qualified name, deepest first; only
    modules that hold parameters (a unit of none would gather nothing)."""
    if pattern is None:
        chosen = [(f"{name}.{i}" if name else str(i), child) for name, module in model.named_modules()
                  if isinstance(module, torch.nn.ModuleList) for i, child in enumerate(module)]
    else:
        chosen = [(name, module) for name, module in model.named_modules()
                  if name and fnmatch.fnmatchcase(name, pattern)]
        if not chosen:
            raise TrainingError(f"{SHARD_ENV} / --shard-modules {pattern!r} matches no module of "
                                f"{type(model).__name__} (names as model.named_modules() gives them, "
                                f"e.g. {_examples(model)})")
    with_params = [(name, module) for name, module in chosen if any(True for _ in module.parameters())]
    if pattern is not None and not with_params:
        raise TrainingError(f"{SHARD_ENV} / --shard-modules {pattern!r} matches only modules without "
                            f"parameters ({', '.join(name for name, _ in chosen[:4])}): nothing to shard")
    # named_modules() lists a parent before its children: reversed, every child comes first.
    return with_params[::-1]


def shard(model: torch.nn.Module, pg: Any, device: torch.device, options: ShardOptions,
          roots: Sequence[torch.nn.Module] | None = None) -> torch.nn.Module:
    """``fully_shard`` each unit, then the root, over ``pg``; returns the model itself (FSDP2 makes
    it an ``FSDPModule`` in place). ``roots``: the modules sharded last instead of ``model``, for a
    model whose own forward is never called (a LightningModule: Lightning calls ``training_step``,
    and FSDP2 gathers a unit's parameters around its forward)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not any(p.requires_grad for p in model.parameters()):
        raise TrainingError(f"{type(model).__name__} has no trained parameters: an fsdp group has "
                            f"nothing to shard (plan it with --engine ddp)")
    if pg is None:
        raise TrainingError("an fsdp group needs a process group: run the script under 'hgtrain launch', "
                            "hgcli.local or torchrun")
    units = shard_units(model, options.pattern)
    if options.checkpoint_activations:
        checkpoint_units(model, units)
    mesh = DeviceMesh.from_group(pg, device.type)
    mp = MixedPrecisionPolicy()
    if options.bf16:
        # Gloo reduces bf16 no better than fp32 and in fewer builds: fp32 reductions there.
        reduce = torch.bfloat16 if device.type == "cuda" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    # Pinned host memory needs an accelerator: a CPU group offloads to pageable memory.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if options.offload else OffloadPolicy()
    for _, module in units:
        fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for root in (model,) if roots is None else roots:
        fully_shard(root, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def checkpoint_units(model: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]) -> None:
    """Torch's composable activation checkpointing on each outermost unit (``units`` deepest first,
    as :func:`shard_units` gives them); refused in one line where there is no unit below the root."""
    from torch.distributed._composable import checkpoint

    if not units:
        raise TrainingError(f"{ACTIVATION_CHECKPOINT_ENV} / --activation-checkpointing: {type(model).__name__} "
                            f"has no unit below the root to checkpoint (no nn.ModuleList; name its blocks "
                            f"with --shard-modules)")
    names = [name for name, _ in units]
    for name, module in units:
        if not any(name.startswith(other + ".") for other in names):
            checkpoint(module)


def _examples(model: torch.nn.Module) -> str:
    names = [name for name, _ in model.named_modules() if name][:4]
    return ", ".join(names) if names else "none: the model has no submodules"
