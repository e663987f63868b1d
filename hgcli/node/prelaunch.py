"""Node-side preparation before a job's agent starts: the plan file, and a free port for rank 0.

    python -m hgcli.node.prelaunch --job JOB --node NODE [--jobs-root DIR] [--port]
                                   [--checkpoints DIR]   < plan.json

Writes the plan read on stdin to ``<jobs root>/<job>/<node>/plan.json`` (the agent's job directory,
created here 0700; the agent accepts it because it holds no ``agent.json`` yet), so ``HGTRAIN_PLAN``
points at a file on the node itself. With ``--port`` it also asks this node's kernel for a free TCP
port for ``MASTER_PORT``: a port free on the controller says nothing about rank 0's node. The port is
released before rank 0 binds it, so another process could take it in between (torchrun has the same
window); the kernel hands out ephemeral ports round-robin, which makes that rare.
With ``--checkpoints DIR`` (a restart of a job with PS ranks) it lists the PS checkpoint versions each
shard has a file of there: PS shards on different nodes each keep their own files, so only the
launcher, from every node's list, can tell which version is complete.

One frame on stdout: ``{"type": "prelaunch", "job_dir", "plan", "port", "checkpoints"}``
(``checkpoints``: shard -> versions, or null); bad input: an ``error`` frame and exit 2.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from . import frames
from ..runtime.checkpoint import versions_by_shard
from .spec import DEFAULT_JOBS_ROOT, job_dir
from ..errors import StateError
from ..state import ensure_private_dir, write_private

PLAN_FILE = "plan.json"


def free_port() -> int:
    """A port nothing listens on right now, on every address of this node (rank 0 binds 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.prelaunch", description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--jobs-root", default=DEFAULT_JOBS_ROOT)
    p.add_argument("--port", action="store_true", help="also report a free TCP port")
    p.add_argument("--checkpoints", type=Path, help="also list the PS checkpoint versions in this directory")
    args = p.parse_args(argv)
    text = sys.stdin.read()
    try:
        json.loads(text)
        path = job_dir(args.jobs_root, args.job, args.node)
        ensure_private_dir(path.parent)
        ensure_private_dir(path)
        write_private(path / PLAN_FILE, text)
    except ValueError as exc:
        frames.emit({"type": "error", "message": f"bad input: {exc}"})
        return 2
    except StateError as exc:
        frames.emit({"type": "error", "message": str(exc)})
        return 2
    frames.emit({"type": "prelaunch", "job_dir": str(path), "plan": str(path / PLAN_FILE),
                 "port": free_port() if args.port else None,
                 "checkpoints": versions_by_shard(args.checkpoints) if args.checkpoints else None})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
