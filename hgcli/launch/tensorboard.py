"""TensorBoard event files of a job: written live by ``hgtrain launch --tensorboard DIR`` or afterwards
by ``hgtrain metrics JOB --format tensorboard -o DIR``, the same files either way.

Layout: ``DIR/<job id>/<run>/events.out.tfevents.*``, one run per rank, per group and one for the
job (``series.py`` names them and their tags), so ``tensorboard --logdir DIR`` lists every job
written there and compares them. The writer is the tensorboard package's own event file writer
(the optional extra ``hgtrain[tensorboard]``, which also brings the ``tensorboard`` command to view
them): it needs neither TensorFlow nor torch, so the controller keeps its rule of never importing
torch (tensorboardX's SummaryWriter imports torch whenever it is installed: 4 s and gigabytes).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..errors import UsageError
from ..schema.stages import JobRecord, Plan
from .series import Point, Series, points_of

if TYPE_CHECKING:
    from .events import Event

INSTALL = "pip install 'hgtrain[tensorboard]'"
LIVE_FLUSH_S = 2.0   # how stale a live TensorBoard may be


def require_writer() -> None:
    """A UsageError naming the pip command when the tensorboard package is missing."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        raise UsageError(f"TensorBoard output needs the tensorboard package: {INSTALL}") from None


def _directory(root: Path) -> Path:
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root}: not a directory (TensorBoard writes a directory of event files)")
    return root


class EventFiles:
    """One event file writer per run under ``root/job_id``, opened on the run's first point. The
    writer queues events and writes them on its own thread (at most ``flush_s`` late)."""

    def __init__(self, root: Path, job_id: str, *, flush_s: float = 120.0) -> None:
        require_writer()
        self.dir = _directory(root) / job_id
        self._flush_s = flush_s
        self._writers: dict[str, Any] = {}

    def write(self, points: Iterable[Point]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        for p in points:
            writer = self._writers.get(p.run)
            if writer is None:
                try:
                    writer = self._writers[p.run] = EventFileWriter(str(self.dir / p.run), max_queue_size=1000,
                                                                    flush_secs=self._flush_s)
                except OSError as exc:
                    raise UsageError(f"cannot write {self.dir / p.run}: {exc.strerror or exc}") from exc
            writer.add_event(Event(wall_time=p.time, step=p.step,
                                   summary=Summary(value=[Summary.Value(tag=p.tag, simple_value=p.value)])))

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def export(record: JobRecord, rows: list[dict[str, Any]], root: Path) -> Path:
    """Every point of the recorded rows as event files; returns the job's directory."""
    files = EventFiles(root, record.id)
    try:
        files.write(points_of(record.plan, rows))
    finally:
        files.close()
    return files.dir


class LiveEvents:
    """``launch --tensorboard``: wraps the launch's event sink, so the points are made and written on
    the console's thread, never on the controller loop that drains the agents.

    Made before anything starts (so a missing package fails first); ``begin`` gives it the plan
    before the first metric can arrive."""

    def __init__(self, root: Path, job_id: str) -> None:
        self.job_id = job_id
        self.files = EventFiles(root, job_id, flush_s=LIVE_FLUSH_S)
        self._series: Series | None = None
        self._lock = threading.Lock()

    def begin(self, plan: Plan) -> None:
        with self._lock:
            self._series = Series(plan)

    def wrap(self, sink: Callable[[Event], None]) -> Callable[[Event], None]:
        from .events import JobEnded, Metric, Notice

        def on_event(event: Event) -> None:
            if isinstance(event, Metric):
                try:
                    self._add(event.rank, event.data)
                except (OSError, UsageError) as exc:   # the job goes on: its metrics.jsonl has it all
                    self._series = None
                    sink(Notice(self.job_id, None, f"TensorBoard files no longer written: {exc}"))
            elif isinstance(event, JobEnded):
                self.close()
            sink(event)

        return on_event

    def _add(self, rank: int, data: dict[str, Any]) -> None:
        with self._lock:
            if self._series is not None:
                self.files.write(self._series.add(rank, data))

    def close(self) -> None:
        with self._lock:
            self.files.close()
