"""The group engine of an fsdp group: the model sharded with torch's FSDP2 over the group's process
group (group/fsdp.py), each rank with its own batch, the group's gradient the samples-weighted mean.

**Why the weighting, and where.** The script's loss is its own batch's mean, so rank i's gradient is
``g_i``, the mean over its ``n_i`` samples. FSDP2 reduce-scatters the ranks' gradients with ``AVG``:
``sum_i g_i / W`` (W ranks), which counts a rank of 3 samples as much as one of 5. The union batch's
gradient is ``sum_i n_i g_i / N``. The engine gives FSDP2 a reduce-scatter of its own on every FSDP
unit (``set_custom_reduce_scatter``, the counterpart of DDP's comm hook) that multiplies this rank's
gradient by ``n_i W / B`` before FSDP2's own AVG (B: the plan's batches summed, the same on every
rank without talking), and at ``opt.step()`` one small all-reduce of the samples gives N, and the
shards are multiplied by ``B / N``. That is the issue's first recipe (each rank's loss scaled by
``W n_i / N``), applied to the gradient instead of a loss the engine does not own; FSDP2's divide
factor is left alone, since on gloo it asks for ``PREMUL_SUM``, which gloo refuses. With the plan's
batches both factors are exactly 1.0 and are skipped: a homogeneous fsdp group computes what plain
FSDP2 computes, bit for bit.

Accumulation (the plan's ``accumulate`` K and this rank's ``micro_batches`` m; the script still
calls ``opt.step()`` after every micro-batch): the first K * m - 1 backwards run with FSDP2's
``set_requires_gradient_sync(False)``, their gradients kept unsharded and weighted by their samples
(group/fsdp_window.py), and the window's last backward reduce-scatters their sum; the optimizer
steps on nothing before it. Inside the window the parameters stay unsharded
(``set_reshard_after_backward(False)``): the next micro-step's forward gathers nothing. That is
also what lets members with different m train together: FSDP2's all-gathers and reduce-scatters
are collectives, so every member must run the same ones per update. With
``set_reshard_after_forward(False)`` on every member of such a group, each gathers every unit once
per update (in its first forward) and reduce-scatters it once (in its last backward), however
many micro-steps it makes: a rank keeps its units' full parameters from its first forward to its
last backward (ZeRO-2's memory rather than ZeRO-3's), the price of uneven micro-batches.

The optimizer: FSDP2 replaces the parameters, so the engine rebuilds it over the shards
(group/rebuild.py) and the script steps that one (``ctx.wrap`` returns it).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..adapt.clock import ClockedMember, ComputeClock
from ..emulate import Emulator
from ..errors import TrainingError
from ..metrics import MetricsSink
from .engine import GroupSpec
from .fsdp import ShardOptions, shard
from .fsdp_window import check_window_support, scale_accumulated
from .rebuild import parameter_names, rebuild_optimizer, refuse_unrebuildable


class WeightedReduceScatter:
    """FSDP2's reduce-scatter (``dist.reduce_scatter_single``, as its default) with this rank's
    gradient first multiplied by ``weight()``; skipped when that is 1.0."""

    def __init__(self, weight: Callable[[], float]) -> None:
        self.weight = weight
        self.calls = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        factor = self.weight()
        if factor != 1.0:
            input_tensor.mul_(factor)
        return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)


class ShardedEngine(ClockedMember):
    """One rank's part of an fsdp group: FSDP2 on the group's process group, the samples-weighted
    gradient, the rebuilt optimizer; what ``ctx`` reads of a group engine (steps, samples, rates)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: GroupSpec,
                 device: torch.device, emulator: Emulator, metrics: MetricsSink,
                 max_grad_norm: float | None, options: ShardOptions) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise TrainingError(f"max_grad_norm must be positive, not {max_grad_norm!r}")
        self.module, self.opt, self.spec, self.device = model, optimizer, spec, device
        self.rank, self.group_id, self.members = spec.rank, spec.group_id, len(spec.ranks)
        self.emulator, self.metrics, self.options = emulator, metrics, options
        self.max_grad_norm = max_grad_norm
        # This rank's micro-steps (opt.step() calls) per update.
        self.accumulate = max(1, spec.accumulate) * max(1, spec.micro_batches)
        # B: the plan's samples per update over the group; without plan batches every member assumes
        # its default, the same on every rank, and B / N corrects it.
        known = [b for b in spec.batches if b]
        per_step = sum(known) if len(known) == self.members else self.members * spec.default_batch
        self.planned_total = float(max(1, spec.accumulate) * per_step)
        self.comm = WeightedReduceScatter(self._weight)
        self.clock = ComputeClock()
        self.params: list[torch.nn.Parameter] = []
        self.local_step = self.samples_seen = self.skipped_steps = 0
        self.sync_s = 0.0               # waits on the step's samples all-reduce
        self.version = 0                # no parameter servers
        self._samples = 0               # this micro-step's, counted by its forwards
        self._earlier = 0               # the window's earlier micro-steps'
        self._divisor: int | None = None    # what the kept gradients were divided by at this forward
        self._grad_norm: torch.Tensor | None = None
        self._hooks: list[Any] = []

    def start(self, restore: Callable[[], None] | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Shard the model, rebuild the optimizer over its shards (``restore``: then load a snapshot
        into both, before the engine's hooks count anything); returns both, to train through."""
        from torch.distributed.fsdp import FSDPModule

        names = parameter_names(self.module)
        refuse_unrebuildable(self.opt, names)     # before anything is sharded
        shard(self.module, self.spec.pg, self.device, self.options)
        for unit in self.module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_reduce_scatter(self.comm)   # type: ignore[arg-type]
        if self.spec.steps_differ and isinstance(self.module, FSDPModule):
            self.module.set_reshard_after_forward(False)
        if self.accumulate > 1:
            check_window_support(self.module)
            self._set_sync(False)
        self.opt = rebuild_optimizer(self.opt, names, self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if restore is not None:
            restore()
        self._hooks = [self.module.register_forward_pre_hook(self._count_samples),
                       self.opt.register_step_pre_hook(self._before_step),
                       self.opt.register_step_post_hook(self._after_step)]
        self.emulator.begin_compute()
        self.clock.begin_window()
        return self.module, self.opt

    def _count_samples(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            n = args[0].shape[0] if args[0].dim() else 1
            self._samples += n
            if self.local_step % self.accumulate and self._divisor is None:
                # A later micro-step of the window: the kept sum as S / n_k while backward adds g_k.
                self._divisor = n or 1
                scale_accumulated(self.module, 1.0 / self._divisor)

    def _weight(self) -> float:
        """``n_i W / B``: this rank's gradient's factor before FSDP2's AVG (n_i: the last micro-step's
        samples; the earlier ones' are in the kept sum already, group/fsdp_window.py)."""
        n = self._divisor if self._divisor is not None else (self._samples or self.spec.default_batch)
        return n * self.members / self.planned_total

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        n = self._samples or self.spec.default_batch
        self._samples = 0
        self.emulator.end_compute(self.local_step, n)
        self.local_step += 1
        self.samples_seen += n
        divisor, self._divisor = self._divisor, None
        if self.local_step % self.accumulate:
            # Not the window's last micro-step: its gradient joins the kept sum, weighted by its samples.
            scale_accumulated(self.module, float(divisor if divisor is not None else n))
            self._earlier += n
            return
        mine, self._earlier = self._earlier + n, 0
        computed = time.perf_counter() - self.clock.window_began
        total = self._group_samples(mine)
        if total != self.planned_total:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(self.planned_total / total)
        if self.max_grad_norm is not None:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        # The member's compute rate here includes FSDP2's communication inside backward.
        due = self.clock.rates_due(computed, mine, group=self.group_id, step=self.local_step,
                                   samples_seen=self.samples_seen)
        if due is not None:
            self.metrics.record(due)

    def _group_samples(self, mine: int) -> float:
        """N: the group's samples this step (one small all-reduce)."""
        began = time.perf_counter()
        n = torch.tensor([float(mine)], dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(n, group=self.spec.pg)
        except (RuntimeError, ValueError) as exc:
            raise TrainingError(f"rank {self.rank}: group {self.group_id}'s all-reduce of its samples "
                                f"failed (a member of ranks {list(self.spec.ranks)} is gone?): {exc}") from exc
        self.sync_s += time.perf_counter() - began
        return float(n.item())

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.accumulate > 1:
            self._set_sync((self.local_step + 1) % self.accumulate == 0)
        self.emulator.begin_compute()
        if self.local_step % self.accumulate == 0:
            self.clock.begin_window()

    def _set_sync(self, sync: bool) -> None:
        """FSDP2's ``no_sync``: reduce-scatter (and reshard) only in the window's last backward."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(sync)
            self.module.set_reshard_after_backward(sync)

    @property
    def grad_norm(self) -> float | None:
        """2-norm of the last group gradient before clipping (with ``max_grad_norm``)."""
        norm = self._grad_norm
        if norm is None:
            return None
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict, copied (every member of the group must call it: the shards
        are all-gathered)."""
        out = {}
        for k, v in self.module.state_dict().items():
            full = getattr(v, "full_tensor", None)
            out[k] = (full() if full is not None else v).detach().clone()
        return out

    def finish(self) -> None:
        for h in self._hooks:
            h.remove()
