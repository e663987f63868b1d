"""What a PS shard holds (ps/server.py): its range of the parameters, the optimizer over it, and (shard 0)
the model's floating-point buffers.

The parameters are one fp32 master vector cut into the optimizer's tensors (views, ``segments``);
pushes land in one staging buffer, the optimizer's ``.grad`` views, so a step copies nothing but the
push itself. Whoever reads the master or the optimizer state outside a step (answers, snapshots)
must keep steps out while it does (``ShardServer.readers``): this class takes no lock of its own.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Mapping

import torch

from . import optim
from ..errors import TrainingError
from .shards import Segment, segment_views


class ShardState:
    """What a PS shard holds: its range of the parameters (fp32 master), the optimizer over it, and on
    shard 0 the model's floating-point buffers; its checkpoint state."""

    def __init__(self, *, shard: int, shards: int, global_batch: int, accumulate: Mapping[int, int]) -> None:
        self.shard = shard
        self.shards = shards
        self.global_batch = global_batch
        self.accumulate = dict(accumulate)
        self.params: list[torch.Tensor] | None = None   # the optimizer's tensors: views of master
        self.master: torch.Tensor | None = None          # this shard's range of the flat parameters, fp32
        self.grad: torch.Tensor | None = None            # the staging buffer of pushes: the params' .grad
        self.segments: tuple[Segment, ...] | None = None
        self.opt_impl = ""
        self.opt: torch.optim.Optimizer | None = None
        self.opt_spec: dict[str, Any] | None = None
        self.update_s = 0.0                              # time in optimizer steps (and their scaling)
        # Shard 0 only, for models with buffers: the shared buffers (what answers carry) and, per
        # group, the buffers of its latest answer (what its pushed buffers moved on from).
        self.buffers: torch.Tensor | None = None
        self.answered_buffers: dict[int, torch.Tensor] = {}

    def install(self, master: torch.Tensor, segments: tuple[Segment, ...], opt_spec: dict[str, Any]) -> None:
        """Hold ``master`` and build the optimizer over its segments (refused before anything is held)."""
        master = master.float().contiguous().reshape(-1)
        params = segment_views(master, segments)
        opt, impl = optim.build_fast_optimizer(params, opt_spec)
        grad = torch.zeros_like(master)
        for p, g in zip(params, segment_views(grad, segments)):
            p.grad = g
        self.master, self.grad, self.params, self.segments = master, grad, params, segments
        self.opt, self.opt_spec, self.opt_impl = opt, opt_spec, impl

    def check_resumed(self, segments: tuple[Segment, ...], opt_spec: dict[str, Any],
                      buffers: torch.Tensor | None) -> None:
        """A seed after a resume: the checkpoint's values win, but the job must be the same model and
        optimizer. Its hyperparameters become the baseline pushes are relative to (ps/optim.py)."""
        assert self.params is not None and self.opt_spec is not None
        if self.segments != segments:
            raise TrainingError(f"PS shard {self.shard}: the model (or its cut into {self.shards} shards) "
                                f"does not match the checkpointed parameters")
        old = optim.normalise_spec(self.opt_spec, len(self.params))
        new = optim.normalise_spec(opt_spec, len(self.params))
        if not optim.same_structure(old, new):
            raise TrainingError(f"PS shard {self.shard}: the optimizer ({new['module']}.{new['qualname']}, "
                                f"{len(new['groups'])} parameter groups) does not match the checkpointed "
                                f"one ({old['module']}.{old['qualname']}, {len(old['groups'])} groups)")
        self.opt_spec = opt_spec
        if buffers is not None and (self.buffers is None or self.buffers.numel() != buffers.numel()):
            self.buffers = buffers        # a checkpoint without (these) buffers: start from the seed's
            self.answered_buffers = {}

    def check_push(self, group: int, grad: torch.Tensor) -> None:
        if self.params is None or self.opt is None or self.opt_spec is None or self.grad is None:
            raise TrainingError(f"PS shard {self.shard}: push from group {group} before the seed")
        if grad.numel() != self.grad.numel():
            raise TrainingError(f"PS shard {self.shard}: group {group} pushed {grad.numel()} values to a "
                                f"shard of {self.grad.numel()}")

    def step(self, grad: torch.Tensor, scale: float, hyper: optim.Hyperparameters) -> float:
        """One optimizer step on ``grad`` times ``scale`` with the worker's ``hyper``; its seconds."""
        assert self.params is not None and self.opt is not None and self.opt_spec is not None
        assert self.grad is not None
        t0 = time.perf_counter()
        if grad is not self.grad:    # in process; over the channel the push arrived in place
            self.grad.copy_(grad)    # widened: fp32 master copy and optimizer state, whatever the wire
        if scale != 1.0:
            self.grad.mul_(scale)
        optim.apply_hyperparameters(self.opt, optim.normalise_spec(self.opt_spec, len(self.params))["groups"],
                                    hyper)
        self.opt.step()
        update_s = time.perf_counter() - t0
        self.update_s += update_s
        return update_s

    def buffers_copy(self) -> torch.Tensor | None:
        # A copy: the answer is serialised later, on an RPC thread, while pushes may replace the average.
        return None if self.buffers is None else self.buffers.clone()

    def move_buffers(self, group: int, buffers: torch.Tensor, samples: float) -> None:
        """Apply what the group's own steps changed in the buffers it was last answered, weighted by
        its share of the global batch per local step: the shared running statistics then move as
        one synchronous step's would, by the momentum per global batch, whichever group computed it.

        Not an average of the groups' pushed buffers: those are mostly the shared buffers they were
        answered (a group's steps move running statistics by the momentum only), so an average
        keeps echoing whichever group pushes least often, or finished long ago, with the weight of
        one of its pushes, and the statistics lag behind the parameters (benchmarks/RESULTS.md has the
        measurement)."""
        if self.buffers is None:
            self.buffers = buffers          # a seed without buffers: nothing to move from
            return
        base = self.answered_buffers.get(group, self.buffers)
        share = samples / (self.accumulate.get(group, 1) * self.global_batch) if self.global_batch else 1.0
        self.buffers = self.buffers + min(1.0, share) * (buffers - base)

    def snapshot(self, taken: dict[str, Any]) -> dict[str, Any]:
        """The state at the version the checkpoint was scheduled on: ``taken`` holds what was copied
        under the lock; master and the optimizer state are copied here, on the writer's thread,
        while the reader it counts keeps steps out."""
        assert self.master is not None and self.opt is not None and self.segments is not None
        state: dict[str, Any] = {"master": self.master.clone(), "segments": [s.to_wire() for s in self.segments],
                                 "opt_spec": self.opt_spec, "optimizer": copy.deepcopy(self.opt.state_dict()),
                                 "data_positions": taken["data_positions"]}
        if taken["buffers"] is not None:
            state["buffers"] = taken["buffers"]
        if taken.get("group_shares") is not None:
            state["group_shares"] = taken["group_shares"]     # shard 0's shares across groups
        return state

    def load(self, data: Mapping[str, Any]) -> None:
        """A checkpoint's parameters, optimizer state and buffers."""
        self.install(data["master"], tuple(Segment.from_wire(s) for s in data["segments"]), data["opt_spec"])
        assert self.opt is not None
        self.opt.load_state_dict(data["optimizer"])
        # Older checkpoints also hold "group_buffers" (each group's last pushed buffers), which the
        # rule no longer needs: groups are answered the buffers again when they pull.
        self.buffers = data.get("buffers")
        self.answered_buffers = {}

