"""The together bench of one node: its devices stepping at once, as they will train.

After a node's devices were benched one at a time (``DeviceProfile.steps``: each device's own
speed), ``python -m hgcli.node.bench.together`` runs all of them at once, one process each, over
common windows (hgcli/node/bench/together.py), and each device's profile gets what it measured
(``DeviceProfile.together``). The planner costs devices from those figures, so the prediction holds
the contention between a node's devices (docs/bench.md, "Devices together"); the alone figures stay
the ideal.

The job is chosen here from the alone figures: per phase, the fastest device runs one of its benched
batches and every other device the batch whose alone step lasts about as long (a plan splits its
batch by speed, so its devices' steps are of about one length), so all of them step side by side
for the whole window, as a job's ranks do.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Callable

from ..errors import RemoteError
from ..node.protocol import FrameType, frame_type
from ..remote.node_program import NodeProgram
from ..remote.transport import Transport
from ..schema.stages import DeviceProfile, NodeSpec, StepSample, TogetherProfile, from_dict

# Phases: the fastest device's largest benched batches whose alone step is at most PHASE_STEP_S, at
# most PHASES of them (a plan's batches sit near the knee of the throughput curve, below the largest
# sizes a bench times; two sizes let a scale of the line be checked at two points).
PHASE_STEP_S = 0.1
PHASES = 2
# A phase ends when every device has this many counted steps and it lasted this long, or at its
# most (quick, full): a few seconds on a quiet node, bounded on a busy one.
STEPS = {True: 8, False: 20}
LEAST_S = {True: 1.5, False: 4.0}
MOST_S = {True: 8.0, False: 20.0}
WARMUP = 2
# The whole program: the processes' torch import on a loaded node, the phases, the answers.
TIMEOUT_S = 300.0


def together_job(profiles: list[DeviceProfile], quick: bool) -> dict[str, Any] | None:
    """The node program's job for these alone profiles of one node, or None when fewer than two of
    its devices were benched without error (one device alone is already as it trains)."""
    usable = [p for p in profiles if not p.error and _timed(p)]
    if len(usable) < 2:
        return None
    reference = max(usable, key=lambda p: max(s.batch_size / s.seconds.median for s in _timed(p)))
    sizes = [s for s in _timed(reference) if s.seconds.median <= PHASE_STEP_S] or _timed(reference)[:1]
    targets = [s.seconds.median for s in sizes[-PHASES:]]
    return {"devices": [{"device": p.device, "speed": p.speed if p.emulated else None,
                         "batches": [batch_for(p, t) for t in targets]} for p in usable],
            "steps": STEPS[quick], "least_s": LEAST_S[quick], "most_s": MOST_S[quick], "warmup": WARMUP}


def batch_for(p: DeviceProfile, seconds: float) -> int:
    """The batch whose alone step (the benched medians, linear between benched sizes) is closest to
    ``seconds``, within the device's benched sizes."""
    steps = _timed(p)
    low, high = steps[0].batch_size, steps[-1].batch_size
    return min(range(low, high + 1), key=lambda b: abs(alone_seconds(steps, b) - seconds))


def alone_seconds(steps: list[StepSample], batch: float) -> float:
    """The benched median step at ``batch``, linear between the benched sizes around it."""
    for s, t in zip(steps, steps[1:]):
        if batch <= t.batch_size:
            share = (batch - s.batch_size) / (t.batch_size - s.batch_size)
            return s.seconds.median + share * (t.seconds.median - s.seconds.median)
    return steps[-1].seconds.median


def _timed(p: DeviceProfile) -> list[StepSample]:
    return sorted((s for s in p.steps if s.batch_size > 0 and s.seconds.median > 0), key=lambda s: s.batch_size)


def bench_together(transport: Transport, node: NodeSpec, profiles: list[DeviceProfile], quick: bool, spec: str,
                   on_stage: Callable[[str], None]) -> list[DeviceProfile]:
    """``profiles`` with each measured device's ``together`` figures; unchanged when the node has
    fewer than two usable devices or the program measured nothing (its note says why)."""
    job = together_job(profiles, quick)
    if job is None:
        return profiles
    args = ["--node", node.name, "--model", spec, "--job", json.dumps(job), "--lifeline"]
    deadline = time.monotonic() + TIMEOUT_S
    measured: dict[str, TogetherProfile] = {}
    try:
        with NodeProgram(transport, "bench.together", args, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) as program:
            for frame in program.frames(deadline):
                match frame_type(frame):
                    case FrameType.PROGRESS | FrameType.NOTE:
                        on_stage(str(frame.get("stage") or frame.get("message")))
                    case FrameType.TOGETHER:
                        measured = {d: from_dict(TogetherProfile, v) for d, v in frame["devices"].items()}
            program.finish(deadline)
    except RemoteError as exc:
        on_stage(f"devices together not measured: {exc.reason}")
    except (ValueError, KeyError) as exc:   # a frame of the wrong shape: a version mismatch on the node
        on_stage(f"devices together not measured: bad result from the node: {exc}")
    return [replace(p, together=measured[p.device]) if p.device in measured else p for p in profiles]
