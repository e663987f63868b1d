"""A group's gradient all-reduce in buckets that leave while backward still runs, as DDP's reducer does.

The parameters are cut into buckets in reverse registration order (the last layers' gradients are
ready first), the first one small so that communication starts early. On the step that completes
the group's accumulation, a hook after each parameter's gradient accumulation adds ``n x p.grad``
(``n``: the samples this rank counted so far, divided by the GradScaler's scale under fp16) into the
parameter's slice of the group's accumulator, and when every parameter of a bucket is in, starts an
asynchronous all-reduce of that slice. Buckets start strictly in index order on every rank (a ready
bucket waits for the earlier ones): collectives pair up by order, not by name. At ``opt.step()``
the buckets still waiting (parameters without a gradient on this rank) start, and the group waits
for all of them before its small all-reduce of samples, flags and buffers (hybrid.py).

What left in a bucket can turn out wrong by the time ``opt.step()`` runs: a second backward added
to a gradient after its bucket left (accumulation inside the script), forwards counted after
backward changed ``n``, or the scale the hook divided by was not the step's. Each rank then knows
its own error exactly (``correction``) and raises a flag in the small all-reduce; when any member
raised one, every member all-reduces its correction (zeros if it has none) and adds the sum, so the
step ends where one all-reduce after backward would have put it, in the same order on every rank.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist

from .errors import TrainingError

BUCKET_MB = 25.0            # DDP's bucket_cap_mb: big enough that a bucket's latency does not dominate
FIRST_BUCKET_MB = 1.0       # DDP's first bucket: the last layers' gradients leave without waiting for more
BUCKET_ENV = "HGTRAIN_BUCKET_MB"

Collective = Callable[[Callable[[], Any], str], Any]


def resolve_bucket_mb(value: float | None, environ: Mapping[str, str]) -> float:
    """The bucket size in MiB: ``value`` (``ctx.wrap(..., bucket_mb=)``), else ``HGTRAIN_BUCKET_MB``,
    else :data:`BUCKET_MB`; 0 turns bucketing off (one all-reduce after backward)."""
    where = "bucket_mb"
    if value is None and environ.get(BUCKET_ENV, "").strip():
        where, text = BUCKET_ENV, environ[BUCKET_ENV].strip()
        try:
            value = float(text)
        except ValueError:
            raise TrainingError(f"{BUCKET_ENV}={text!r} is not a number of MiB (0 turns bucketing off)") from None
    if value is None:
        return BUCKET_MB
    if not value >= 0 or value == float("inf"):
        raise TrainingError(f"{where} must be a finite number of MiB >= 0 (0 turns bucketing off), not {value!r}")
    return float(value)


def plan_buckets(numels: Sequence[int], element_size: int, cap_mb: float,
                 first_cap_mb: float = FIRST_BUCKET_MB) -> list[tuple[int, int]]:
    """Index ranges ``[lo, hi)`` of the parameters in each bucket, the last parameters' first. A bucket
    closes once it holds ``cap_mb`` MiB (the first one ``min(first_cap_mb, cap_mb)``); each is a
    contiguous slice of the flat gradient, since it holds neighbouring parameters."""
    buckets: list[tuple[int, int]] = []
    cap = min(first_cap_mb, cap_mb) * 2 ** 20
    hi, size = len(numels), 0
    for i in reversed(range(len(numels))):
        size += numels[i] * element_size
        if size >= cap:
            buckets.append((i, hi))
            hi, size, cap = i, 0, cap_mb * 2 ** 20
    if hi > 0:
        buckets.append((0, hi))
    return buckets


class GradBuckets:
    """Hooks on ``params`` that reduce ``grads`` (the accumulator's gradient part, the parameters'
    gradients concatenated in order) bucket by bucket over ``pg`` while backward runs, on the steps
    where ``armed`` is set (the owner sets it for the step that completes the group's accumulation)."""

    def __init__(self, params: Sequence[torch.Tensor], grads: torch.Tensor, pg: Any, cap_mb: float, *,
                 samples: Callable[[], int], scale: Callable[[], torch.Tensor | None],
                 collective: Collective, untimed: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 pace: Callable[[], Any] = lambda: None) -> None:
        self.params = list(params)
        self.grads = grads
        self.pg = pg
        self.samples = samples
        # The live scale (a tensor) of the GradScaler whose scaled loss this backward is, or None.
        self.scale = scale
        self.collective = collective
        self.untimed = untimed
        # Device emulation's pacing (emulate.py Emulator.pace): a bucket that leaves during backward
        # leaves when the emulated device's backward would have reached it.
        self.pace = pace
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.buckets = plan_buckets([p.numel() for p in self.params], grads.element_size(), cap_mb)
        self.bucket_of = [0] * len(self.params)
        for b, (lo, hi) in enumerate(self.buckets):
            for i in range(lo, hi):
                self.bucket_of[i] = b
        self.armed = False
        self.launched_during_backward = 0    # buckets that left before opt.step() (the overlap)
        self.corrected_steps = 0             # steps this rank contributed a correction to
        self._reset()
        self._hooks = []
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_hook(functools.partial(self._before_accumulate, i)))
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i)))

    def _reset(self) -> None:
        self._n: list[int | None] = [None] * len(self.params)   # samples a parameter's gradient went in with
        self._sent: dict[int, torch.Tensor] = {}   # gradients as they went out, of parameters hit again
        self._late: set[int] = set()              # parameters a second backward added to
        self._ready = [0] * len(self.buckets)
        self._next = 0                             # the next bucket to start
        self._handles: list[Any] = []
        self._taken = False                        # a hook took a gradient this step
        self._hook_scale: torch.Tensor | None = None
        self._inv: torch.Tensor | None = None
        self._correction: torch.Tensor | None = None

    # --- hooks (on the autograd thread) ---------------------------------------------------------
    def _before_accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Before a second backward adds to a gradient already taken: keep it as it went out (only
        for such parameters), so the error is known exactly at the step."""
        if self.armed and self._n[i] is not None and i not in self._sent:
            g = self.params[i].grad
            self._sent[i] = (g.detach().reshape(-1).to(self.grads.dtype, copy=True) if g is not None
                             else torch.zeros_like(self.grads[self.offsets[i]: self.offsets[i + 1]]))

    def _accumulated(self, i: int, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if self._n[i] is not None:
            self._late.add(i)
            return
        # Copying the gradient is not the emulated device's backward: device emulation must not
        # stretch it (it happened after the step's compute before bucketing, too).
        with self.untimed():
            if not self._taken:                     # the step's first gradient: its scale
                self._taken = True
                scale = self.scale()
                if scale is not None:
                    self._hook_scale = scale.detach().clone()     # no device sync
                    self._inv = torch.reciprocal(self._hook_scale.float()).to(self.grads.device)
            n = self.samples()
            assert p.grad is not None
            g, part = p.grad.detach().reshape(-1), self.grads[self.offsets[i]: self.offsets[i + 1]]
            if self._inv is None:
                part.add_(g, alpha=float(n))
            else:
                part.addcmul_(g, self._inv, value=float(n))
            self._n[i] = n
            b = self.bucket_of[i]
            self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == self._size(self._next):
            self.pace()
            with self.untimed():
                self._launch()
            self.launched_during_backward += 1

    def _size(self, b: int) -> int:
        lo, hi = self.buckets[b]
        return hi - lo

    def _launch(self) -> None:
        lo, hi = self.buckets[self._next]
        part = self.grads[self.offsets[lo]: self.offsets[hi]]
        self._handles.append(self.collective(
            lambda: dist.all_reduce(part, group=self.pg, async_op=True), "all-reduce"))
        self._next += 1

    # --- at opt.step() --------------------------------------------------------------------------
    def finish(self, n: int, scale: float | None) -> bool:
        """At the pre-step of an armed step: ``n`` the samples of the step, ``scale`` the GradScaler's
        scale it unscaled ``p.grad`` by (None: no scaler stepped). Fixes what is still here, starts
        the buckets left and returns whether this rank has a correction for buckets already gone."""
        s = 1.0 if scale is None else scale
        hook_scale = 1.0 if self._hook_scale is None else float(self._hook_scale)
        for i, p in enumerate(self.params):
            delta = self._delta(i, p.grad, n, s, hook_scale)
            if delta is None:
                continue
            part = slice(self.offsets[i], self.offsets[i + 1])
            if self.bucket_of[i] >= self._next:
                self.grads[part].add_(delta)              # its bucket has not left yet
            else:
                if self._correction is None:
                    self._correction = torch.zeros_like(self.grads)
                self._correction[part].add_(delta)
        while self._next < len(self.buckets):
            self._launch()
        if self._correction is not None:
            self.corrected_steps += 1
        return self._correction is not None

    def _delta(self, i: int, grad: torch.Tensor | None, n: int, s: float, hook_scale: float) -> torch.Tensor | None:
        """What parameter ``i`` should have contributed (``n x p.grad``, ``p.grad`` unscaled by the
        step's scale ``s``) minus what it did (``n_i x g / hook_scale``, ``g`` the gradient when its
        hook ran); None when they agree. Without a second backward ``g = s x p.grad``."""
        n_i = self._n[i]
        now = None if grad is None else grad.detach().reshape(-1).to(self.grads.dtype)
        if n_i is None:                                   # no hook ran: nothing went out
            return None if now is None else now * float(n)
        if i in self._late and i in self._sent:
            went = self._sent[i] * (n_i / hook_scale)
            return went.neg_() if now is None else now * float(n) - went
        if now is None or (n_i == n and hook_scale == s):
            return None
        return now * (n - n_i * s / hook_scale)

    def wait(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            self.collective(h.wait, "all-reduce")

    def correction(self) -> torch.Tensor:
        """This rank's correction (zeros if it has none), once any member flagged one."""
        return self._correction if self._correction is not None else torch.zeros_like(self.grads)

    def end_step(self) -> None:
        self._reset()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
