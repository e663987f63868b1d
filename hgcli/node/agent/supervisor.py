"""The supervisor of one job's ranks on one node: start, watch, stop, report, record.

All decisions happen on one thread (``run``) fed by one event queue: rank exits (waiter threads),
stdin EOF and stop requests (stdin thread), a broken stdout (the frame writer), signals. Nothing on
that thread writes to the connection directly, so a stalled link can never keep it from stopping
the ranks.
"""
from __future__ import annotations

import enum
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from .. import frames
from ..protocol import EndFrame, FrameType, NodeJobState, RankState, frame_type
from . import procs
from .jobdir import AGENT_LOG, record_path, stop_requested
from .logs import Follower, log_frames, metric_frames, open_private_append
from .output import FrameWriter
from .ranks import STREAMS, Rank, signal_name
from .secrets import redact_env
from .spec import AgentSpec
from .store import StoreFailure, StoreHost
from ...errors import StateError
from ...state import write_json

KILL_WAIT_S = 5.0      # after SIGKILL: how long to wait for the kernel to finish the processes
CAPTURE_WAIT_S = 5.0   # after the ranks are gone: how long their pipes may take to reach EOF
DRAIN_STALL_S = 30.0   # after the job: give up sending logs when the connection takes none for this long
DRAIN_POLL_S = 0.01    # ... checking this often whether the followers are done: the end frame (and the
                       # launcher's exit) waited up to a whole 0.2 s poll after the last log frame
POLL_S = 0.05


class Event(enum.Enum):
    """What the supervisor's thread reacts to: the first item of each tuple on its queue."""

    EXIT = "exit"          # (EXIT, rank, code, signal): a rank's waiter thread saw it exit
    SIGNAL = "signal"      # (SIGNAL, signum): SIGTERM, SIGINT or SIGHUP to the agent
    STOP = "stop"          # (STOP,): the controller sent a stop frame
    EOF = "eof"            # (EOF,): the controller's end of stdin closed
    BROKEN = "broken"      # (BROKEN,): a write to the controller failed
    STORE = "store"        # (STORE, StoreFailure): the job's store ended before the job


CONNECTION_EVENTS = (Event.STOP, Event.EOF, Event.BROKEN)   # a detached agent has no connection


