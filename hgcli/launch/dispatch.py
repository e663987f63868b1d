"""The dispatcher that keeps the console off the controller's hot path: events are shown on their own
thread, in order, with a bounded backlog (``Dispatcher``). Apart from ``events.py``: the spill file
(``spill.py``) stores events and the dispatcher writes to it, so the event types sit below both.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from .events import Event, LogLines, Metric, Notice, Progress
from .mailbox import Mailbox
from .spill import SpillFile


@dataclass
class _SpillRun:
    """A marker in the console's queue: the events in ``[start, end)`` of the spill file come here,
    in order. ``open`` while the controller still appends to it (``end`` grows)."""

    start: int
    end: int
    open: bool = True


class Dispatcher:
    """Calls ``sink`` for every event on its own thread, in order; ``close`` waits for the backlog.

    The controller never waits for the console; the backlog it leaves is bounded:
    - a terminal (``may_skip``): past ``MAX_BACKLOG`` lines or ``MAX_BACKLOG_BYTES`` of rank output
      waiting, log lines are not shown (they are all in the rank files) and a notice says how many
      were skipped. Every other event is always shown.
    - a pipe or ``--json`` reader (not ``may_skip``) gets every line: past ``MAX_BACKLOG_BYTES`` of
      rank output waiting in memory, rank lines and metrics go to a spill file on disk
      (``launch/spill.py``) and the console catches up from it, in order; once it has, events are
      held in memory again. Memory held for the console: at most MAX_BACKLOG_BYTES of rank output
      plus one batch (at most 1 MiB), plus hgtrain's own few events (starts, exits, notices).
    The backlog counts lines and bytes, not events: one ``LogLines`` may carry thousands."""

    MAX_BACKLOG = 100_000             # lines a terminal may lag behind before lines are skipped
    MAX_BACKLOG_BYTES = 16 << 20      # bytes of rank output held in memory for the console

    def __init__(self, sink: Callable[[Event], None], *, may_skip: bool = True,
                 spill_dir: str | None = None) -> None:
        self._sink = sink
        self._may_skip = may_skip   # False: never skip (a pipe or --json reader wants every line)
        self._spill_dir = spill_dir
        self._box: Mailbox[Event | _SpillRun | None] = Mailbox()
        # Lines and bytes queued in memory (by the producer only) and taken (by the console thread
        # only): each counter has one writer, so their difference is the backlog without a lock.
        self._queued = self._queued_bytes = 0
        self._taken = self._taken_bytes = 0
        self._skipped = 0       # the same for lines not shown (producer) and lines told about (console)
        self._told = 0
        self._job_id = ""
        # Spilling (not may_skip): the run the producer appends to, under the lock (the console
        # closes it when it has caught up).
        self._lock = threading.Lock()
        self._spill: Any = None   # a SpillFile, created on the first overflow
        self._run: _SpillRun | None = None
        self.spilled_bytes = 0    # rank output that went through the spill file (for tests, figures)
        self._thread = threading.Thread(target=self._run_console, name="hgtrain-console", daemon=True)
        self._thread.start()
        self.error: BaseException | None = None

    def put(self, event: Event) -> None:
        if isinstance(event, LogLines):
            if self._may_skip:
                self._put_skippable(event)
                return
            with self._lock:
                if self._run is None and self._queued_bytes - self._taken_bytes < self.MAX_BACKLOG_BYTES:
                    self._queued_bytes += len(event.data)
                else:
                    self._spill_event(event)
                    return
        elif self._run is not None:   # read without the lock: only this thread sets it
            if isinstance(event, Progress):
                return   # a live view from the past: the next one is newer (no sink but rich shows it)
            with self._lock:
                if self._run is not None:
                    if isinstance(event, Metric):
                        self._spill_event(event)
                        return
                    self._run.open = False   # this event goes after the run, in memory
                    self._run = None
        self._box.put(event)

    def _put_skippable(self, event: LogLines) -> None:
        # Lines are counted only where they may be skipped: counting a flood's newlines twice (here
        # and on the console thread) was a tenth of the controller's work for a pipe reader.
        if (self._queued - self._taken >= self.MAX_BACKLOG
                or self._queued_bytes - self._taken_bytes >= self.MAX_BACKLOG_BYTES):
            self._skipped += event.count()
            self._job_id = event.job_id
            return
        self._queued += event.count()
        self._queued_bytes += len(event.data)
        self._box.put(event)

    def _spill_event(self, event: LogLines | Metric) -> None:
        """Under the lock: append to the open run, opening one (and the file) if needed."""
        if self._spill is None:
            self._spill = SpillFile(self._spill_dir)
        if self._run is None:
            self._run = _SpillRun(self._spill.end, self._spill.end)
            self._box.put(self._run)
        self._spill.append(event)
        self._run.end = self._spill.end
        if isinstance(event, LogLines):
            self.spilled_bytes += len(event.data)

    def _run_console(self) -> None:
        while True:
            for event in self._box.take(None):
                if event is None:
                    return
                if isinstance(event, _SpillRun):
                    self._catch_up(event)
                    continue
                if isinstance(event, LogLines):
                    self._taken_bytes += len(event.data)
                    if self._may_skip:
                        self._taken += event.count()
                elif self._skipped > self._told:
                    skipped = self._skipped - self._told
                    self._told += skipped
                    self._show(Notice(self._job_id, None, f"{skipped} log lines not shown: the console "
                                                          "could not keep up (every line is in the rank files)"))
                self._show(event)

    def _catch_up(self, run: _SpillRun) -> None:
        """Show a run's events from the spill file, one at a time, until it is closed and read; a run
        still open when we reach its end is closed here (later events queue in memory again)."""
        pos = run.start
        while True:
            with self._lock:
                if pos >= run.end:
                    if run.open:
                        run.open = False
                        self._run = None
                    if pos == self._spill.end:
                        self._spill.reset()   # nothing written is unread: give the disk back
                    return
            if self.error is not None:
                pos = run.end   # nobody reads any more (closed pipe): skip, do not read
                continue
            event, pos = self._spill.read(pos)
            self._show(event)

    def _show(self, event: Event) -> None:
        if self.error is not None:
            return   # a broken console (closed pipe) must not stop the job's bookkeeping
        try:
            self._sink(event)
        except BaseException as exc:   # noqa: BLE001 - reported by close()
            self.error = exc

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._run is not None:
                self._run.open = False
                self._run = None
        self._box.put(None)
        self._thread.join(timeout)
        if self._spill is not None and not self._thread.is_alive():
            self._spill.close()
