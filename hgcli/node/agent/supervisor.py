"""The supervisor of one job's ranks on one node: the decisions of when to start, stop, report and
record, on one thread (``run``) fed by one event queue (``events``): rank exits (waiter threads),
stdin EOF and stop requests (``connection``), a broken stdout (the frame writer), signals, the
store's end. Nothing on that thread writes to the connection directly, so a stalled link can never
keep it from stopping the ranks.

The parts it directs each have one job: ``rankset.RankSet`` (the rank processes), ``connection``
(the controller's link: stop requests in, heartbeats and logs out), ``output.FrameWriter`` (every
frame out, built by ``outbound``), ``store.StoreHost`` (rank 0's node: the job's store).
"""
from __future__ import annotations

import os
import queue
import signal
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from . import outbound, procs
from .connection import Connection
from .events import (CONNECTION_EVENTS, Event, RankExited, Signalled, StdinClosed, StopRequested, StoreEnded,
                     WriteFailed)
from .jobdir import AGENT_LOG, record_path, stop_requested
from .logs import open_private_append
from .output import FrameWriter
from .rankset import RankSet
from .ranks import signal_name
from .secrets import redact_env
from .spec import AgentSpec
from .store import StoreHost
from ..protocol import EndFrame, NodeJobState, RankState
from ...errors import StateError
from ...state import write_json

KILL_WAIT_S = 5.0      # after SIGKILL: how long to wait for the kernel to finish the processes
CAPTURE_WAIT_S = 5.0   # after the ranks are gone: how long their pipes may take to reach EOF
STORE_SIGNAL_GRACE_S = 0.5   # a store killed by a signal: how long to wait for the agent's own
POLL_S = 0.05