class Supervisor:
    def __init__(self, spec: AgentSpec, *, detached: bool, store: StoreHost | None = None) -> None:
        self.spec = spec
        self.store = store          # rank 0's node: the job's rendezvous store, served beside the ranks
        self.store_failed = False
        self.dir = spec.job_dir
        self.detached = detached
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.ranks = {r.rank: Rank(r) for r in spec.ranks}
        self.writer = FrameWriter(1, on_broken=lambda: self.events.put((Event.BROKEN,)))
        self.marker = procs.job_marker(spec.job_id, spec.node)
        self.state = NodeJobState.STARTING
        self.stopping = False
        self.stop_reason: str | None = None
        self.signalled = False      # hgtrain itself has signalled the ranks
        self.hurry = False          # a second stop signal: skip the rest of the grace period
        self.connection_lost = False
        self.first_failure: int | None = None
        self.last_heard = time.monotonic()
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.followers: list[Follower] = []
        self._finished = threading.Event()
        self._record_warned = False

    # ---- main flow ---------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put((Event.SIGNAL, signum)))
        self.writer.post({"type": FrameType.AGENT, "job_id": self.spec.job_id, "node": self.spec.node,
                          "pid": os.getpid(), "job_dir": str(self.dir), "detached": self.detached})
        self._write_record()
        if self.store is not None:   # before any rank: they connect as its clients
            self.store.start(self.dir, self.marker, lambda failure: self.events.put((Event.STORE, failure)))
        failed_start = self._start_ranks()
        self.state = NodeJobState.RUNNING
        self._write_record()
        if self.detached:
            self._detach_output()
        else:
            self._start_connection_threads()
        if failed_start is not None:
            self._stop(f"rank {failed_start} could not start")
        while not all(r.exited for r in self.ranks.values()):
            if self.stopping:   # _stop returned with ranks that SIGKILL could not end
                break
            self._handle(self._next_event(0.5))
        return self._finish()

    def _start_ranks(self) -> int | None:
        """Start every rank in order; the first that cannot start is a failure (the rest are skipped)."""
        for rank in self.ranks.values():
            try:
                rank.start(self.spec, self.dir, self._rank_exited)
            except OSError as exc:
                rank.exited, rank.state, rank.code = True, RankState.FAILED, 127
                rank.reason = f"cannot start {rank.spec.argv[0]!r}: {exc.strerror or exc}"
                self.first_failure = rank.rank
                self.writer.post(rank.frame())
                for other in self.ranks.values():
                    if other.state is RankState.PENDING:
                        other.exited, other.state, other.reason = True, RankState.STOPPED, "not started"
                return rank.rank
            self.writer.post({"type": FrameType.STARTED, "rank": rank.rank, "pid": rank.pid, "pgid": rank.pid})
        return None

    def _detach_output(self) -> None:
        """Detached: the started frames go to the controller, everything later to agent.log."""
        self.writer.post({"type": FrameType.DETACHED, "job_id": self.spec.job_id, "node": self.spec.node,
                          "pid": os.getpid()})
        self.writer.drain(10.0)
        fd = open_private_append(self.dir / AGENT_LOG)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.writer.reattach(1)

    def _start_connection_threads(self) -> None:
        threading.Thread(target=self._read_stdin, name="stdin", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        for rank in self.ranks.values():
            if not rank.captures:
                continue
            for stream in STREAMS:
                cap = rank.captures[stream]
                self.followers.append(Follower(
                    cap.path, 0, log_frames(rank.rank, stream, self.spec.raw_logs), self.writer.send, cap.done.is_set,
                    wake=cap.wake).start(f"rank{rank.rank}-{stream}"))
            cap = rank.captures["metrics"]
            self.followers.append(Follower(
                cap.path, 0, metric_frames(rank.rank), self.writer.send, cap.done.is_set,
                wake=cap.wake).start(f"rank{rank.rank}-metrics"))

    def _read_stdin(self) -> None:
        """Heartbeats and stop requests from the controller; EOF means the controller is gone."""
        for line in sys.stdin.buffer:
            self.last_heard = time.monotonic()
            frame = frames.decode(line.decode("utf-8", "replace"))
            if frame_type(frame) is FrameType.STOP:
                self.events.put((Event.STOP,))
        self.events.put((Event.EOF,))

    def _heartbeat(self) -> None:
        while not self._finished.wait(self.spec.heartbeat_interval_s):
            self.writer.post({"type": FrameType.HEARTBEAT, "time": time.time()})

    # ---- events ------------------------------------------------------------------------------

    def _next_event(self, timeout: float) -> tuple[Any, ...] | None:
        self._check_heartbeat()
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _check_heartbeat(self) -> None:
        limit = self.spec.heartbeat_timeout_s
        if self.detached or limit <= 0 or self.stopping:
            return
        if time.monotonic() - self.last_heard > limit:
            self.connection_lost = True
            self._stop(f"no heartbeat from the controller for {limit:g} s")

    def _handle(self, event: tuple[Any, ...] | None) -> None:
        if event is None:
            return
        kind = event[0]
        if self.detached and kind in CONNECTION_EVENTS:
            return
        self.HANDLERS[kind](self, *event[1:])

    def _rank_exited(self, rank_id: int, code: int | None, sig: int | None) -> None:
        """From a rank's waiter thread: queue the exit for the supervisor's thread."""
        self.events.put((Event.EXIT, rank_id, code, sig))

    def _on_exit(self, rank_id: int, code: int | None, sig: int | None) -> None:
        rank = self.ranks[rank_id]
        rank.record_exit(code, sig, stopping=self.stopping, signalled=self.signalled)
        self.writer.post(rank.frame())
        self._write_record()
        if rank.state is RankState.FAILED:
            if self.first_failure is None:
                self.first_failure = rank_id
            self._stop(f"rank {rank_id} {rank.reason}")

    def _on_store(self, failure: StoreFailure) -> None:
        """The store the ranks rendezvous through is gone: nothing of the job can go on."""
        if self.stopping:
            return
        self.store_failed = True
        assert self.store is not None
        self._stop(f"the job's rendezvous store on {self.store.address} {failure.message}", failed=True)

    def _on_signal(self, signum: int) -> None:
        if self.stopping:
            self.hurry = True
        elif stop_requested(self.dir):
            self._stop(f"stopped with 'hgtrain stop' (the agent received {signal_name(signum)})", requested=True)
        else:
            self._stop(f"the agent received {signal_name(signum)}")

    def _on_stop_request(self) -> None:
        self._stop("stop requested by the controller")

    def _on_eof(self) -> None:
        self._connection_lost("closed (stdin EOF)")

    def _on_broken(self) -> None:
        self._connection_lost("broke (a write failed)")

    def _connection_lost(self, what: str) -> None:
        self.connection_lost = True
        self._stop(f"the controller's connection {what}")

    HANDLERS: ClassVar[dict[Event, Callable[..., None]]] = {
        Event.EXIT: _on_exit, Event.SIGNAL: _on_signal, Event.STOP: _on_stop_request,
        Event.EOF: _on_eof, Event.BROKEN: _on_broken, Event.STORE: _on_store,
    }

    # ---- stopping ----------------------------------------------------------------------------

    def _stop(self, reason: str, *, failed: bool = False, requested: bool = False) -> None:
        """Stop every rank; ``failed``: for a failure of the agent's own (the store), which the
        controller takes as the job's root cause; ``requested``: 'hgtrain stop' (not restarted)."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_reason = reason
        self.state = NodeJobState.STOPPING
        self.writer.post({"type": FrameType.STOPPING, "reason": reason, "failed": failed,
                          "requested": requested})
        self._write_record()
        self._terminate()

    def _terminate(self) -> None:
        """SIGTERM every process of the job, the grace period, then SIGKILL; every wait bounded."""
        self.signalled = True
        self._signal(signal.SIGTERM)
        self._wait_gone(time.monotonic() + self.spec.grace_s, stop_on_hurry=True)
        if not self._gone():
            self._signal(signal.SIGKILL)
            self._wait_gone(time.monotonic() + KILL_WAIT_S, stop_on_hurry=False)

    def _wait_gone(self, deadline: float, *, stop_on_hurry: bool) -> None:
        while not self._gone() and time.monotonic() < deadline:
            if stop_on_hurry and self.hurry:
                return
            self._handle(self._next_event(POLL_S))

    def _groups(self) -> dict[int, int | None]:
        """Process groups of ranks whose leader is unreaped: their ids cannot have been reused."""
        return {r.pid: None for r in self.ranks.values()
                if r.pid is not None and r.popen is not None and r.popen.returncode is None}

    def _gone(self) -> bool:
        return all(r.exited for r in self.ranks.values()) and not self._job_processes(self._groups())

    def _job_processes(self, groups: dict[int, int | None]) -> list[procs.ProcStat]:
        """The job's processes on this node but the store (which carries the job's marker, so that
        'hgtrain stop' finds it when its agent is gone, and is ended last, by ``_finish``)."""
        store = self.store.pid if self.store is not None else None
        return [p for p in procs.job_processes(groups, self.marker) if p.pid != store]

    def _signal(self, sig: int) -> None:
        groups = self._groups()
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        # Processes that left the ranks' groups (setsid daemons) still carry the job's marker.
        strays = [p for p in self._job_processes(groups) if p.pgid not in groups]
        procs.signal_all(strays, sig)

    # ---- the end -----------------------------------------------------------------------------

    def _finish(self) -> int:
        if not self.stopping and self._job_processes(self._groups()):
            self._terminate()   # children a finished rank left behind in its group
        for rank in self.ranks.values():
            if not rank.exited:
                rank.exited, rank.state = True, RankState.UNKNOWN
                rank.reason = "did not exit after SIGKILL (uninterruptible sleep?)"
                self.writer.post(rank.frame())
            rank.reap(1.0)
        if self.store is not None:
            self.store.stop()   # after the ranks: a rank ending late may still be talking to it
        deadline = time.monotonic() + CAPTURE_WAIT_S
        for rank in self.ranks.values():
            for cap in rank.captures.values():
                cap.done.wait(max(0.0, deadline - time.monotonic()))
        if self.first_failure is not None or self.store_failed:
            self.state = NodeJobState.FAILED
        elif self.stopping:
            self.state = NodeJobState.STOPPED
        else:
            self.state = NodeJobState.SUCCEEDED
        self.ended_at = time.time()
        self._write_record()
        self._finished.set()
        complete = self._drain_logs()
        self.writer.post(self._end_frame(complete))
        self.writer.drain(5.0)
        return 0 if self.state is NodeJobState.SUCCEEDED else 1

    def _drain_logs(self) -> bool:
        """Let the followers send the rest while the connection keeps taking it.

        A flood may need minutes on a slow link, so the bound is on lack of progress (and on the
        connection going away), not on the total time.
        """
        progress, since = -1, time.monotonic()
        while not self.connection_lost and not self.detached:
            if all(f.done.is_set() for f in self.followers):
                return True
            sent = sum(f.offset for f in self.followers)
            if sent != progress:
                progress, since = sent, time.monotonic()
            elif time.monotonic() - since > DRAIN_STALL_S:
                return False
            try:
                event: tuple[Any, ...] | None = self.events.get(timeout=DRAIN_POLL_S)
            except queue.Empty:
                event = None
            silent = time.monotonic() - self.last_heard
            if event is not None and event[0] in (Event.EOF, Event.BROKEN, Event.SIGNAL):
                self.connection_lost = True   # a signal: someone wants the agent gone now
            elif 0 < self.spec.heartbeat_timeout_s < silent:
                self.connection_lost = True
        return False

    def _end_frame(self, logs_complete: bool) -> EndFrame:
        failure = None
        if self.first_failure is not None:
            failure = self.ranks[self.first_failure].frame()
        dropped = sum(c.dropped for r in self.ranks.values() for c in r.captures.values())
        return {"type": FrameType.END, "job_id": self.spec.job_id, "node": self.spec.node, "state": self.state,
                "reason": self.stop_reason, "first_failure": failure, "logs_complete": logs_complete,
                "bytes_dropped": dropped}

    def _write_record(self) -> None:
        record = {
            "version": 1, "job_id": self.spec.job_id, "node": self.spec.node, "job_dir": str(self.dir),
            "boot_id": procs.boot_id(), "state": self.state, "reason": self.stop_reason,
            "first_failure": self.first_failure, "detached": self.detached,
            "agent": {"pid": os.getpid(), "start_ticks": procs.start_ticks(os.getpid())},
            "started_at": self.started_at, "ended_at": self.ended_at, "grace_s": self.spec.grace_s,
            "env": redact_env(self.spec.env, self.spec.secret),
            "ranks": [r.record(self.spec.secret) for r in self.ranks.values()],
        }
        try:
            write_json(record_path(self.dir), record)
        except StateError as exc:
            if not self._record_warned:  # keep supervising: the ranks matter more than the record
                self._record_warned = True
                self.writer.post({"type": FrameType.WARNING, "message": str(exc)})


def prepare_job_dir(spec: AgentSpec) -> Path:
    """Create the job directory (0700); a job id already used on this node is refused."""
    from ...state import ensure_private_dir

    ensure_private_dir(spec.job_dir.parent)
    path = ensure_private_dir(spec.job_dir)
    if record_path(path).exists():
        raise StateError(f"job {spec.job_id} already exists on node {spec.node} ({path})")
    return path
