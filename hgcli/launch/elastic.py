"""``launch --nnodes MIN:MAX``: which nodes an elastic job runs on, and its plan on them.

At the start, the plan of every node whose probe is ok, at least MIN of them and at most MAX. Before
a restart, every node of the cluster is asked to run ``true``; those that answer are the next
attempt's nodes (the ones the job ran on first, so a spare that answers causes no re-plan, then the
others in the cluster file's order, at most MAX), and when they are not the last plan's, the job is
re-planned on them from the stored probe and bench (``plan.pipeline.replan_on``: no bench, so no time
of the devices), keeping the global batch and the PS shards' nodes (their checkpoints hold the
training state). torchrun's own elastic agent re-runs a rendezvous instead, which a heterogeneous plan
cannot use: its ranks and batches depend on which devices are left.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

from ..errors import HgError, UsageError
from ..remote.fanout import NodeResult
from ..remote.transport import Transport
from ..schema.stages import JobSpec, Plan
from .events import RootCause
from .request import LaunchRequest

REACH_S = 20.0  # an elastic restart's check that a node answers (an SSH connection and `true`)
REPLAN_PAUSE_ENV = "HGTRAIN_TEST_REPLAN_PAUSE"   # tests: seconds to wait after a re-plan


def parse_nnodes(text: str) -> tuple[int, int]:
    """``nnodes`` (``--nnodes``): "MIN:MAX" or "N" (N:N), as torchrun spells it."""
    parts = text.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2):
        raise UsageError(f"nnodes: expected MIN:MAX or N (whole numbers), got {text!r}")
    return (numbers[0], numbers[-1])


def plan_nodes(plan: Plan) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.node for r in plan.ranks))


def within_nnodes(request: LaunchRequest, plan: Plan, on_stage: Callable[[str, str], None]) -> Plan:
    """An elastic job's first plan: on at least MIN nodes (failed probes were skipped), at most MAX."""
    assert request.nnodes is not None
    low, high = request.nnodes
    nodes = plan_nodes(plan)
    if len(nodes) < low:
        raise HgError(f"nnodes {low}:{high}: only {len(nodes)} node(s) can run the job "
                      f"({', '.join(nodes) or 'none'}); see 'hgtrain probe'")
    if len(nodes) <= high:
        return plan
    from ..bench.rates import script_identity
    from ..plan.pipeline import replan_on

    return replan_on(request.cluster, same_batch(request, plan), list(nodes[:high]), on_stage=on_stage,
                     script=script_identity(request.command))


def same_batch(request: LaunchRequest, plan: Plan) -> JobSpec:
    """The job of a re-plan: the global batch stays the first plan's (each device then takes more)
    unless --global-batch set it."""
    if request.job.global_batch is not None or not plan.global_batch:
        return request.job
    return dataclasses.replace(request.job, global_batch=plan.global_batch)


def choose_nodes(request: LaunchRequest, old: Sequence[str], answering: set[str]) -> list[str]:
    """The next attempt's nodes in the cluster file's order: those of ``old`` that answer first, then
    the others that answer, at most MAX."""
    assert request.nnodes is not None
    order = [n.name for n in request.cluster.nodes]
    chosen = set(([n for n in old if n in answering] + [n for n in order if n in answering and n not in old])
                 [:request.nnodes[1]])
    return [n for n in order if n in chosen]


def below_min(request: LaunchRequest, number: int, old: Sequence[str], alive: Sequence[str],
              failed: Sequence[NodeResult[bool]]) -> RootCause | None:
    """Why the job fails when fewer than MIN nodes answer, naming them; else None (it goes on)."""
    assert request.nnodes is not None
    low = request.nnodes[0]
    if len(alive) >= low:
        return None
    gone = "; ".join(f"{r.node.name}: {r.error}" for r in failed)
    return RootCause(node=", ".join(sorted(set(old) - set(alive))) or "-", rank=None, exit_code=None,
                     signal=None, oom=None,
                     reason=f"cannot restart the job (restart {number}): only {len(alive)} node(s) answer "
                            f"({', '.join(alive) or 'none'}), --nnodes needs at least {low}; {gone}")


def change_reason(old: Sequence[str], alive: Sequence[str]) -> str:
    """``lost host3; back host1``."""
    lost = [n for n in old if n not in alive]
    back = [n for n in alive if n not in old]
    return "; ".join(part for part in (f"lost {', '.join(lost)}" if lost else "",
                                       f"back {', '.join(back)}" if back else "") if part)


def replan(request: LaunchRequest, last: Plan, nodes: list[str], on_stage: Callable[[str, str], None]) -> Plan:
    """The plan of the next attempt on ``nodes``, from the stored profiles."""
    from ..bench.rates import script_identity
    from ..plan.pipeline import replan_on
    from ..plan.slowdowns import with_slowdowns

    plan = replan_on(request.cluster, same_batch(request, last), nodes, on_stage=on_stage,
                     script=script_identity(request.command), keep_ps=ps_layout(last))
    pause = float(os.environ.get(REPLAN_PAUSE_ENV) or 0)
    if pause:                           # fault injection for tests: a controller killed here
        time.sleep(pause)
    return with_slowdowns(plan, request.cluster)


def ps_layout(plan: Plan) -> tuple[str, ...]:
    """Where the PS shards run, in shard order: the checkpoint files of one layout fit only it."""
    return tuple(plan.rank(r).node for r in plan.ps_shards)


def reachable(transport: Transport) -> bool:
    """Whether the node answers a trivial command (an elastic restart takes back lost nodes that do)."""
    done = transport.run(["true"], timeout=REACH_S)
    if done.exit_code != 0:
        raise HgError(f"'true' exited with {done.exit_code}")
    return True
