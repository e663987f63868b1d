"""A rank's device memory: what a training step holds, counted from its tensors, and an emulated
device's declared memory enforced as CUDA's allocator would enforce a real card's.

The CPU allocator keeps no peak, so the step's memory is counted from its tensors, as the step bench
counts it (hgcli/node/bench/step.py uses ``LiveStorages`` and ``training_state`` from here): the
distinct storages of the parameters as this rank holds them (an fsdp group's: its local shards),
their gradients, the optimizer's state, the forward's inputs, and every tensor autograd saves for
backward (the activations; in an fsdp group also the units' gathered parameters, which FSDP2 frees
by resizing their storage to 0, so a storage counts at its size at each moment). Temporaries freed
inside an operator, gradients FSDP2 keeps unsharded between micro-batches and allocator overhead
are not counted: a lower bound of the true peak, like the bench's.

Counting is cheap because it is rare: a step is accounted only when its micro-batch is larger than
any accounted before (the first step, and after an adaptation grows the batch), so the steady state
pays one comparison per forward. An emulated device with ``memory_mib`` (RankPlan.memory_mib) then
fails that step, at the end of its forward or at its optimizer step, with ``DeviceOutOfMemory``:
torch's ``OutOfMemoryError`` (what a script catches for CUDA) and a ``TrainingError``; uncaught, it
ends the rank with its one line on stderr and exit code 1, no traceback.
"""
from __future__ import annotations

import contextlib
import resource
import sys
from types import TracebackType
from typing import Any, Callable, ContextManager, Iterable

import torch

from ..schema.records import FinishMemory
from .errors import TrainingError

MIB = 1 << 20


class DeviceOutOfMemory(torch.OutOfMemoryError, TrainingError):
    """A step needs more than the emulated device's memory: what CUDA raises for a real card."""


