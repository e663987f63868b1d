"""Training-step time of a model at several batch sizes, with peak memory: the planner's time(batch).

A step is a step of the runtime's training loop (``runtime_step``): fetch the batch, forward + loss +
backward, ``loss.item()`` and a metrics line, and the optimizer step (SGD with momentum: one state
tensor per parameter, like most data-parallel recipes) through the runtime's own hooks
(hgcli/runtime/group/engine.py: sample counting, gradient accumulation). Its fixed cost per step is what
decides small models run with small batches (a small model's bare step is a fraction of a
millisecond), so it is measured, not assumed. Peak memory on a GPU is the CUDA caching allocator's
``max_memory_allocated``; on a CPU (and so on emulated devices) it is counted from the tensors a step
keeps alive (see ``accounted_step_bytes``), because the CPU allocator keeps no peak statistics.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ...schema.stages import StepSample
from .failure import is_oom
from .modelspec import LoadedModel
from .timing import WALL, Clock, summarize, time_repeats

if TYPE_CHECKING:
    from ...runtime.emulate import Emulator, StableSpeed

MIB = 1 << 20


class OutOfMemory(Exception):
    """A batch did not fit: a real allocation failure, or over an emulated device's capacity."""


def step_samples(torch: Any, loaded: LoadedModel, device: Any, batch_sizes: tuple[int, ...], *,
                 warmup: int, repeats: int, sync: Callable[[], object],
                 clock: Clock = WALL,
                 memory_cap_mib: int | None,
                 emulated_speed: float | None = None,
                 on_batch: Callable[[int], None]) -> Iterator[StepSample]:
    """One StepSample per batch size, smallest first; raises OutOfMemory at the first that fails.

    ``memory_cap_mib`` (emulated devices) is checked against the accounted peak before timing, so
    an emulated 16 GiB card refuses a batch a 16 GiB card could not hold.

    ``emulated_speed``: the step is timed as the runtime's emulator runs it (hgcli/runtime/
    emulate.py stretches forward and backward to 1/speed but not the optimizer step, which runs
    after the step's compute has ended): each timing is forward+backward + speed x optimizer, so
    that the profile's 1/speed scaling (node/bench.py) gives forward+backward / speed + optimizer.
    The clock's rest (the emulator's pause) comes where the runtime's does: between backward and the
    optimizer, so the caches the pause leaves cold are refilled by the unstretched optimizer, as in
    training; after the optimizer, the next forward would pay for them x 1/speed, a large share of a
    slow device's fixed cost at small batches (benchmarks/RESULTS.md, "Bench"). Below
    speed 1 the forward+backward part is the emulator's stable estimate (``StableSpeed``: the lower
    quartile of the recent calls of this batch size), which is what the runtime stretches.
    """
    from ...runtime.emulate import StableSpeed

    model = loaded.model.to(device)
    model.train()
    stable = StableSpeed() if emulated_speed is not None and emulated_speed < 1.0 else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = loaded.loss_fn or default_loss(torch)
    on_gpu = device.type == "cuda"
    with runtime_hooks(model, optimizer, default_batch=min(batch_sizes)) as emit:
        yield from _samples(torch, model, optimizer, loss_fn, loaded, device, batch_sizes, emit,
                            warmup=warmup, repeats=repeats, sync=sync, clock=clock, on_gpu=on_gpu,
                            memory_cap_mib=memory_cap_mib, emulated_speed=emulated_speed,
                            stable=stable, on_batch=on_batch)


@contextlib.contextmanager
def runtime_hooks(model: Any, optimizer: Any, *, default_batch: int,
                  emulator: Emulator | None = None) -> Iterator[Callable[..., None]]:
    """Attach the runtime's per-step machinery to ``model`` and ``optimizer`` as a one-rank group
    without PS would (runtime/group/engine.py: sample counting and the step hooks; no DDP and no
    collective in a group of one; accumulate 1, so every step takes the optimizer), with
    ``emulator`` (default: speed 1, bookkeeping and no pause; the step bench pauses on its own
    clock). Yields the metrics line emitter, writing to /dev/null like a pipe nobody slows."""
    from ...runtime.emulate import Emulator
    from ...runtime.group.engine import GroupEngine, GroupSpec
    from ...runtime.metrics import MetricsSink

    fd = os.open(os.devnull, os.O_WRONLY)
    sink = MetricsSink(fd, {"rank": 0, "group": 0, "role": "worker"})
    sync = GroupEngine(model=model, optimizer=optimizer, emulator=emulator or Emulator(1.0), metrics=sink, timeout_s=60.0,
                       spec=GroupSpec(rank=0, group_id=0, ranks=(0,), pg=None, batches=(default_batch,),
                                      default_batch=default_batch))
    sync.start()
    try:
        yield sink.emit
    finally:
        sync.finish()            # removes the hooks (no PS: nothing to wait for)
        os.close(fd)


