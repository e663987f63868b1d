"""A group leader's buffers for the PS exchange: the push it sends and the answer it receives.

Both are host tensors of the whole flat vector in the layout's order (ps/shards.py), allocated once and
reused at every step; a shard's part is a slice. On a CUDA leader they are pinned, and the copies
between them and the device run ``non_blocking`` on a side stream of their own, through one device
buffer of the flat vector: the gradients are copied into it on the training stream, copied to
the host on the side stream while the training stream goes on, and an answer comes back the same
way, its parameters loaded by one foreach copy that the training stream then waits for. On the CPU
the gradients are copied straight into the push buffer, and the answer straight into the
parameters, by one foreach copy each.

Under the bf16 wire the push buffer holds bf16. The error feedback's residual (here) is fp32
beside the gradients (on their device): the gradients are added into it, it is rounded into the
wire buffer, and what rounding left out stays in it for the next push.

Extra memory of the leader: fp32 wire, the push and the answer (2 x the parameters' fp32 bytes);
bf16 wire, the residual and two bf16 buffers (2 x); a CUDA leader adds the device buffer (1 x of
the wire format on the device) and the error feedback's residual lives on the device.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..ps.shards import ShardLayout


class Staging:
    """A group leader's two reused host buffers of the whole flat vector: the push it sends (with the
    bf16 wire's error feedback) and the answer it receives and loads into the parameters."""

    def __init__(self, layout: ShardLayout, params: Sequence[torch.Tensor], wire: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        self.wire = wire
        self.device = device
        self.cuda = device.type == "cuda"
        shapes = [tuple(p.shape) for p in params]
        self.shapes = shapes
        self.ordered = [params[i] for i in layout.order]       # the parameters in flat order
        n = layout.numel
        self.push = torch.empty(n, dtype=wire, pin_memory=self.cuda)
        self.answer = torch.empty(n, dtype=wire, pin_memory=self.cuda)
        self.answer_views = layout.views(self.answer, shapes)
        self.push_views = layout.views(self.push, shapes) if wire == torch.float32 and not self.cuda else []
        self.residual: torch.Tensor | None = None              # bf16 wire: the error feedback's
        self.residual_views: list[torch.Tensor] = []
        if wire != torch.float32:
            self.residual = torch.zeros(n, device=device)
            self.residual_views = layout.views(self.residual, shapes)
        self.stream: Any = None
        self.on_device: torch.Tensor | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.on_device = torch.empty(n, dtype=wire, device=device)
            self.device_views = layout.views(self.on_device, shapes)
        self._pushed: Any = None        # event: the push buffer holds this step's push
        self._loaded: Any = None        # event: the answer buffer was copied out (it may be reused)

    # --- push ---------------------------------------------------------------------------------
    def fill(self, grads: Sequence[torch.Tensor]) -> None:
        """This step's gradients (model order) into the push buffer, in the wire format."""
        ordered = [grads[i] for i in self.layout.order]
        with torch.no_grad():
            if self.residual is not None:
                torch._foreach_add_(self.residual_views, ordered)
            if not self.cuda:
                if self.residual is None:
                    torch._foreach_copy_(self.push_views, ordered)
                else:
                    round_into(self.residual, self.push)
                return
            assert self.on_device is not None
            if self.residual is None:
                torch._foreach_copy_(self.device_views, ordered)
            else:
                round_into(self.residual, self.on_device)
            # The device buffer's last use (an answer's load) was on the side stream, which the
            # training stream waited for: stream order suffices, no host sync.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.push.copy_(self.on_device, non_blocking=True)
                self._pushed = torch.cuda.Event()
                self._pushed.record(self.stream)

    def host_fp32(self) -> torch.Tensor:
        """A host fp32 buffer of the flat vector for the seed and the final parameters, which come
        once each, outside the steps: the push buffer (fp32 wire) or the error feedback's residual
        (bf16 wire, CPU), else one of its own."""
        if self.wire == torch.float32 and not self.cuda:
            return self.push
        if self.residual is not None and not self.cuda:
            return self.residual
        return torch.empty(self.layout.numel, pin_memory=self.cuda)

    def seed(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameters (model order) as the fp32 flat vector a seed carries (valid until
        :meth:`seeded`)."""
        flat = self.host_fp32()
        with torch.no_grad():
            torch._foreach_copy_(self.layout.views(flat, self.shapes), [params[i] for i in self.layout.order])
        return flat

    def seeded(self, flat: torch.Tensor) -> None:
        """The seed was sent: a residual that carried it starts from zero again."""
        if flat is self.residual:
            flat.zero_()

    def final(self) -> torch.Tensor:
        """Where the final fp32 parameters are received: the answer buffer under the fp32 wire;
        nothing after them needs the residual."""
        if self.wire == torch.float32 and not self.cuda:
            return self.answer
        return self.host_fp32()

    def push_ready(self) -> None:
        """Before the push buffer is sent (any thread)."""
        if self._pushed is not None:
            self._pushed.synchronize()

    # --- answer -------------------------------------------------------------------------------
    def answer_free(self) -> None:
        """Before the answer buffer is received into (any thread)."""
        self._wait_loaded()

    def load(self, source: torch.Tensor | None = None) -> None:
        """The answer buffer (or ``source``, a host flat vector: the final fp32 parameters) into the
        parameters (training thread)."""
        with torch.no_grad():
            if source is not None:
                torch._foreach_copy_(self.ordered, self.layout.views(source, self.shapes))
                return
            if not self.cuda:
                torch._foreach_copy_(self.ordered, self.answer_views)
                return
            assert self.on_device is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.on_device.copy_(self.answer, non_blocking=True)
                torch._foreach_copy_(self.ordered, self.device_views)
                self._loaded = torch.cuda.Event()
                self._loaded.record(self.stream)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _wait_loaded(self) -> None:
        if self._loaded is not None:
            self._loaded.synchronize()
            self._loaded = None


ROUND_CHUNK = 1 << 20       # elements widened at a time to take a rounding out of the residual


def round_into(residual: torch.Tensor, wire: torch.Tensor) -> None:
    """``wire`` = ``residual`` rounded to the wire's type, and what rounding left out stays in
    ``residual``. In chunks through one small fp32 buffer: an op mixing bf16 and fp32 tensors
    would make an fp32 temporary of the whole vector (and run slower)."""
    wire.copy_(residual)
    widened = torch.empty(min(ROUND_CHUNK, residual.numel()), device=residual.device)
    for a in range(0, residual.numel(), ROUND_CHUNK):
        b = min(residual.numel(), a + ROUND_CHUNK)
        part = widened[: b - a]
        part.copy_(wire[a:b])
        residual[a:b].sub_(part)