class LiveStorages:
    """Distinct tensor storages, each counted once, at its size now. Keyed by address and holding the
    storage itself: a storage freed mid-step (an activation after backward) could otherwise hand its
    address to a gradient and be counted once for two. ``skip``: addresses counted elsewhere."""

    def __init__(self, skip: Iterable[int] = ()) -> None:
        self._held: dict[int, Any] = {}
        self._skip = frozenset(skip)

    @classmethod
    def of(cls, tensors: Iterable[Any]) -> "LiveStorages":
        storages = cls()
        storages.note_all(tensors)
        return storages

    def note(self, t: Any) -> Any:
        """Count ``t``'s storage (anything else is ignored); returns ``t``, so it can be a pack hook."""
        storage = _storage(t)
        if storage is not None:
            address = storage.data_ptr()
            if address and address not in self._skip:
                self._held[address] = storage
        return t

    def note_all(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            self.note(t)

    def addresses(self) -> set[int]:
        return set(self._held)

    def nbytes(self) -> int:
        return sum(storage.nbytes() for storage in self._held.values())


def training_state(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Any]:
    """The tensors of a training state: the parameters, their gradients, the optimizer's state."""
    params = list(params)
    out: list[Any] = [*params, *(p.grad for p in params)]
    for state in optimizer.state.values():
        out.extend(state.values())
    return out


def _storage(t: Any) -> Any:
    """The storage of ``t``'s local data (a DTensor's: this rank's shard); None for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "to_local", None)      # a DTensor: its local shard
    try:
        return (local() if callable(local) else t).untyped_storage()
    except (RuntimeError, NotImplementedError):   # tensors without storage (wrappers, meta)
        return None


class MemoryAccountant:
    """Counts the peak of the steps of a wrapped model whose micro-batch is larger than any counted
    before; with ``cap_mib``, raises ``DeviceOutOfMemory`` for a step above it. ``device`` names the
    device in that message; ``count_state`` False: the state lives in host memory (FSDP2's offload)
    and only the forward's tensors count; ``untimed``: the emulator's, so counting is not stretched."""

    def __init__(self, *, cap_mib: int | None, device: str, count_state: bool = True,
                 untimed: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self.cap_mib = cap_mib
        self.device = device
        self.count_state = count_state
        self.accounted = 0              # steps counted: the first, and each of a larger micro-batch
        self.peak_bytes = 0             # the largest step counted
        self._untimed = untimed
        self._largest = 0
        self._batch = 0
        self._params: list[torch.Tensor] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._saved: LiveStorages | None = None
        self._saved_peak = 0
        self._hooks: ContextManager[None] | None = None
        self._handles: list[Any] = []

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``module`` (the one the script trains through) and the optimizer it steps."""
        self._params = list(module.parameters())     # as held between steps: an fsdp group's shards
        self._optimizer = optimizer
        self._handles = [module.register_forward_pre_hook(self._before_forward),
                         module.register_forward_hook(self._after_forward),
                         optimizer.register_step_post_hook(self._after_step)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._leave_forward()

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self._saved is not None or not (module.training and torch.is_grad_enabled()):
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        batch = (first.shape[0] if first.dim() else 1) if first is not None else 0
        if batch <= self._largest:
            return
        self._largest = self._batch = batch
        self.accounted += 1
        with self._untimed():
            self._saved = LiveStorages(skip=LiveStorages.of(self._params).addresses())
            self._saved.note_all(args)
            self._saved_peak = self._saved.nbytes()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        assert self._saved is not None      # the hooks are entered only with a count under way
        self._saved.note(t)
        self._saved_peak = max(self._saved_peak, self._saved.nbytes())
        return t

    def _after_forward(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._hooks is None:
            return
        self._leave_forward()
        # Gradients and optimizer state of earlier steps are held already: a step can fail here.
        self._check(self._state_bytes() + self._saved_peak)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved is None or self._hooks is not None:
            return
        need = self._state_bytes() + self._saved_peak
        self._saved = None                  # the step's tensors are its own again
        self._check(need)

    def _leave_forward(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _state_bytes(self) -> int:
        if not self.count_state or self._optimizer is None:
            return 0
        with self._untimed():
            return LiveStorages.of(training_state(self._params, self._optimizer)).nbytes()

    def _check(self, need: int) -> None:
        self.peak_bytes = max(self.peak_bytes, need)
        if self.cap_mib is not None and need > self.cap_mib * MIB:
            self._saved = None
            raise DeviceOutOfMemory(
                f"emulated device out of memory: a step at micro-batch {self._batch} needs {need / MIB:.1f} MiB, "
                f"{self.device} has {self.cap_mib} MiB (a smaller batch, more micro-batches, or "
                f"--engine auto, which shards what a device cannot hold)")


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t



class MemoryWatch:
    """A rank's memory figures for its finish record: the accounted peak (CPU devices, emulated or
    not), the growth of the process's peak RSS since the runtime started, and on a real GPU torch's
    ``max_memory_allocated``."""

    def __init__(self, device: torch.device, *, cap_mib: int | None, label: str, offloaded: bool,
                 untimed: Callable[[], ContextManager[None]]) -> None:
        self.device = device
        self._rss0 = max_rss_bytes()
        self.accountant = MemoryAccountant(cap_mib=cap_mib, device=label, count_state=not offloaded,
                                           untimed=untimed) if device.type == "cpu" else None
        if cap_mib is not None and self.accountant is not None:
            one_line_on_exit()

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Count the steps of ``module`` (what the script trains through) and ``optimizer``."""
        if self.accountant is not None:
            self.accountant.attach(module, optimizer)

    def figures(self) -> FinishMemory:
        accounted = self.accountant.peak_bytes if self.accountant is not None else 0
        cuda = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return FinishMemory(accounted_peak_mib=_mib(accounted) if accounted else None,
                            peak_rss_growth_mib=_mib(max(0, max_rss_bytes() - self._rss0)),
                            cuda_max_allocated_mib=None if cuda is None else _mib(cuda))


def _mib(n: int) -> float:
    return round(n / MIB, 3)


def max_rss_bytes() -> int:
    """The process's peak resident set so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def one_line_on_exit() -> None:
    """An uncaught ``DeviceOutOfMemory`` ends the rank with its one line, as hgtrain's own errors
    do, not a traceback through the script's loop and torch's hooks (the launcher shows a failed
    rank's last lines); exit code 1 as for any uncaught exception. Other exceptions as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, DeviceOutOfMemory):
            print(f"hgtrain: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    sys.excepthook = hook
