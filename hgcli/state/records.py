"""Job records in the state directory: ``jobs/<id>/job.json`` (0600, atomic) beside the rank logs.

A record is rewritten whole on every change; the previous version stays intact if a write fails
(full disk), so status never reads half a record.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import JobError, StateError, UsageError
from ..schema.names import RULE as NAME_RULE, valid_name
from ..schema.stages import JobRecord, from_dict, to_dict
from . import ensure_private_dir, read_json, state_dir, write_json


def new_job_id(now: float | None = None) -> str:
    """Sortable by start time, unique without coordination: ``hg-20261130-061502-3fa9``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"hg-{stamp}-{os.urandom(2).hex()}"   # what secrets.token_hex does, without its import


def jobs_root() -> Path:
    return ensure_private_dir(state_dir() / "jobs")


def check_job_id(job_id: str) -> str:
    """A job id from the command line or a record: the node agent's name pattern, so an id is never a
    path (``../../tmp/x``, ``/tmp/x``) whose record would choose the cluster that status/stop contact."""
    if not valid_name(job_id):
        raise UsageError(f"invalid job id {job_id!r}: job ids are {NAME_RULE} (see 'hgtrain status')")
    return job_id


def job_dir(job_id: str) -> Path:
    return ensure_private_dir(jobs_root() / check_job_id(job_id))


def save(record: JobRecord) -> None:
    write_json(job_dir(record.id) / "job.json", to_dict(record))


def load(job_id: str) -> JobRecord:
    path = jobs_root() / check_job_id(job_id) / "job.json"
    data = read_json(path)
    if data is None:
        raise JobError(f"no job {job_id!r} (see 'hgtrain status' for the jobs there are)")
    try:
        record = from_dict(JobRecord, data)
    except ValueError as exc:
        raise StateError(f"{path}: {exc}") from exc
    if record.id != job_id:
        raise StateError(f"{path}: the record is of job {record.id!r}, not {job_id!r}")
    return record


def list_jobs() -> list[JobRecord]:
    """Every readable record, newest first; an unreadable one is skipped, not fatal to the list."""
    records = []
    for name in sorted(os.listdir(jobs_root()), reverse=True):
        try:
            records.append(load(name))
        except (JobError, StateError, UsageError):   # not a job's directory
            continue
    return records


def attempt_job_id(job_id: str, attempt: int) -> str:
    """The job id the node agents of one attempt run under: an agent refuses a job id already used
    on its node, so each restart (``launch --restarts``) gets its own, ``<id>-r<attempt>``."""
    return job_id if attempt == 0 else f"{job_id}-r{attempt}"


def agent_job_id(record: JobRecord) -> str:
    """The agents' job id of the record's latest attempt (what status/logs/stop ask the nodes for)."""
    return attempt_job_id(record.id, len(record.restarts))
