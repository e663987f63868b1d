"""Node-side preparation before a job's spec: the plan file, and a free port for rank 0.

The agent's first exchange with the launcher (docs/agent.md): the launcher sends
``{"type": "prepare", "job_id", "node", "jobs_root", "plan": "<plan JSON>", "port": true|false,
"checkpoints": DIR|null}`` as the first line of the agent's stdin, and the agent answers
``{"type": "prepared", "job_dir", "plan", "port", "checkpoints"}`` before it reads its spec. It is part of the agent, not a program of its own, so a launch starts one
Python per node instead of two.

The plan is written to ``<jobs root>/<job>/<node>/plan.json`` (the agent's job directory, created here
0700; the spec that follows is accepted because the directory holds no ``agent.json`` yet), so
``HGTRAIN_PLAN`` points at a file on the node itself. With ``port`` this node's kernel is asked for a
free TCP port for ``MASTER_PORT``: a port free on the controller says nothing about rank 0's node. The
port is released before rank 0 binds it, so another process could take it in between (torchrun has
the same window); hgcli.node.ports picks it below the ephemeral range, where no outgoing connection lands.
With ``checkpoints`` (a restart of a job with PS ranks) it lists the PS checkpoint versions each shard
has a file of in that directory (shard -> versions, else null): PS shards on different nodes each keep
their own files, so only the launcher, from every node's list, can tell which version is complete.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .spec import DEFAULT_JOBS_ROOT, job_dir
from ..ports import free_port
from ..protocol import FrameType, PreparedFrame
from ...state import ensure_private_dir, write_private

PLAN_FILE = "plan.json"


def prepare(request: dict[str, Any]) -> PreparedFrame:
    """Write the plan, find the port; the ``prepared`` answer. ValueError for a bad request,
    StateError when the directory or file cannot be written."""
    plan = request.get("plan")
    if not isinstance(plan, str):
        raise ValueError("the prepare request has no plan")
    json.loads(plan)
    path = job_dir(str(request.get("jobs_root") or DEFAULT_JOBS_ROOT), str(request.get("job_id")),
                   str(request.get("node")))
    ensure_private_dir(path.parent)
    ensure_private_dir(path)
    write_private(path / PLAN_FILE, plan)
    checkpoints = request.get("checkpoints")
    if checkpoints:
        from ...runtime.checkpoint import versions_by_shard   # only on restarts: keeps start-up short
        listed: dict[int, list[int]] | None = versions_by_shard(Path(str(checkpoints)))
    else:
        listed = None
    return {"type": FrameType.PREPARED, "job_dir": str(path), "plan": str(path / PLAN_FILE),
            "port": free_port() if request.get("port") else None, "checkpoints": listed}
