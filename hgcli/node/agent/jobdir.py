"""The node-local job directory and its record, ``agent.json``.

``<jobs root>/<job id>/<node>/`` (0700) holds ``agent.json`` (0600, replaced atomically), the rank
logs ``rank-<r>.out|err``, ``rank-<r>.metrics.jsonl``, and ``agent.log`` of a detached agent. A fresh
connection finds everything about a job here, even when its agent is gone.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...schema.deepjson import loads_bounded
from ...state import read_json
from ..protocol import NodeJobState
from .spec import check_name

RECORD = "agent.json"
AGENT_LOG = "agent.log"
# Written by ``agent --stop`` before it signals the agent: a SIGTERM with it is 'hgtrain stop', one
# without it came from elsewhere (the machine shutting down, a kill), which a launch under
# --restarts takes as a lost node rather than as the user's stop.
STOP_REQUESTED = "stop-requested"


def record_path(job_dir: Path) -> Path:
    return job_dir / RECORD


def request_stop(job_dir: Path) -> None:
    (job_dir / STOP_REQUESTED).touch(mode=0o600)


def stop_requested(job_dir: Path) -> bool:
    return (job_dir / STOP_REQUESTED).exists()


def read_record(job_dir: Path) -> dict[str, Any] | None:
    data = read_json(record_path(job_dir))
    return data if isinstance(data, dict) else None


def record_finished(record: dict[str, Any]) -> bool:
    """The record's agent finished its job (the record will not change again)."""
    return NodeJobState.parse(record.get("state")).is_final()


def node_dirs(jobs_root: str, job_id: str, node: str | None) -> list[Path]:
    """The job's directories on this host (one per node name sharing the host), that hold a record."""
    job = Path(os.path.expanduser(jobs_root)) / check_name("job id", job_id)
    if node is not None:
        candidates = [job / check_name("node name", node)]
    else:
        try:
            candidates = sorted(p for p in job.iterdir() if p.is_dir())
        except OSError:
            candidates = []
    return [p for p in candidates if record_path(p).is_file()]


def last_line(path: Path, limit: int = 1 << 16) -> bytes | None:
    """The last complete line of ``path`` (read from the end, bounded), or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            tail = fh.read()
    except OSError:
        return None
    # The piece after the last newline is unfinished (or empty): never report half a line.
    lines = [ln for ln in tail.split(b"\n")[:-1] if ln.strip()]
    return lines[-1] if lines else None


def last_metrics(path: Path) -> dict[str, Any] | None:
    line = last_line(path)
    if line is None:
        return None
    try:
        data = loads_bounded(line)
    except ValueError:
        return None
    # A rank's numbers as it wrote them: NaN or 1e400 would make ``status --json`` print NaN.
    # Imported here: the schema's records would add to every launch's agent start-up (test_agent_startup).
    from ...schema.records import clean_record

    return clean_record(data)[0] if isinstance(data, dict) else None
