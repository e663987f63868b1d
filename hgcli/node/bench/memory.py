"""What the benched model needs in device memory: its training state and its activations per batch
(``MemoryProfile``), for the planner's memory model (docs/planning.md, "Memory").

The parameters are counted from the model; the state is computed from them for AdamW (parameters,
gradients and two moments of the parameters' dtype), the optimizer most scripts train with; the
activations are what the step bench measured at each batch size (``StepSample.memory_mib``) less the
state that step held (parameters, gradients and SGD's momentum: the bench steps SGD).
"""
from __future__ import annotations

from typing import Any, Iterable

from ...schema.profiles import ActivationSample, MemoryProfile, StepSample

MIB = 1 << 20
# Copies of the parameters in AdamW's training state: the parameters, their gradients, two moments.
ADAMW_STATE_COPIES = 4
# The same for the bench's own step (SGD with momentum): parameters, gradients, one momentum buffer.
BENCH_STATE_COPIES = 3


def model_memory(model: Any) -> MemoryProfile:
    """The model's parameter bytes, its AdamW state and its largest FSDP unit, as the runtime's
    sharded engine would wrap it (hgcli/runtime/group/fsdp.py: each nn.ModuleList child, then the
    root with the rest); no activations yet (``with_activations``)."""
    from ...runtime.group.fsdp import shard_units

    sizes = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    owned: set[int] = set()
    units = []
    for _, module in shard_units(model, None):       # deepest first: a parameter is its deepest unit's
        mine = [i for i in (id(p) for p in module.parameters()) if i not in owned]
        owned.update(mine)
        units.append(sum(sizes[i] for i in mine))
    units.append(sum(size for i, size in sizes.items() if i not in owned))    # the root's own
    total = sum(sizes.values())
    return MemoryProfile(parameter_bytes=total, state_bytes=ADAMW_STATE_COPIES * total,
                         largest_unit_bytes=max(units))


def with_activations(memory: MemoryProfile, steps: Iterable[StepSample]) -> MemoryProfile:
    """``memory`` with the activations of every step that measured its peak: the peak less the
    bench's state (BENCH_STATE_COPIES x the parameters), never below 0."""
    held = BENCH_STATE_COPIES * memory.parameter_bytes
    activations = tuple(ActivationSample(s.batch_size, max(0, s.memory_mib * MIB - held))
                        for s in sorted(steps, key=lambda s: s.batch_size)
                        if s.memory_mib is not None and s.batch_size > 0)
    return MemoryProfile(memory.parameter_bytes, memory.state_bytes, memory.largest_unit_bytes, activations)
