"""Gradient aggregation behind a user's ``optimizer.step()``: weighted all-reduce inside the group,
then either the local optimizer (allreduce plans: no PS) or a push to the PS shards (hybrid plans).

It hooks the user's optimizer instead of replacing it, so LR schedulers and ``zero_grad`` keep
working. Before each step it takes the gradients (weighted by the samples the model saw in training
forwards since the last step) into its own accumulator and clears ``p.grad``; on the step that
completes the group's accumulation it all-reduces one buffer (:class:`SyncLayout`): the weighted
gradients, the samples, a found-inf count (GradScaler, amp.py), a correction flag (below), two
slots per member (its last step's batch and its emulator's stable estimate, which the members on
one node pool, emulate.py) and the members' floating-point buffers (BatchNorm statistics) weighted
by their samples. In a group of two or more the gradient part goes earlier, in buckets that leave
while backward runs (buckets.py); the rest follows at the step, and the flag says whether any
member must correct what its buckets sent. A step
where any member found inf/NaN is skipped by the whole group. Otherwise the weighted mean gradient
is clipped (``max_grad_norm``) and either put back into ``p.grad`` (the local optimizer then steps,
like DDP) or, for hybrid, the group leader pushes it with the group's buffers and hyperparameters to
the PS and broadcasts the fresh parameters and buffers to its group.

With ``overlap`` (Plan.overlap) the leader's exchange with the PS runs on a thread of its own while
the group computes its next step on the parameters it has: at each push it first waits for the
answer to its previous push, starts the new push (its gradient was computed on the answer before,
whose per-shard versions go with it as the base the PS counts staleness from) and hands the group
the answer it waited for. With ``wire`` "bf16" pushes and pulls travel as bf16; what rounding takes
off a push is added to the next one (error feedback), so no part of a gradient is lost for good.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from . import amp, optim
from .buckets import BUCKET_MB, GradBuckets
from .emulate import Emulator
from .errors import TrainingError
from .metrics import MetricsSink

FINISH_POLL_S = 5.0     # how long a leader's "finished?" call waits on the PS before asking again

# What a PS shard answers: (version, its parameters or None for an acknowledgement, the buffers
# (shard 0, when the model has synchronised buffers) or None).
ShardAnswer = tuple[int, "torch.Tensor | None", "torch.Tensor | None"]


@dataclass(frozen=True)
class SyncLayout:
    """Offsets in a group's synchronising all-reduce buffer: [weighted gradients | total samples |
    found-inf count | members with a correction (buckets.py) | (batch, estimate) per member |
    sample-weighted buffers]. Everything a step needs to agree on rides on the all-reduce the step
    makes anyway (no extra round trip); a group of one has no member slots (it does no all-reduce),
    a model without buffers no buffer part."""
    params: int
    members: int
    buffers: int = 0

    @property
    def samples(self) -> int:
        return self.params

    @property
    def found_inf(self) -> int:
        return self.params + 1

    @property
    def corrections(self) -> int:
        return self.params + 2

    @property
    def slots(self) -> int:
        return self.params + 3

    @property
    def buffers_at(self) -> int:
        return self.slots + (2 * self.members if self.members > 1 else 0)

    @property
    def numel(self) -> int:
        return self.buffers_at + self.buffers


def sync_buffer_numel(parameters: int, members: int, buffers: int = 0) -> int:
    """Elements of a group's synchronising all-reduce (the bench sizes its measurement by it)."""
    return SyncLayout(parameters, members, buffers).numel


def synced_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers averaged across ranks: floating-point and persistent (in the state dict), such as
    BatchNorm's running mean and variance. Counters (``num_batches_tracked``) stay each rank's own,
    and non-persistent buffers are caches or constants the model rebuilds: averaging them would
    only cost bandwidth."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if (b is not None and b.is_floating_point() and name not in module._non_persistent_buffers_set
                    and id(b) not in seen):
                seen.add(id(b))
                out.append(b)
    return out