class Supervisor:
    """One job on one node, from its agent frame to its end frame; ``run`` is the whole of it."""

    def __init__(self, spec: AgentSpec, *, detached: bool, store: StoreHost | None = None) -> None:
        self.spec = spec
        self.store = store          # rank 0's node: the job's rendezvous store, served beside the ranks
        self.store_failed = False
        self.dir = spec.job_dir
        self.detached = detached
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.writer = FrameWriter(1, on_broken=lambda: self.events.put(WriteFailed()))
        self.connection = Connection(spec, self.writer, self.events)
        self.marker = procs.job_marker(spec.job_id, spec.node)
        self.ranks = RankSet(spec, self.marker, store)
        self.state = NodeJobState.STARTING
        self.stopping = False
        self.stop_reason: str | None = None
        self.signalled = False      # hgtrain itself has signalled the ranks
        self.hurry = False          # a second stop signal: skip the rest of the grace period
        self.first_failure: int | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._record_warned = False

    # ---- main flow ---------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put(Signalled(signum)))
        self.writer.post(outbound.agent(self.spec.job_id, self.spec.node, str(self.dir), detached=self.detached))
        self._write_record()
        if self.store is not None:   # before any rank: they connect as its clients
            self.store.start(self.dir, self.marker, lambda failure: self.events.put(StoreEnded(failure)))
        failed_start = self.ranks.start(self.dir, self._rank_exited, self.writer.post)
        self.first_failure = failed_start
        self.state = NodeJobState.RUNNING
        self._write_record()
        if self.detached:
            self._detach_output()
        else:
            self.connection.start(self.ranks.ranks)
        if failed_start is not None:
            self._stop(f"rank {failed_start} could not start")
        while not self.ranks.all_exited():
            if self.stopping:   # _stop returned with ranks that SIGKILL could not end
                break
            self._handle(self._next_event(0.5))
        return self._finish()

    def _detach_output(self) -> None:
        """Detached: the started frames go to the controller, everything later to agent.log."""
        self.writer.post(outbound.detached(self.spec.job_id, self.spec.node))
        self.writer.drain(10.0)
        fd = open_private_append(self.dir / AGENT_LOG)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self.writer.reattach(1)

    # ---- events ------------------------------------------------------------------------------

    def _next_event(self, timeout: float) -> Event | None:
        self._check_heartbeat()
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _check_heartbeat(self) -> None:
        if self.detached or self.stopping or self.connection.silent_for() is None:
            return
        self.connection.lost = True
        self._stop(f"no heartbeat from the controller for {self.spec.heartbeat_timeout_s:g} s")

    def _handle(self, event: Event | None) -> None:
        if event is None or (self.detached and type(event) in CONNECTION_EVENTS):
            return
        self.HANDLERS[type(event)](self, event)

    def _rank_exited(self, rank_id: int, code: int | None, sig: int | None) -> None:
        """From a rank's waiter thread: queue the exit for the supervisor's thread."""
        self.events.put(RankExited(rank_id, code, sig))

    def _on_exit(self, event: RankExited) -> None:
        rank = self.ranks.ranks[event.rank]
        rank.record_exit(event.code, event.signal, stopping=self.stopping, signalled=self.signalled)
        self.writer.post(rank.frame())
        self._write_record()
        if rank.state is RankState.FAILED:
            if self.first_failure is None:
                self.first_failure = event.rank
            self._stop(f"rank {event.rank} {rank.reason}")

    def _on_store(self, event: StoreEnded) -> None:
        """The store the ranks rendezvous through is gone: nothing of the job can go on. Unless the
        node itself is going: a store killed by a signal with the agent signalled a moment later
        (every process of a stopping machine gets SIGTERM, the store's before its agent's) is the
        node's end, which the controller handles as a lost node, not the store's failure."""
        if self.stopping:
            return
        later: list[Event] = []
        code = event.failure.code
        if code is not None and code < 0:
            deadline = time.monotonic() + STORE_SIGNAL_GRACE_S
            while (nxt := self._next_event(max(0.0, deadline - time.monotonic()))) is not None:
                later.append(nxt)
                if isinstance(nxt, Signalled):
                    break
        signalled = [e for e in later if isinstance(e, Signalled)]
        if not signalled:
            self.store_failed = True
            assert self.store is not None
            self._stop(f"the job's rendezvous store on {self.store.address} {event.failure.message}", failed=True)
        for e in signalled + [e for e in later if not isinstance(e, Signalled)]:
            self._handle(e)

    def _on_signal(self, event: Signalled) -> None:
        name = signal_name(event.signum)
        if self.stopping:
            self.hurry = True
        elif stop_requested(self.dir):
            self._stop(f"stopped with 'hgtrain stop' (the agent received {name})", requested=True)
        else:
            self._stop(f"the agent received {name}")

    def _on_stop_request(self, event: StopRequested) -> None:
        self._stop("stop requested by the controller")

    def _on_eof(self, event: StdinClosed) -> None:
        self._connection_lost("closed (stdin EOF)")

    def _on_broken(self, event: WriteFailed) -> None:
        self._connection_lost("broke (a write failed)")

    def _connection_lost(self, what: str) -> None:
        self.connection.lost = True
        self._stop(f"the controller's connection {what}")

    # Each handler takes the event of its key's class.
    HANDLERS: ClassVar[dict[type[Event], Callable[[Supervisor, Any], None]]] = {
        RankExited: _on_exit, Signalled: _on_signal, StopRequested: _on_stop_request,
        StdinClosed: _on_eof, WriteFailed: _on_broken, StoreEnded: _on_store,
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
        self.writer.post(outbound.stopping(reason, failed=failed, requested=requested))
        self._write_record()
        self._terminate()

    def _terminate(self) -> None:
        """SIGTERM every process of the job, the grace period, then SIGKILL; every wait bounded."""
        self.signalled = True
        self.ranks.signal(signal.SIGTERM)
        self._wait_gone(time.monotonic() + self.spec.grace_s, stop_on_hurry=True)
        if not self.ranks.gone():
            self.ranks.signal(signal.SIGKILL)
            self._wait_gone(time.monotonic() + KILL_WAIT_S, stop_on_hurry=False)

    def _wait_gone(self, deadline: float, *, stop_on_hurry: bool) -> None:
        while not self.ranks.gone() and time.monotonic() < deadline:
            if stop_on_hurry and self.hurry:
                return
            self._handle(self._next_event(POLL_S))

    # ---- the end -----------------------------------------------------------------------------

    def _finish(self) -> int:
        if not self.stopping and self.ranks.left_over():
            self._terminate()   # children a finished rank left behind in its group
        for frame in self.ranks.give_up():
            self.writer.post(frame)
        if self.store is not None:
            self.store.stop()   # after the ranks: a rank ending late may still be talking to it
        self.ranks.wait_captures(CAPTURE_WAIT_S)
        if self.first_failure is not None or self.store_failed:
            self.state = NodeJobState.FAILED
        elif self.stopping:
            self.state = NodeJobState.STOPPED
        else:
            self.state = NodeJobState.SUCCEEDED
        self.ended_at = time.time()
        self._write_record()
        self.connection.finish()
        complete = not self.detached and self.connection.drain()
        self.writer.post(self._end_frame(complete))
        self.writer.drain(5.0)
        return 0 if self.state is NodeJobState.SUCCEEDED else 1

    def _end_frame(self, logs_complete: bool) -> EndFrame:
        failure = None if self.first_failure is None else self.ranks.ranks[self.first_failure].frame()
        return outbound.end(self.spec.job_id, self.spec.node, self.state, self.stop_reason, failure,
                            logs_complete=logs_complete, bytes_dropped=self.ranks.bytes_dropped())

    def _write_record(self) -> None:
        record = {
            "version": 1, "job_id": self.spec.job_id, "node": self.spec.node, "job_dir": str(self.dir),
            "boot_id": procs.boot_id(), "state": self.state, "reason": self.stop_reason,
            "first_failure": self.first_failure, "detached": self.detached,
            "agent": {"pid": os.getpid(), "start_ticks": procs.start_ticks(os.getpid())},
            "started_at": self.started_at, "ended_at": self.ended_at, "grace_s": self.spec.grace_s,
            "env": redact_env(self.spec.env, self.spec.secret),
            "ranks": self.ranks.records(self.spec.secret),
        }
        try:
            write_json(record_path(self.dir), record)
        except StateError as exc:
            if not self._record_warned:  # keep supervising: the ranks matter more than the record
                self._record_warned = True
                self.writer.post(outbound.warning(str(exc)))


def prepare_job_dir(spec: AgentSpec) -> Path:
    """Create the job directory (0700); a job id already used on this node is refused."""
    from ...state import ensure_private_dir

    ensure_private_dir(spec.job_dir.parent)
    path = ensure_private_dir(spec.job_dir)
    if record_path(path).exists():
        raise StateError(f"job {spec.job_id} already exists on node {spec.node} ({path})")
    return path
