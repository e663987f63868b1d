"""Job records in the state directory: ``jobs/<id>/job.json`` (0600, atomic) beside the rank logs.

A record is rewritten whole on every change; the previous version stays intact if a write fails
(full disk), so status never reads half a record.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import JobError, StateError
from ..schema.stages import JobRecord, from_dict, to_dict
from ..state import ensure_private_dir, read_json, state_dir, write_json


def new_job_id(now: float | None = None) -> str:
    """Sortable by start time, unique without coordination: ``hg-20261130-061502-3fa9``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"hg-{stamp}-{os.urandom(2).hex()}"   # what secrets.token_hex does, without its import


def jobs_root() -> Path:
    return ensure_private_dir(state_dir() / "jobs")


def job_dir(job_id: str) -> Path:
    if not job_id or "/" in job_id or job_id.startswith("."):
        raise JobError(f"invalid job id {job_id!r}")
    return ensure_private_dir(jobs_root() / job_id)


def save(record: JobRecord) -> None:
    write_json(job_dir(record.id) / "job.json", to_dict(record))


def load(job_id: str) -> JobRecord:
    path = jobs_root() / job_id / "job.json"
    data = read_json(path)
    if data is None:
        raise JobError(f"no job {job_id!r} (see 'hgtrain status' for the jobs there are)")
    try:
        return from_dict(JobRecord, data)
    except ValueError as exc:
        raise StateError(f"{path}: {exc}") from exc


def list_jobs() -> list[JobRecord]:
    """Every readable record, newest first; an unreadable one is skipped, not fatal to the list."""
    records = []
    for name in sorted(os.listdir(jobs_root()), reverse=True):
        try:
            records.append(load(name))
        except (JobError, StateError):
            continue
    return records


def attempt_job_id(job_id: str, attempt: int) -> str:
    """The job id the node agents of one attempt run under: an agent refuses a job id already used
    on its node, so each restart (``launch --restarts``) gets its own, ``<id>-r<attempt>``."""
    return job_id if attempt == 0 else f"{job_id}-r{attempt}"


def agent_job_id(record: JobRecord) -> str:
    """The agents' job id of the record's latest attempt (what status/logs/stop ask the nodes for)."""
    return attempt_job_id(record.id, len(record.restarts))
