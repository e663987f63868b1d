"""The controller's side of a job on disk: the job record, each rank's log, ``metrics.jsonl``.

``jobs/<id>/job.json`` is rewritten whole and atomically on every state change (and at most every
``RECORD_EVERY_S`` for metrics alone, so a chatty rank does not turn into a write storm);
``rank<N>.log`` holds every line of the rank, stdout and stderr in arrival order; ``metrics.jsonl``
one JSON object per metric line, with ``rank`` and ``node`` added. All files 0600 in a 0700 dir.
Nothing here ever sees an environment value, so no secret can end up in these files through us.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

from ..state import records as jobs
from ..errors import StateError
from ..schema.stages import JobRecord, JobState, RankRecord, RankState

if TYPE_CHECKING:
    from .events import LogLines

RECORD_EVERY_S = 2.0
FLUSH_EVERY_S = 0.5
METRICS = "metrics.jsonl"


def _written(path: Path, write: Callable[[], object]) -> None:
    """``write()`` (a write, flush or close of ``path``); a full or failing disk is a StateError
    naming the file (exit 5), not an internal error."""
    try:
        write()
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _open_private(path: Path, *, binary: bool = False) -> IO[Any]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc
    if binary:
        return os.fdopen(fd, "wb", buffering=1 << 16)
    return os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", buffering=1 << 16)


class JobBook:
    """The controller's writer of one job's files: its record, each rank's log and the metrics file,
    flushed and saved at bounded intervals so readers such as ``logs -f`` keep up."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        self.dir = jobs.job_dir(record.id)
        self._logs: dict[int, IO[bytes]] = {}
        self._metrics: IO[str] | None = None
        self._dirty = False
        self._saved_at = 0.0
        self._flushed_at = 0.0
        self.save()
        if not record.detached:   # a detached job has no controller copy: `logs` asks the nodes
            for r in record.ranks:   # every rank has its log from the start, even a silent one
                _open_private(self.log_path(r.rank)).close()

    # -- record ------------------------------------------------------------------------------------

    def update(self, **changes: Any) -> None:
        self.record = dataclasses.replace(self.record, **changes)
        self.save()

    def update_rank(self, rank: int, *, save: bool = True, **changes: Any) -> None:
        ranks = tuple(dataclasses.replace(r, **changes) if r.rank == rank else r for r in self.record.ranks)
        self.record = dataclasses.replace(self.record, ranks=ranks)
        if save:
            self.save()
        else:
            self._dirty = True

    def rank(self, rank: int) -> RankRecord:
        return next(r for r in self.record.ranks if r.rank == rank)

    def save(self) -> None:
        jobs.save(self.record)
        self._dirty = False
        self._saved_at = time.monotonic()

    def tick(self) -> None:
        """Flush the files at most every FLUSH_EVERY_S (readers such as `hgtrain logs -f` see lines
        that late at worst); save metric-only changes at most every RECORD_EVERY_S."""
        now = time.monotonic()
        if now - self._flushed_at >= FLUSH_EVERY_S:
            self._flushed_at = now
            for rank, fh in self._logs.items():
                _written(self.log_path(rank), fh.flush)
            if self._metrics is not None:
                _written(self.dir / METRICS, self._metrics.flush)
        if self._dirty and time.monotonic() - self._saved_at >= RECORD_EVERY_S:
            self.save()

    # -- files ---------------------------------------------------------------------------------------

    def log_path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.log"

    def write_log(self, lines: LogLines) -> None:
        """A batch of the rank's lines in one write, as the console shows them (``LogLines.utf8``)."""
        if self.record.detached:
            return   # only the first lines would be here: the complete logs stay on the nodes
        fh = self._logs.get(lines.rank)
        if fh is None:
            fh = self._logs[lines.rank] = _open_private(self.log_path(lines.rank), binary=True)
        _written(self.log_path(lines.rank), lambda: fh.write(lines.utf8()))

    def write_metric(self, rank: int, node: str, data: dict[str, Any]) -> None:
        if self._metrics is None:
            self._metrics = _open_private(self.dir / METRICS)
        metrics = self._metrics
        _written(self.dir / METRICS, lambda: metrics.write(json.dumps({**data, "rank": rank, "node": node},
                                                                      default=str) + "\n"))
        self.update_rank(rank, save=False, last_metrics=data)

    def finish(self, state: JobState, exit_code: int, root_cause: str | None) -> None:
        # A rank never reported as ended (its node was lost) is not known to be gone: say so.
        ranks = tuple(dataclasses.replace(r, state=RankState.UNKNOWN) if r.state.is_running() else r
                      for r in self.record.ranks)
        self.record = dataclasses.replace(self.record, state=state, exit_code=exit_code, ranks=ranks,
                                          root_cause=root_cause, ended_at=time.time())
        self.close()
        self.save()

    def close(self) -> None:
        files: list[tuple[Path, IO[Any]]] = [(self.log_path(rank), fh) for rank, fh in self._logs.items()]
        if self._metrics is not None:
            files.append((self.dir / METRICS, self._metrics))
        self._logs, self._metrics = {}, None
        failed: StateError | None = None
        for path, fh in files:             # every file closed, the first failure reported
            try:
                _written(path, fh.close)
            except StateError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
