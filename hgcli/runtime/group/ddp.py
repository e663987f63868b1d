"""``weighted_ddp_hook``: a DDP communication hook for scripts that keep DistributedDataParallel.

DDP averages the ranks' gradients with equal weights (the plain mean of per-rank means). With a
different batch per rank that is not the gradient of the union batch: a rank of 3 samples counts as
much as one of 5. The hook scales rank i's bucket by ``b_i / sum_j b_j`` and all-reduces the sum, so
the result is ``sum_i b_i g_i / sum_i b_i``, the gradient of the union batch (as hgtrain's own
weighted all-reduce gives)::

    model = DistributedDataParallel(model)
    model.register_comm_hook(None, hg.weighted_ddp_hook)

``state`` is ``None`` (DDP's default process group, this rank's batch from the plan or
``HGTRAIN_BATCH_SIZE``), the process group the model's DDP uses, or a ``WeightedDDPState`` naming the
batch explicitly. The sum of the batches comes from one all-reduce at the first bucket and is kept.
"""
# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TrainingError


@dataclass
class WeightedDDPState:
    """``batch_size``: this rank's samples per step (None: the plan's, or ``HGTRAIN_BATCH_SIZE``);
    ``process_group``: the group DDP reduces over (None: the default group)."""
    batch_size: int | None = None
    process_group: Any = None
    total: float | None = None          # sum of every rank's batch, from the first bucket's all-reduce


# The states behind ``None`` and bare process groups, kept per group (the sum is computed once).
_IMPLICIT: dict[Any, WeightedDDPState] = {}


def _state_of(state: Any) -> WeightedDDPState:
    if isinstance(state, WeightedDDPState):
        return state
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"weighted_ddp_hook: state must be None, a process group or a WeightedDDPState, "
                        f"not {type(state).__name__}")
    key = state if state is not None else dist.group.WORLD
    if key not in _IMPLICIT:
        _IMPLICIT[key] = WeightedDDPState(process_group=state)
    return _IMPLICIT[key]


def _own_batch() -> int:
    from ..env import RankEnv

    env = RankEnv.from_environ()
    if not env.batch_size:
        raise TrainingError(f"weighted_ddp_hook: rank {env.rank} has no batch size: neither the plan "
                            f"(HGTRAIN_PLAN) nor HGTRAIN_BATCH_SIZE gives one; register the hook with "
                            f"WeightedDDPState(batch_size=...) as its state")
    return env.batch_size


def weighted_ddp_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Weight each rank's gradient by its batch: the union-batch gradient instead of DDP's plain mean."""
    st = _state_of(state)
    buf = bucket.buffer()
    if st.batch_size is None:
        st.batch_size = _own_batch()
    if st.total is None:
        # Once, on every rank at its first bucket (all ranks reduce their buckets in the same order,
        # so this blocking all-reduce pairs up); on the bucket's device, as NCCL needs CUDA tensors.
        total = torch.tensor([float(st.batch_size)], dtype=torch.float64, device=buf.device)
        dist.all_reduce(total, group=st.process_group)
        st.total = float(total.item())
        if st.total <= 0:
            raise TrainingError(f"weighted_ddp_hook: the ranks' batches sum to {st.total:g}")
    world = dist.get_world_size(st.process_group)
    if st.batch_size * world == st.total:
        buf.div_(world)         # equal batches: DDP's own mean, to the bit (not x 1/W, rounded)
    else:
        buf.mul_(st.batch_size / st.total)
    fut = dist.all_reduce(buf, group=st.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def engine_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook of hgtrain's own group engine (group/engine.py): ``state`` is the GroupEngine, which
    weights, paces and all-reduces the bucket."""
    fut: torch.futures.Future[torch.Tensor] = state.reduce_bucket(bucket)
    return fut