class ErrorFeedback:
    """Rounding of pushes to a narrower wire format with error feedback: what rounding left out of
    the previous pushes is added before rounding, and what this rounding leaves out is kept, so
    the pushes' sum stays within one rounding of the gradients' sum (without it, a component
    below half a bf16 step of its gradient's scale would never reach the PS)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.residual: torch.Tensor | None = None

    def round(self, grad: torch.Tensor) -> torch.Tensor:
        target = grad if self.residual is None else grad + self.residual
        sent = target.to(self.dtype)
        self.residual = target - sent.to(grad.dtype)
        return sent


class GroupSync:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group_ranks: tuple[int, ...], pg: Any, rank: int, group_id: int, accumulate: int,
                 ps_ranks: tuple[int, ...], first_worker: int, default_batch: int,
                 emulator: Emulator, metrics: MetricsSink, timeout_s: float,
                 share_with: tuple[int, ...] = (), max_grad_norm: float | None = None,
                 data_position: Callable[[], dict[str, int] | None] | None = None,
                 overlap: bool = False, wire: str = "fp32", bucket_mb: float = BUCKET_MB) -> None:
        self.model = model
        self.opt = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = synced_buffers(model)
        self.ranks = group_ranks
        self.pg = pg
        self.rank = rank
        self.group_id = group_id
        self.leader = group_ranks[0]
        self.accumulate = max(1, accumulate)
        self.ps_ranks = ps_ranks
        self.first_worker = first_worker
        self.default_batch = default_batch
        self.emulator = emulator
        self.metrics = metrics
        self.timeout_s = timeout_s
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise TrainingError(f"max_grad_norm must be positive, not {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        # Norm of the last aggregated gradient before clipping (only computed when clipping).
        self.grad_norm: float | None = None
        # Positions in ``group_ranks`` of the members on this rank's node (itself included): their
        # emulated steps share one stable estimate (emulate.py).
        self.share_with = share_with
        # The group's data position, sent with each push so PS checkpoints record it (position.py).
        self.data_position = data_position
        self._me = group_ranks.index(rank)
        self.version = 0
        self.local_step = 0
        self.samples_seen = 0
        self.skipped_steps = 0
        # Wall seconds this rank spent synchronising in the loop (all-reduce, PS exchange, the
        # broadcast of fresh parameters): with compute and emulated sleep, where its steps went.
        self.sync_s = 0.0
        self._samples = 0
        self._found_inf = False          # GradScaler found inf/NaN in this rank's step (amp.py)
        # The live scale of the GradScaler that stepped opt last time (None: the last step had none),
        # and the one this step's gradients were unscaled by (set during a scaler's step).
        self._scaler_scale: torch.Tensor | None = None
        self._step_scale: float | None = None
        self._skipped = False            # the group skipped the update of the current step
        self._finished = False
        # Hybrid communication: the PS version of each shard's parameters this rank holds (the base
        # of a gradient computed on them), the leader's exchange in flight under overlap, whether
        # the group has pushed since the start (then every push hands over an answer), and the
        # rounding residual of bf16 pushes.
        self.overlap = bool(overlap and ps_ranks)
        if wire not in ("fp32", "bf16"):
            raise TrainingError(f"rank {rank}: plan wire {wire!r} is not fp32 or bf16")
        self.wire_dtype = torch.bfloat16 if wire == "bf16" and ps_ranks else torch.float32
        self._shard_versions: list[int] = [0] * len(ps_ranks)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hgtrain-exchange") if self.overlap else None
        self._in_flight: "ThreadFuture[list[ShardAnswer]] | None" = None
        self._pushed = False
        self._last_answer: torch.Tensor | None = None     # the leader's previous answer (overlap)
        self._feedback = ErrorFeedback(self.wire_dtype) if self.wire_dtype != torch.float32 else None
        device = self.params[0].device if self.params else torch.device("cpu")
        self._numel = sum(p.numel() for p in self.params)
        self.layout = SyncLayout(self._numel, len(group_ranks), sum(b.numel() for b in self.buffers))
        self._acc = torch.zeros(self.layout.numel, device=device)
        # Groups of two or more send their gradients in buckets during backward (off: bucket_mb 0, or
        # a torch without post-accumulate-grad hooks, before 2.1).
        self._buckets: GradBuckets | None = None
        if (len(group_ranks) > 1 and bucket_mb > 0 and self.params
                and hasattr(torch.Tensor, "register_post_accumulate_grad_hook")):
            self._buckets = GradBuckets(
                self.params, self._acc[:self._numel], pg, bucket_mb,
                samples=lambda: self._samples or self.default_batch,
                scale=lambda: self._scaler_scale if self.local_step else amp.last_scale(),
                collective=self._collective, untimed=emulator.untimed, pace=emulator.pace)
            self._buckets.armed = self.accumulate == 1
        if ps_ranks:
            from .ps import assign_shards
            # Checked on every worker at wrap time, before anything reaches the PS: each rank fails
            # with the reason, not only the first worker whose seed the PS would refuse.
            try:
                self._opt_class = optim.class_path(type(optimizer))
                frozen = [p for p in model.parameters() if not p.requires_grad]
                self._groups = optim.group_indices(optimizer, self.params, frozen)
                optim.build_optimizer(self.params, optim.shard_spec(
                    optimizer, *self._opt_class, self._groups, range(len(self.params))))
            except TrainingError as exc:
                raise TrainingError(f"rank {rank}: hybrid training: {exc}") from exc
            self._seeded = [optim.group_options(g, optimizer.defaults) for g in optimizer.param_groups]
            self._owner = assign_shards([p.numel() for p in self.params], len(ps_ranks))
        self._hooks = [
            model.register_forward_pre_hook(self._count_samples),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        amp.hook_scaler(optimizer, self)

    # --- start --------------------------------------------------------------------------------
    def start(self) -> None:
        """Make every worker start from the same parameters and buffers: rank 0's (DDP) or the PS's
        (hybrid)."""
        if self.ps_ranks:
            if self.rank == self.first_worker:
                from . import ps

                flat, bufs = self._flat_params(), self._flat_buffers()
                self._call_shards(ps._seed, "seed", lambda s: (
                    self.group_id, self._shard_flat(flat, s), self._shard_shapes(s), self._spec(s),
                    bufs if s == 0 else None))
            if self.rank == self.leader:
                self._load_answers(self._send(None))
        self._broadcast_state()
        self._broadcast_other_buffers()
        self.emulator.begin_compute()

    # --- hooks ----------------------------------------------------------------------------------
    def _count_samples(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
            self._samples += args[0].shape[0] if args[0].dim() else 1

    def scaler_step(self, found_inf: bool, step: Callable[[], Any],
                    scale: torch.Tensor | None = None) -> tuple[Any, bool]:
        """GradScaler's step for a wrapped optimizer (amp.py): always step, so this rank takes part
        in its group's all-reduce; the flag goes with it. ``scale``: what the scaler unscaled the
        gradients by (the buckets sent them divided by it already)."""
        self._found_inf = found_inf
        self._scaler_scale = scale
        self._step_scale = None if scale is None else float(scale)
        try:
            return step(), self._skipped
        finally:
            self._step_scale = None

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if amp.scaled_by_optimizer(opt):
            raise TrainingError(f"rank {self.rank}: GradScaler hands this optimizer still-scaled "
                                f"gradients (it unscales inside its own step, e.g. fused=True); "
                                f"use it without fused=True under hgtrain")
        n = self._samples or self.default_batch
        self.emulator.end_compute(self.local_step, n)
        self._samples = 0
        self.samples_seen += n
        self._skipped = False
        completes = (self.local_step + 1) % self.accumulate == 0
        if self._buckets is not None and completes:
            # The gradients went into the buckets during backward; what changed since (a second
            # backward, more samples, another scale) is fixed or flagged, and the rest leaves now.
            self._acc[self.layout.corrections] = float(self._buckets.finish(n, self._step_scale))
            for p in self.params:
                p.grad = None
        else:
            offset = 0
            for p in self.params:
                if p.grad is not None:
                    self._acc[offset: offset + p.numel()].add_(p.grad.reshape(-1), alpha=float(n))
                offset += p.numel()
                p.grad = None
        self._acc[self.layout.samples] += n
        if self._step_scale is None:
            self._scaler_scale = None           # no scaler stepped this time: gradients are unscaled
        if self._found_inf:
            # Counted even on accumulating steps: the group drops the whole accumulated update.
            self._acc[self.layout.found_inf] += 1
            self._found_inf = False
        self.local_step += 1
        if self._buckets is not None:
            self._buckets.armed = (self.local_step + 1) % self.accumulate == 0
        if not completes:
            return                              # still accumulating: the optimizer sees no grads
        self._synchronise(n)

    def _synchronise(self, n: int) -> None:
        lay, acc = self.layout, self._acc
        if len(self.ranks) > 1:
            mine = lay.slots + 2 * self._me
            acc[mine] = n
            acc[mine + 1] = self.emulator.estimate(n)
        if self.buffers:
            # This member's buffers weighted by the samples it trained on since the last update.
            acc[lay.buffers_at:].copy_(self._flat_buffers()).mul_(acc[lay.samples])
        t0 = time.perf_counter()
        if self._buckets is None:
            self._allreduce(acc)
            samples, found_inf, _ = acc[lay.samples: lay.slots].tolist()   # one device sync for all
        else:
            self._buckets.wait()
            self._allreduce(acc[lay.samples:])
            samples, found_inf, corrections = acc[lay.samples: lay.slots].tolist()
            if corrections > 0 and found_inf == 0:      # every member knows both: all take this path
                correction = self._buckets.correction()
                self._allreduce(correction)
                acc[:self._numel].add_(correction)
            self._buckets.end_step()
        t1 = time.perf_counter()
        self._pool_estimates(n)
        total = max(samples, 1e-12)
        if found_inf > 0:
            # Some member's scaler found inf/NaN: nobody steps, nothing is pushed, parameters and
            # buffers stay as they are (a member's statistics may hold the overflow too).
            self._skipped = True
            self.skipped_steps += 1
            self.sync_s += t1 - t0
            self.metrics.emit(event="skip", group=self.group_id, step=self.local_step, version=self.version,
                              allreduce_s=t1 - t0)
            acc.zero_()
            return
        grad = acc[:self._numel] / total
        self._clip(grad)
        buffers = acc[lay.buffers_at:] / total if self.buffers else None
        if not self.ps_ranks:
            offset = 0
            for p in self.params:
                p.grad = grad[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            if buffers is not None:
                self._load_buffers(buffers)
            self.sync_s += t1 - t0
        elif self.overlap:
            if self.rank == self.leader:
                push = self._push_request(grad, samples, buffers)    # based on the parameters held
                answers = self._collect()                            # the previous push's answer
                assert self._pool is not None
                self._in_flight = self._pool.submit(self._send, push)
                if answers is not None:
                    self._load_answers(answers)
                    self._predict()
            t2 = time.perf_counter()
            if self._pushed:        # every member knows: the first push has no answer to hand over
                self._broadcast_state()
            self._pushed = True
            t3 = time.perf_counter()
        else:
            if self.rank == self.leader:
                self._load_answers(self._send(self._push_request(grad, samples, buffers)))
            t2 = time.perf_counter()
            self._broadcast_state()
            t3 = time.perf_counter()
        if self.ps_ranks:
            self.sync_s += t3 - t0
            self.metrics.emit(event="sync", group=self.group_id, version=self.version,
                              samples=samples, allreduce_s=t1 - t0, push_s=t2 - t1,
                              broadcast_s=t3 - t2)
        acc.zero_()

    def _clip(self, grad: torch.Tensor) -> None:
        """``clip_grad_norm_`` on the aggregated gradient, with torch's formula."""
        if self.max_grad_norm is None:
            return
        norm = torch.linalg.vector_norm(grad)
        self.grad_norm = float(norm)
        grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.emulator.begin_compute()

    def _pool_estimates(self, batch: int) -> None:
        """The median estimate of this node's members whose last step had the same batch (none to pool
        with when it is the only one there: its own estimate stays current)."""
        if len(self.ranks) < 2 or len(self.share_with) < 2:
            return
        slots = self._acc[self.layout.slots: self.layout.buffers_at].tolist()
        pool = [slots[2 * i + 1] for i in self.share_with if slots[2 * i] == batch and slots[2 * i + 1] > 0]
        if pool:
            self.emulator.share(batch, statistics.median(pool))

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (copies) with the current parameters and synchronised buffers: the
        PS's under hybrid while training (each shard's newest; shards may differ by the pushes in
        flight), the local model's otherwise and after ``finish()``."""
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if not self.ps_ranks or self._finished:
            return state
        from . import ps

        _, flat, buffers = self._assemble(self._call_shards(ps._state, "state", lambda s: ()))
        _fill(state, self.model.named_parameters(remove_duplicate=False), self.params, flat)
        if buffers is not None:
            _fill(state, self.model.named_buffers(remove_duplicate=False), self.buffers, buffers)
        return state

    # --- end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every group is done, then hold the PS's final parameters (hybrid)."""
        for h in self._hooks:
            h.remove()
        if self._buckets is not None:
            self._buckets.remove()
        amp.unhook_scaler(self.opt)
        if not self.ps_ranks:
            self._finished = True
            return
        from . import ps
        from .groups import rpc_name

        if self.rank == self.leader:
            self._collect()          # the last push's answer: the final parameters come from finish
        if self._pool is not None:
            self._pool.shutdown()
        while True:
            # On the rank's device: an NCCL group takes CUDA tensors only (a CPU flag failed on an
            # H200 with "No backend type associated with device type cpu").
            flag = torch.zeros(1, device=self._acc.device)
            if self.rank == self.leader:
                answers = [self._wait(fut, "finish") for fut in [
                    _rpc_async(rpc_name(r), ps._finish, (self.group_id, FINISH_POLL_S), self.timeout_s)
                    for r in self.ps_ranks]]
                if all(done for done, *_ in answers):
                    flag[0] = 1
                    self._load_answers([(v, flat, bufs) for _, v, flat, bufs in answers])
            if len(self.ranks) > 1:
                self._collective(lambda: dist.broadcast(flag, self.leader, group=self.pg), "broadcast")
            if flag[0]:
                self._broadcast_state()
                self._finished = True
                return

    # --- helpers --------------------------------------------------------------------------------
    def _spec(self, shard: int) -> optim.OptimizerSpec:
        module, qualname = self._opt_class
        return optim.shard_spec(self.opt, module, qualname, self._groups, self._shard_index(shard))

    def _push_request(self, grad: torch.Tensor, samples: float,
                      buffers: torch.Tensor | None) -> Callable[[int], tuple[Any, ...]]:
        """The arguments of a push to each shard, taken now on the training thread: the gradient in
        the wire format, the optimizer's hyperparameters, the buffers (to shard 0), the data
        position and, under overlap, the version of each shard's parameters the gradient was
        computed on."""
        hyper = optim.push_hyperparameters(self.opt, self._seeded)
        bufs = buffers.cpu() if buffers is not None else None
        pos = self.data_position() if self.data_position else None
        wire = self._to_wire(grad)
        bases = list(self._shard_versions) if self.overlap else None
        return lambda s: (self.group_id, self._shard_flat(wire, s), samples, hyper, bufs if s == 0 else None,
                          pos, *((bases[s],) if bases is not None else ()))

    def _predict(self) -> None:
        """Under overlap (leader, after loading an answer): the group's next gradient is computed
        now but applied only after the group's own push in flight and what lands meanwhile, about
        the updates between two of its answers. Evaluating it at answer + (answer - previous answer)
        instead of at the answer (weight prediction, as pipelined training does) puts it about where
        the PS will apply it. The PS's parameters are untouched and the next answer replaces the
        prediction, so nothing accumulates; ``finish()`` loads the PS's final parameters exactly."""
        answer = self._flat_params()                       # a copy
        previous, self._last_answer = self._last_answer, answer
        if previous is not None:
            self._load_flat(2 * answer - previous)

    def _to_wire(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self._feedback is None else self._feedback.round(grad)

    def _collect(self) -> list[ShardAnswer] | None:
        """Under overlap: wait for the exchange in flight and return its answers (None if none)."""
        fut, self._in_flight = self._in_flight, None
        return None if fut is None else fut.result()

    def _send(self, push: Callable[[int], tuple[Any, ...]] | None) -> list[ShardAnswer]:
        """Push (``push``: the arguments per shard; None: just start) to every shard; shard 0's
        answer may be held back by the staleness rule and carries its parameters and the PS's
        buffers; then the other shards' parameters are pulled."""
        from . import ps

        if push is not None:
            answers = self._call_shards(ps._push, "push", push)
        else:
            answers = self._call_shards(ps._pull, "pull", lambda s: (self.group_id,), shards=[0])
        if len(self.ps_ranks) > 1:
            rest = self._call_shards(ps._pull, "pull", lambda s: (self.group_id,),
                                     shards=range(1, len(self.ps_ranks)))
            answers = [answers[0], *rest]
        return answers

    def _call_shards(self, fn: Any, what: str, args: Callable[[int], tuple[Any, ...]],
                     shards: Iterable[int] | None = None) -> list[Any]:
        from .groups import rpc_name

        shards = range(len(self.ps_ranks)) if shards is None else shards
        futs = [_rpc_async(rpc_name(self.ps_ranks[s]), fn, args(s), self.timeout_s) for s in shards]
        return [self._wait(f, what) for f in futs]

    def _wait(self, fut: Any, what: str) -> Any:
        try:
            return fut.wait()
        except Exception as exc:  # RPC errors arrive as RuntimeError or the PS's own exception
            raise TrainingError(f"rank {self.rank} (group {self.group_id}): {what} to the parameter "
                                f"server failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc

    def _allreduce(self, buf: torch.Tensor) -> None:
        if len(self.ranks) > 1:
            self._collective(lambda: dist.all_reduce(buf, group=self.pg), "all-reduce")

    def _broadcast_state(self) -> None:
        """The leader's parameters, synchronised buffers and PS version to its group, in one broadcast.
        The version travels as the bytes of an int64 viewed in the vector's dtype: a broadcast copies
        bytes, and no float type of the parameters (bf16 holds integers exactly only up to 256) could
        carry it as a number."""
        if len(self.ranks) <= 1:
            return
        state = torch.cat([self._flat_params(), self._flat_buffers()])
        version = torch.tensor([self.version], dtype=torch.int64, device=state.device).view(state.dtype)
        flat = torch.cat([state, version])
        self._collective(lambda: dist.broadcast(flat, self.leader, group=self.pg), "broadcast")
        self._load_flat(flat[:self._numel])
        self._load_buffers(flat[self._numel: state.numel()])
        self.version = int(flat[state.numel():].clone().view(torch.int64)[0])   # clone: aligned

    def _broadcast_other_buffers(self) -> None:
        """At the start only (as DDP does): the buffers that are not averaged, from the leader."""
        if len(self.ranks) <= 1:
            return
        synced = {id(b) for b in self.buffers}
        for b in self.model.buffers():
            if id(b) not in synced:
                self._collective(lambda: dist.broadcast(b, self.leader, group=self.pg), "broadcast")

    def _collective(self, op: Callable[[], Any], what: str) -> Any:
        try:
            return op()
        except (RuntimeError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise TrainingError(f"rank {self.rank} (group {self.group_id}): {what} in group "
                                f"{self.group_id} {list(self.ranks)} failed (a peer died or timed out "
                                f"after {self.timeout_s:g} s): {first}") from exc

    def _flat_params(self) -> torch.Tensor:
        return _flat(self.params, self._acc.device)

    def _flat_buffers(self) -> torch.Tensor:
        return _flat(self.buffers, self._acc.device)

    def _load_flat(self, flat: torch.Tensor) -> None:
        _load(self.params, flat)

    def _load_buffers(self, flat: torch.Tensor) -> None:
        _load(self.buffers, flat)

    def _shard_index(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self._owner) if s == shard]

    def _shard_flat(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        return torch.cat([flat[offsets[i]: offsets[i + 1]] for i in self._shard_index(shard)]).cpu()

    def _shard_shapes(self, shard: int) -> list[tuple[int, ...]]:
        return [tuple(self.params[i].shape) for i in self._shard_index(shard)]

    def _assemble(self, answers: Sequence[ShardAnswer]) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The shards' answers as (newest version, the full parameter vector, the PS's buffers)."""
        flat = torch.empty(self._numel)
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        for shard, (_, shard_flat, _) in enumerate(answers):
            assert shard_flat is not None
            pos = 0
            for i in self._shard_index(shard):
                n = offsets[i + 1] - offsets[i]
                flat[offsets[i]: offsets[i + 1]] = shard_flat[pos: pos + n]
                pos += n
        return max(v for v, _, _ in answers), flat, answers[0][2]

    def _load_answers(self, answers: Sequence[ShardAnswer]) -> None:
        self._shard_versions = [v for v, _, _ in answers]
        self.version, flat, buffers = self._assemble(answers)
        self._load_flat(flat.to(self._acc.device))
        if buffers is not None and self.buffers:
            self._load_buffers(buffers.to(self._acc.device))


def _flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _load(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def _fill(state: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]],
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


def _rpc_async(to: str, fn: Any, args: tuple[Any, ...], timeout_s: float) -> Any:
    from torch.distributed import rpc

    return rpc.rpc_async(to, fn, args=args, timeout=timeout_s)
