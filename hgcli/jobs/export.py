"""`hgtrain metrics JOB`: a job's metrics (``ctx.log`` records, as ``metrics.jsonl`` in its job
directory) as CSV for a spreadsheet or pandas, or as JSON lines, optionally only some ranks.

The file is the controller's copy, written while ``hgtrain launch`` was attached (launch/record.py);
a detached job's metrics reach no controller, so that case is an error that says so. A controller
killed mid-write leaves an unterminated last line: it is skipped. Any other line that is not a JSON
object is an error naming ``file:line``: a damaged file is not silently half-exported.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterable

from . import records as jobs
from ..errors import JobError, StateError
from ..schema.stages import JobRecord

METRICS_FILE = "metrics.jsonl"
# First, in this order, where present; every other key follows sorted (one column per key seen).
LEADING = ("time", "node", "rank", "group", "role", "event", "step", "loss", "samples")


def metrics_path(record: JobRecord) -> Path:
    return jobs.job_dir(record.id) / METRICS_FILE


def read_metrics(record: JobRecord, ranks: Iterable[int] | None = None) -> list[dict[str, Any]]:
    path = metrics_path(record)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if record.detached:
            raise JobError(f"job {record.id} was started with --detach: its metrics stayed on the nodes "
                           "(the ranks' metrics files there); this machine has none") from None
        return []
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    lines = data.split(b"\n")
    if lines[-1]:
        lines.pop()   # unterminated: the writer died in the middle of it
    wanted = None if ranks is None else set(ranks)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise StateError(f"{path}:{number}: not a metrics record ({exc})") from None
        if not isinstance(row, dict):
            raise StateError(f"{path}:{number}: not a metrics record (a JSON object)")
        if wanted is None or row.get("rank") in wanted:
            rows.append(row)
    return rows


def columns(rows: list[dict[str, Any]]) -> list[str]:
    seen = {key for row in rows for key in row}
    return [k for k in LEADING if k in seen] + sorted(seen - set(LEADING))


def to_csv(rows: list[dict[str, Any]]) -> str:
    """One row per record, one column per key any record has; a missing value is an empty cell,
    a nested value (a list, an object) its JSON."""
    out = io.StringIO()
    names = columns(rows)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(names)
    for row in rows:
        writer.writerow([_cell(row.get(name)) for name in names])
    return out.getvalue()


def to_jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return value
