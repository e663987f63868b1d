"""``hgtrain logs JOB``: a job's log lines, tagged by node and rank, from wherever they are.

- The controller's copy: launch writes every rank's output to ``jobs.job_dir(id)/rank<N>.log``. When
  that exists for every rank asked for and we are not following, it is printed as is (it survives
  the nodes), read READ_SIZE bytes at a time and cut as the node side cuts (``split_lines``: a line
  over 64 KiB comes in ``partial`` pieces), so memory does not grow with the log.
- Otherwise (a detached job has no controller copy, and ``-f`` follows a running job) the lines come
  from the nodes: ``agent --tail JOB --node NODE [--follow]`` on every node of the job at once, each
  over its own connection. A follow ends when the job ends on every node, or when the caller closes
  the tails (Ctrl-C): closing a tail is stdin EOF to it and never touches the job.
- The nodes are asked for the job's *current* attempt (``jobs.agent_job_id``: after ``launch
  --restarts`` restarted it, the agents run as ``<id>-r<N>``). A follow whose attempt ends while the
  record says the job goes on waits for the next attempt and follows that one from its start.
- A follow survives a dropped connection: each node's tail remembers the byte offset of every stream
  it has passed on (the ``end`` of the last ``logs`` frame) and reconnects with ``--tail --from``
  those offsets, so nothing is printed twice and nothing is skipped; RECONNECTS tries in a row, with
  a growing pause, before that node is reported as failed.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, cast

from ..state import records as jobs
from ..errors import UsageError
from .nodes import AgentTail, JobNodes, job_nodes
from ..schema.stages import JobRecord, NodeSpec
from ..node.agent.logs import READ_SIZE, frame_lines, split_lines, text
from ..node.protocol import FrameType, LogsFrame, frame_type
from ..config.ranklist import parse_rank_list

POLL_S = 0.5     # how often the main thread wakes while waiting for lines (keeps Ctrl-C prompt)
QUEUED_FRAMES = 16   # frames (each at most 1 MiB) waiting for the printer; a full queue holds the
                     # tails (and through them the nodes' --tail) back instead of growing
RECONNECT_PAUSES_S = (0.5, 1.0, 2.0, 4.0, 8.0)   # a follow's pauses before each reconnect in a row
NEXT_ATTEMPT_WAIT_S = 60.0   # how long an ended attempt's follow waits for the record to say what
                             # comes next (the controller stops every node before it restarts)
RECORD_POLL_S = 0.25


@dataclass(frozen=True)
class LogLine:
    """One line of a rank's output as ``hgtrain logs`` shows it, tagged with node, rank and stream."""

    node: str
    rank: int
    stream: str          # "out" | "err" from a node; "log" from the controller's copy
    line: str
    partial: bool = False   # a piece of a line longer than 64 KiB; the rest follows


@dataclass(frozen=True)
class _Batch:
    """The lines of one ``logs`` frame: one queue hand-off per frame, not per line."""

    node: str
    rank: int
    stream: str
    lines: list[str]
    partial: bool


@dataclass(frozen=True)
class _NodeDone:
    node: str
    error: str | None


def parse_ranks(text: str | None, record: JobRecord) -> tuple[int, ...]:
    """``0,2-3`` -> (0, 2, 3), checked against the job's ranks; None or empty -> every rank."""
    known = sorted({r.rank for r in (record.ranks or record.plan.ranks)})
    if not text:
        return tuple(known)
    chosen = parse_rank_list(text)
    unknown = sorted(chosen - set(known))
    if unknown:
        raise UsageError(f"job {record.id} has no rank {', '.join(map(str, unknown))} "
                         f"(ranks 0-{known[-1] if known else 0})")
    return tuple(sorted(chosen))


def _rank_nodes(record: JobRecord) -> dict[int, str]:
    return {r.rank: r.node for r in (record.ranks or record.plan.ranks)}


def local_log(record: JobRecord, rank: int) -> Path:
    return jobs.job_dir(record.id) / f"rank{rank}.log"


def has_local_logs(record: JobRecord, ranks: tuple[int, ...]) -> bool:
    return bool(ranks) and all(local_log(record, r).is_file() for r in ranks)


def local_lines(record: JobRecord, ranks: tuple[int, ...]) -> Iterator[LogLine]:
    """The controller's copy, rank by rank (each file is one rank's output in order), streamed: at
    most READ_SIZE bytes and one 64 KiB piece of a line are held at a time."""
    nodes = _rank_nodes(record)
    for rank in ranks:
        buf = bytearray()
        with open(local_log(record, rank), "rb") as fh:
            while True:
                data = fh.read(READ_SIZE)
                buf += data
                for piece, _end, partial in split_lines(buf, 0, final=not data):
                    yield LogLine(nodes[rank], rank, "log", text(piece), partial)
                if not data:
                    break


