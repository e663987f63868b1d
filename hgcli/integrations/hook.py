"""The DDP communication hook every integration registers on the DDP its framework built.

It is ``hgcli.runtime.group.ddp.weighted_ddp_hook`` (each rank's bucket weighted by its batch: the union
batch's gradient) with device emulation's pacing in front: under emulation a bucket leaves when the
emulated device would have computed it, so the all-reduce overlaps the stretched step as it would on
a GPU (``Emulator.pace``). ``weighted=False`` keeps DDP's plain mean (a loss the framework already
normalised over every rank's samples, as the Hugging Face Trainer does with
``average_tokens_across_devices``), still paced.
"""
# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.group.ddp import WeightedDDPState, weighted_ddp_hook
from ..runtime.emulate import Emulator


@dataclass
class PacedState(WeightedDDPState):
    """``WeightedDDPState`` plus the rank's emulator (None: a real device, nothing to pace)."""
    emulator: Emulator | None = None
    weighted: bool = True


def paced_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Pace the bucket to the emulated device, then all-reduce it weighted by the ranks' batches."""
    if state.emulator is not None:
        state.emulator.pace()
    if state.weighted:
        return weighted_ddp_hook(state, bucket)
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state.process_group))       # DDP's own mean, to the bit
    fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
