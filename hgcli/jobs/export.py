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

from ..schema.deepjson import loads_bounded
from ..state import records as jobs
from ..errors import JobError, StateError
from ..schema.records import EVENT
from ..schema.stages import JobRecord

METRICS_FILE = "metrics.jsonl"
# First, in this order, where present; every other key follows sorted (one column per key seen).
LEADING = ("time", "node", "rank", "group", "role", EVENT, "step", "loss", "samples")
# More columns than a spreadsheet view is of use for; the rest are left out, and the caller says so.
MAX_COLUMNS = 256
# A cell a spreadsheet would read as a formula (OWASP's CSV injection list): written after a "'".
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


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
            row = loads_bounded(line)
        except ValueError as exc:
            raise StateError(f"{path}:{number}: not a metrics record ({exc})") from None
        if not isinstance(row, dict):
            raise StateError(f"{path}:{number}: not a metrics record (a JSON object)")
        if wanted is None or row.get("rank") in wanted:
            rows.append(row)
    return rows


def columns(rows: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The CSV's columns and how many keys were left out. At most MAX_COLUMNS: the LEADING ones, then
    the others in the order they first appear (a rank that logs a new key per step would otherwise
    turn a small metrics file into a CSV many times its size, built in memory)."""
    seen = dict.fromkeys(key for row in rows for key in row)   # insertion order: first appearance
    leading = [k for k in LEADING if k in seen]
    others = [k for k in seen if k not in LEADING][:max(0, MAX_COLUMNS - len(leading))]
    kept = leading + sorted(others)
    return kept, len(seen) - len(kept)


def to_csv(rows: list[dict[str, Any]]) -> tuple[str, int]:
    """One row per record, one column per key any record has (the first MAX_COLUMNS of them; the
    count of keys left out is returned for the caller to say so); a missing value is an empty cell,
    a nested value (a list, an object) its JSON."""
    out = io.StringIO()
    names, dropped = columns(rows)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([_neutral(name) for name in names])
    for row in rows:
        writer.writerow([_cell(row.get(name)) for name in names])
    return out.getvalue(), dropped


def to_jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return _neutral(value) if isinstance(value, str) else value   # a number (-1.5) stays a number


def _neutral(text: str) -> str:
    """A rank's string as text, never a formula: =HYPERLINK(...) in a metric would run when the CSV
    is opened in a spreadsheet."""
    return "'" + text if text.startswith(_FORMULA_START) else text