def _samples(torch: Any, model: Any, optimizer: Any, loss_fn: Callable[[Any, Any], Any], loaded: LoadedModel,
             device: Any, batch_sizes: tuple[int, ...], emit: Callable[..., None], *, warmup: int,
             repeats: int, sync: Callable[[], object], clock: Clock, on_gpu: bool,
             memory_cap_mib: int | None, emulated_speed: float | None, stable: StableSpeed | None,
             on_batch: Callable[[int], None]) -> Iterator[StepSample]:
    for batch_size in sorted(batch_sizes):
        on_batch(batch_size)
        try:
            inputs, targets = loaded.make_batch(batch_size, device)
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            # The runtime's batches are gathered from the dataset by a permutation (runtime/data/blocks.py).
            order = torch.randperm(batch_size, device=device)
            tensors = (*args, targets)

            parts: list[tuple[float, float]] = []   # (stretched, host) seconds of each call

            def step() -> None:
                start = clock.now()
                *xb, yb = (t[order] if isinstance(t, torch.Tensor) and t.dim() else t for t in tensors)
                loss = loss_fn(model(*xb), yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                value = loss.item()
                stretched = clock.now() - start
                if stable is not None:       # what the runtime's emulator stretches (runtime/emulate.py)
                    stretched = stable.observe(batch_size, stretched)
                # The emulator pauses here, at the end of the step's compute (the optimizer's pre-hook),
                # so the cold caches after the pause fall on the optimizer, not on the next forward.
                clock.rest(stretched)
                # Not stretched by emulation, in the runtime: the optimizer with its hooks (after the
                # emulator's end of compute) and the metrics line (ctx.log is untimed).
                start = clock.now()
                optimizer.step()
                emit(step=0, loss=value, samples=batch_size)
                parts.append((stretched, clock.now() - start))

            if on_gpu:
                torch.cuda.reset_peak_memory_stats(device)
            else:
                peak = accounted_step_bytes(torch, model, optimizer, args, targets, loss_fn)
                if memory_cap_mib is not None and peak > memory_cap_mib * MIB:
                    raise OutOfMemory(f"out of memory at batch {batch_size}: a step needs "
                                      f"{peak / MIB:.1f} MiB, the emulated device has {memory_cap_mib} MiB")
            # The step rests inside itself (above), so time_repeats must not rest again after it.
            seconds = time_repeats(step, warmup=warmup, repeats=repeats, sync=sync,
                                   clock=Clock(now=clock.now))
            if emulated_speed is not None:
                seconds = [f + emulated_speed * o for f, o in parts[-len(seconds):]]
            if on_gpu:
                peak = torch.cuda.max_memory_allocated(device)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            if on_gpu:
                torch.cuda.empty_cache()
            raise OutOfMemory(f"out of memory at batch {batch_size}") from exc
        yield StepSample(batch_size=batch_size, seconds=summarize(seconds), memory_mib=-(-peak // MIB))


def accounted_step_bytes(torch: Any, model: Any, optimizer: Any, args: tuple[Any, ...], targets: Any,
                         loss_fn: Callable[[Any, Any], Any]) -> int:
    """Bytes of the distinct tensor storages one step keeps alive: parameters, gradients, optimizer
    state, the batch, and every tensor autograd saves for backward (the activations), counted as the
    runtime counts an emulated device's steps (hgcli/runtime/memory.py).

    It runs one real, untimed step. Temporaries freed inside an operator and allocator overhead are
    not counted, so this is a lower bound of the true peak; documented as an estimate.
    """
    from ...runtime.memory import LiveStorages, training_state

    held = LiveStorages.of((*args, targets))
    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(held.note, lambda t: t):
        loss = loss_fn(model(*args), targets)
    loss.backward()
    optimizer.step()
    held.note_all(training_state(model.parameters(), optimizer))
    return held.nbytes()


def default_loss(torch: Any) -> Callable[[Any, Any], Any]:
    def loss(output: Any, targets: Any) -> Any:
        if targets.dtype in (torch.int64, torch.int32):
            return torch.nn.functional.cross_entropy(output, targets)
        return torch.nn.functional.mse_loss(output, targets)

    return loss