class NodeLogs:
    """Tails on every node holding a chosen rank; ``lines()`` merges them as they arrive.

    After ``lines()`` is exhausted, ``failed`` names each node whose tail did not end normally."""

    def __init__(self, record: JobRecord, ranks: tuple[int, ...], *, follow: bool,
                 where: JobNodes | None = None, transport: str = "auto") -> None:
        self.record = record
        self.ranks = frozenset(ranks)
        self.follow = follow
        self.where = where or job_nodes(record, transport=transport)
        rank_nodes = _rank_nodes(record)
        wanted = {rank_nodes[r] for r in ranks}
        self.failed: dict[str, str] = {n: "no longer declared in the cluster's node source"
                                       for n in self.where.missing if n in wanted}
        self._nodes = [n for n in self.where.nodes if n.name in wanted]
        self._queue: queue.Queue[_Batch | _NodeDone] = queue.Queue(maxsize=QUEUED_FRAMES)
        self._tails: list[AgentTail] = []
        self._lock = threading.Lock()
        self._hung_up = threading.Event()   # close(): no more tails, no more waiting

    def _read(self, node: NodeSpec) -> None:
        error: str | None = "the connection ended before the end of the logs"
        try:
            agent_id = jobs.agent_job_id(self.record)
            error = self._follow(node, agent_id) if self.follow else self._tail_once(node, agent_id, {})[1]
        except Exception as exc:   # RemoteError (unreachable) or a dropped stream: that node's failure
            error = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
        finally:
            self._queue.put(_NodeDone(node.name, error))

    def _follow(self, node: NodeSpec, agent_id: str) -> str | None:
        """Tail one node until the job ends, across dropped connections and restarted attempts."""
        offsets: dict[str, int] = {}   # "rank:stream" -> bytes of the node-local file passed on
        failures = 0
        while not self._hung_up.is_set():
            before = dict(offsets)
            ended, error = self._tail_once(node, agent_id, offsets)
            if self._hung_up.is_set():
                return None
            if ended:
                following = self._next_attempt(agent_id)
                if following is None:
                    return None
                agent_id, failures = following, 0
                offsets.clear()
                continue
            failures = 0 if offsets != before else failures + 1
            if failures > len(RECONNECT_PAUSES_S):
                return f"{error} ({len(RECONNECT_PAUSES_S)} reconnects failed)"
            self._hung_up.wait(RECONNECT_PAUSES_S[max(failures - 1, 0)])
        return None

    def _tail_once(self, node: NodeSpec, agent_id: str, offsets: dict[str, int]) -> tuple[bool, str | None]:
        """One ``--tail`` of ``agent_id`` from ``offsets`` (updated as frames pass): (reached its
        tail_end, what went wrong otherwise)."""
        error = "the connection ended before the end of the logs"
        try:
            tail = AgentTail(self.where.cluster, node, agent_id, follow=self.follow,
                             offsets=",".join(f"{k}={v}" for k, v in offsets.items()) or None)
        except Exception as exc:   # RemoteError: cannot connect (now)
            return False, getattr(exc, "reason", None) or str(exc) or type(exc).__name__
        with self._lock:
            if self._hung_up.is_set():
                tail.close()
                return True, None
            self._tails.append(tail)
        try:
            for frame in tail.frames():
                match frame_type(frame):
                    case FrameType.LOGS:
                        self._logs(node.name, cast(LogsFrame, frame), offsets)
                    case FrameType.TAIL_END:
                        if frame.get("job_id") is None:   # the attempt's agent has not written its record yet
                            error = "its agent has not started there yet"
                            break
                        return True, None
                    case FrameType.ERROR:
                        error = str(frame.get("message"))
        except Exception as exc:   # the stream dropped under us
            error = str(exc) or error
        finally:
            with self._lock:
                if tail in self._tails:
                    self._tails.remove(tail)
            tail.close()
        return False, error

    def _logs(self, node: str, frame: LogsFrame, offsets: dict[str, int]) -> None:
        key = f"{frame.get('rank')}:{frame.get('stream')}"
        end = int(frame.get("end", 0))
        if end <= offsets.get(key, 0):
            return   # already passed on (frames tile the file; a resumed tail starts at our offset)
        offsets[key] = end
        if frame.get("rank") in self.ranks:
            lines, partial = frame_lines(frame)
            self._queue.put(_Batch(node, int(frame["rank"]), str(frame.get("stream")), lines, partial))

    def _next_attempt(self, agent_id: str) -> str | None:
        """After an attempt's tail ended: the agents' job id of the next attempt, or None when the job
        is over (or its record stays silent for NEXT_ATTEMPT_WAIT_S: a controller that died)."""
        deadline = time.monotonic() + NEXT_ATTEMPT_WAIT_S
        while not self._hung_up.is_set() and time.monotonic() < deadline:
            record = jobs.load(self.record.id)
            current = jobs.agent_job_id(record)
            if current != agent_id:
                return current
            if not record.state.is_running() or record.detached:
                return None
            self._hung_up.wait(RECORD_POLL_S)
        return None

    def lines(self, on_idle: Callable[[], None] = lambda: None) -> Iterator[LogLine]:
        """Every node's lines as they arrive; ``on_idle`` runs whenever all that arrived has been
        taken and the next wait begins (the command flushes stdout there: a follow into a pipe is
        seen line by line as it comes, a flood is still written in large blocks)."""
        threads = [threading.Thread(target=self._read, args=(n,), daemon=True, name=f"tail-{n.name}")
                   for n in self._nodes]
        for t in threads:
            t.start()
        running = len(threads)
        while running:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                on_idle()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            if isinstance(item, _NodeDone):
                running -= 1
                if item.error is not None and not self._hung_up.is_set():
                    self.failed[item.node] = item.error
                continue
            last = len(item.lines) - 1
            for i, line in enumerate(item.lines):
                yield LogLine(item.node, item.rank, item.stream, line, item.partial and i == last)

    def close(self) -> None:
        """Hang up every tail (a follow on the node ends; the job keeps running)."""
        with self._lock:
            self._hung_up.set()
            tails, self._tails = self._tails, []
        for tail in tails:
            tail.close()

    def __enter__(self) -> "NodeLogs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
