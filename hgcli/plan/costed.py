"""The values the cost model reads and returns: a worker device with its fitted cost, a group's
figures, and a candidate layout with its predicted throughput (``Option``); and whether a plan
overlaps its exchanges (a job option the model prices). Every constant is documented in
docs/planning.md (change both together).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..schema.stages import Device as DeviceName, JobSpec, Strategy
from .memory import MemoryNeed

# Hybrid plans overlap each leader's PS exchange with its group's next step unless the job says
# (--overlap/--no-overlap); benchmarks/hybrid_links.py measured it (docs/planning.md, "Overlap").
OVERLAP_DEFAULT = False


def plan_overlap(job: JobSpec) -> bool:
    """Whether a hybrid or PS plan for ``job`` overlaps communication with compute."""
    return OVERLAP_DEFAULT if job.overlap is None else job.overlap


@dataclass(frozen=True)
class Device:
    """A usable worker device with its fitted cost: mean step time = a + c * batch, batch <= cap;
    ``noise`` = mean delay of a step / its noise-free time (hgcli.plan.fit.step_noise);
    ``benched`` = the largest batch its bench timed (0: costed from matmul figures); ``fitted``: the
    cost is fitted to a job's measured compute (devices.fit_to_rates), which had the node's CPU
    contention and the group's synchronous step in it already; ``together``: the cost is scaled to
    the device's steps beside its node's other devices (devices.beside_neighbours), which had the
    contention between them in it already. ``memory``: the model's and the device's memory
    (plan/memory.py); with it ``cap`` is None, since micro-batches, not the memory, bound its batch.
    ``micro``: the micro-batches its batch runs as (engines.micro_priced, whose ``a`` is paid once per
    micro-batch already); a sharded group's gathers per update follow them (plan/sharding.py)."""

    node: int          # index in inventory node order
    device: DeviceName
    emulated: bool
    speed: float
    a: float
    c: float
    cap: int | None
    noise: float = 0.0
    benched: int = 0
    fitted: bool = False
    together: bool = False
    memory: MemoryNeed | None = None
    micro: int = 1

    def time(self, batch: float) -> float:
        return self.a + self.c * batch

    def rate(self, batch: float) -> float:
        """Samples per second at ``batch``."""
        return batch / self.time(batch)


class GroupStats(NamedTuple):
    """A group's figures per synchronisation, before PS placement."""

    samples: float      # samples per step
    compute: float      # seconds per step of its slowest member
    sync: float         # all-reduce + broadcast seconds, uncontended
    latency: float      # the latency part of ``sync`` (stretched by oversubscription)
    leader: int         # node index of its leader
    noise: float        # noise of its noisiest member
    nodes: frozenset[int]


@dataclass(frozen=True)
class Option:
    """One candidate layout with its predicted throughput."""

    strategy: Strategy
    groups: tuple[tuple[int, ...], ...]   # device indices, in rank order
    accumulate: tuple[int, ...]
    ps_nodes: tuple[int, ...]             # node index of each PS rank
    staleness: int
    samples_per_s: float                  # the whole run's: every group's samples over the run
    summary: str
    # Each group's samples/s while it runs (its own steps, in ``groups`` order): what the launch
    # summary measures per group. Their sum exceeds ``samples_per_s`` where groups' steps differ.
    group_rates: tuple[float, ...] = ()
