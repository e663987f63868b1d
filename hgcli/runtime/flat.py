"""Tensors as one flat vector and back: what a broadcast of a group's state and a PS push or answer carry."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' values concatenated (a copy), in their common dtype."""
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def load(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (converting to each one's dtype)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def fill(state: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]],
         tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` (``tensors`` concatenated) into ``state`` under every name those tensors have."""
    names: dict[int, list[str]] = {}
    for name, t in named:
        names.setdefault(id(t), []).append(name)
    offset = 0
    for t in tensors:
        for name in names.get(id(t), []):
            if name in state:
                state[name].copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def synced_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers averaged across a group's ranks: floating-point and persistent (in the state dict),
    such as BatchNorm's running mean and variance. Counters (``num_batches_tracked``) stay each
    rank's own, and non-persistent buffers are caches or constants the model rebuilds: averaging
    them would only cost bandwidth."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if (b is not None and b.is_floating_point() and name not in module._non_persistent_buffers_set
                    and id(b) not in seen):
                seen.add(id(b))
                out.append(b)
    return out
