"""The agent's own frames to the controller, each built by one function returning its protocol
TypedDict (``hgcli.node.protocol``), so the type checker holds every writer to the frame's fields.

The controller reads them in ``hgcli.launch.inbound``; tests/unit/test_agent_frames.py sends each
kind through the wire and that decoder, so the two sides cannot drift apart. The frames built
elsewhere are typed the same way where they are made: exit (``ranks.Rank.frame``), logs and metric
(``logs``), prepared (``prelaunch``), and --status, --stop, --tail's (``control``).
"""
from __future__ import annotations

import os
import time

from ..protocol import (AgentFrame, DetachedFrame, EndFrame, ErrorFrame, ExitFrame, FrameType, HeartbeatFrame,
                        NodeJobState, StartedFrame, StoppingFrame, WarningFrame)


def agent(job_id: str, node: str, job_dir: str, *, detached: bool) -> AgentFrame:
    """The first frame of a job: who this agent is (its pid, for --stop) and where its files are."""
    return {"type": FrameType.AGENT, "job_id": job_id, "node": node, "pid": os.getpid(), "job_dir": job_dir,
            "detached": detached}


def started(rank: int, pid: int) -> StartedFrame:
    """A rank's process started, leading its own process group (so its pgid is its pid)."""
    return {"type": FrameType.STARTED, "rank": rank, "pid": pid, "pgid": pid}


def detached(job_id: str, node: str) -> DetachedFrame:
    """The agent goes on in the background: the last frame the controller reads from it."""
    return {"type": FrameType.DETACHED, "job_id": job_id, "node": node, "pid": os.getpid()}


def heartbeat() -> HeartbeatFrame:
    return {"type": FrameType.HEARTBEAT, "time": time.time()}


def stopping(reason: str, *, failed: bool, requested: bool) -> StoppingFrame:
    return {"type": FrameType.STOPPING, "reason": reason, "failed": failed, "requested": requested}


def end(job_id: str, node: str, state: NodeJobState, reason: str | None, first_failure: ExitFrame | None, *,
        logs_complete: bool, bytes_dropped: int) -> EndFrame:
    return {"type": FrameType.END, "job_id": job_id, "node": node, "state": state, "reason": reason,
            "first_failure": first_failure, "logs_complete": logs_complete, "bytes_dropped": bytes_dropped}


def warning(message: str) -> WarningFrame:
    """The agent's own warning (a rank's bad metrics line carries its rank: ``logs.metric_frames``)."""
    return {"type": FrameType.WARNING, "message": message}


def error(message: str) -> ErrorFrame:
    """The agent refuses the job or the command, having started nothing."""
    return {"type": FrameType.ERROR, "message": message}
