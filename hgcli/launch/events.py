"""The typed events a launch emits.

``--json`` prints exactly ``event_dict(e)`` per event, one per line (a ``LogLines`` batch as one
``log`` event per line: ``LogLines.json_lines``); the rich view renders the same objects. The
controller loop never calls the console itself: it puts events on the dispatcher's queue
(``dispatch.py``) and goes on draining the agents, so a slow terminal can never back-pressure a node.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from ..node.protocol import Stream
from ..schema import records
from ..schema.records import AdaptKind, SavedState
from ..schema.stages import JobState, Prediction, RankState, Role, Strategy, prediction


@dataclass(frozen=True)
class Stage:
    """Progress of the probe -> bench -> plan pipeline before the job starts."""

    job_id: str
    stage: str
    message: str


@dataclass(frozen=True)
class JobStarted:
    """The job's ranks are being started: what runs where (the console's first line of a job)."""

    job_id: str
    strategy: Strategy
    world_size: int
    nodes: tuple[str, ...]
    command: tuple[str, ...]
    job_dir: str                   # the controller's job directory (rank logs, metrics.jsonl)
    master: str                    # MASTER_ADDR:MASTER_PORT
    detached: bool
    predicted_samples_per_s: float | None
    ideal_samples_per_s: float | None


@dataclass(frozen=True)
class RankStarted:
    """A rank's process is running on its node (``pid`` there)."""

    job_id: str
    rank: int
    node: str
    role: Role
    pid: int


@dataclass(frozen=True)
class LogLines:
    """Consecutive lines of one rank's stream, as one agent frame brought them: a flood arrives in
    a few of these, not one event per line. ``--json`` still prints one ``log`` event per line.

    The lines stay one piece of bytes, as the agent's frame brought them: the plain console and the
    rank file need no split (splitting a million lines into objects was a good part of the
    controller's time), and ASCII output, nearly every log, goes to both without being decoded
    and encoded again (each 1 MiB copy also cost the kernel fresh pages: ``utf8``)."""

    job_id: str
    rank: int
    node: str
    role: Role
    stream: Stream
    data: bytes                    # the lines as the rank wrote them, each ending in b"\n" ...
    partial: bool = False          # ... but the last: a piece of a line over 64 KiB that the next continues

    @functools.cached_property   # decoded once for the rank file and the console (non-ASCII only)
    def text(self) -> str:
        """The lines as text: bytes that are not UTF-8 as ``\\xNN`` (the node-side files' rule)."""
        return self.data.decode("utf-8", "backslashreplace")

    def utf8(self) -> bytes:
        """``text`` encoded as UTF-8: the data itself when it is ASCII (checked in C, no copy)."""
        return self.data if self.data.isascii() else self.text.encode("utf-8")

    @property
    def lines(self) -> list[str]:
        lines = self.text.split("\n")
        if not self.partial:
            lines.pop()   # the "" after the last newline
        return lines

    def count(self) -> int:
        return self.data.count(b"\n") + self.partial

    def json_lines(self) -> str:
        """The ``--json`` form: one ``log`` event per line (scripts read one line per event).

        Built without a Python step per line: the lines are encoded in one ``json.dumps`` with a
        newline as the item separator (ASCII-only JSON never holds a raw newline, so it separates
        the encoded lines exactly), then each gets the fields every event of the batch shares."""
        lines = self.lines
        last = lines.pop() if self.partial else None
        head = json.dumps({"event": "log", "job_id": self.job_id, "rank": self.rank, "node": self.node,
                           "role": self.role, "stream": self.stream})[:-1] + ', "line": '
        out = ""
        if lines:
            tail = ', "partial": false}\n'
            encoded = json.dumps(lines, separators=("\n", ": "))[1:-1]
            out = head + encoded.replace("\n", tail + head) + tail
        if last is not None:
            out += head + json.dumps(last) + ', "partial": true}\n'
        return out


@dataclass(frozen=True)
class Metric:
    """One metric record a rank wrote (``data``: as it came, its bad numbers nulled; schema/records.py
    says what it can be), for --json and the live sinks."""

    job_id: str
    rank: int
    node: str
    role: Role
    data: dict[str, Any]


@dataclass(frozen=True)
class Adapted:
    """A batch re-split as measured speeds changed, for the console and --json. ``kind`` rebalance:
    a group re-split its batch among its members (runtime/adapt/rebalance.py; the leader's ``adapt``
    record): from data step ``data_step`` on, ``ranks`` take ``batches`` instead of ``before``.
    ``kind`` shares: the PS's shard 0 re-split the global batch across groups
    (runtime/adapt/shares.py): ``groups`` take ``batches`` (each group's total) instead of
    ``before``; ``group`` is None (every group) and ``ranks`` empty."""

    job_id: str
    group: int | None              # None: every group (shares)
    step: int                      # the group's step (shares: shard 0's check) that decided it
    data_step: int
    ranks: tuple[int, ...]
    before: tuple[int, ...]
    batches: tuple[int, ...]
    rates: tuple[float, ...]       # each member's (group's) measured samples per compute second
    step_before_s: float           # the slowest member's (group's) step at the old split, predicted
    step_after_s: float
    kind: AdaptKind = AdaptKind.REBALANCE
    groups: tuple[int, ...] = ()

    @classmethod
    def parse(cls, job_id: str, rank: int, data: dict[str, Any],
              groups: dict[int, tuple[int, ...]], coordinator: int | None = None) -> "Adapted | None":
        """The event in a rank's metric record ``data``, or None when it is not one a group's leader
        (or, for shares, the PS's shard 0, rank ``coordinator``) could have sent: the record's own
        fields are checked by its contract (schema/records.py), what the plan says here."""
        record = records.parse(data)
        ranks: tuple[int, ...]
        if isinstance(record, records.SharesRecord):
            if not (rank == coordinator and sorted(record.groups) == sorted(groups) and len(record.groups) > 1):
                return None
            group, ranks = None, ()
        elif isinstance(record, records.RebalanceRecord):
            if not (groups.get(record.group) == record.ranks and record.ranks[:1] == (rank,)):
                return None
            group, ranks = record.group, record.ranks
        else:
            return None
        return cls(job_id=job_id, group=group, step=record.step, data_step=record.data_step, ranks=ranks,
                   before=record.before, batches=record.batches, rates=tuple(float(r) for r in record.rates),
                   step_before_s=float(record.step_before_s), step_after_s=float(record.step_after_s),
                   kind=AdaptKind.SHARES if group is None else AdaptKind.REBALANCE,
                   groups=record.groups if isinstance(record, records.SharesRecord) else ())


@dataclass(frozen=True)
class RankExited:
    """A rank's process ended: how, and why in one line (a root cause when it failed first)."""

    job_id: str
    rank: int
    node: str
    role: Role
    state: RankState               # succeeded | failed | stopped | unknown
    exit_code: int | None          # the code, or 128 + signal
    signal: str | None             # "SIGKILL"...
    reason: str
    oom: bool | None


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not a rank's output (agent warnings, lost nodes)."""

    job_id: str
    node: str | None
    message: str


@dataclass(frozen=True)
class Stopping:
    """hgtrain is stopping every rank, and why (a failure, a signal, a stop)."""

    job_id: str
    reason: str


@dataclass(frozen=True)
class JobRestarted:
    """The job failed and is started again (``--restarts``): ``attempt`` 1 is the first restart."""

    job_id: str
    attempt: int
    reason: str                    # the failed attempt's root cause, one line
    resume: bool                   # training resumes from a saved state (else from scratch)
    resume_from: SavedState | None = None   # None: from scratch


@dataclass(frozen=True)
class NodeLost:
    """A node was lost during attempt ``attempt`` (heartbeat timeout, SSH drop, agent exit)."""

    job_id: str
    node: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class Replanned:
    """``launch --nnodes MIN:MAX``: the next attempt runs on other nodes than the last, re-planned
    from the stored profiles (no bench)."""

    job_id: str
    attempt: int                   # the attempt that runs the new plan
    old_nodes: tuple[str, ...]
    new_nodes: tuple[str, ...]
    old_world: int                 # ranks
    new_world: int
    strategy: Strategy             # the new plan's
    reason: str                    # why: the nodes lost, the nodes that came back


@dataclass(frozen=True)
class Regrouped:
    """``launch --adapt``: the running all-reduce job straggled, and goes on under a plan with
    asynchronous groups, re-planned from the rates it measured (launch/adapt.py)."""

    job_id: str
    attempt: int                   # the attempt that runs the new plan
    old_strategy: Strategy
    new_strategy: Strategy
    groups: tuple[tuple[int, ...], ...]   # the new plan's groups (ranks)
    predicted_before: float        # samples/s of the old plan, fitted to the measured rates
    predicted_after: float
    reason: str


@dataclass(frozen=True)
class Resumed:
    """An attempt's training continued from a saved state: ``source`` "snapshot" (all-reduce: the
    first worker's snapshot, ``step`` its optimizer steps) or "checkpoint" (PS shards, ``step`` the
    version); ``redone``: samples trained again (those the lost attempt trained after that state;
    None when the script logs no samples, and for a checkpoint, whose samples the PS does not count)."""

    job_id: str
    attempt: int
    source: SavedState
    step: int
    samples: int | None
    redone: int | None

    @classmethod
    def parse(cls, job_id: str, attempt: int, rank: int, first_worker: int, data: dict[str, Any],
              reached: int | None, first_ps: int | None = None) -> "Resumed | None":
        """The event in the ``resumed`` metric record of the first worker (a snapshot) or of PS shard
        0 (a checkpoint version; its fields checked by schema/records.py); ``reached``: the samples
        the job had trained when the last attempt ended."""
        record = records.parse(data)
        if not isinstance(record, records.ResumedRecord) or (record.source, rank) not in (
                (SavedState.SNAPSHOT, first_worker), (SavedState.CHECKPOINT, first_ps)):
            return None
        samples = record.samples
        redone = max(0, reached - samples) if reached is not None and samples is not None else None
        return cls(job_id=job_id, attempt=attempt, source=record.source, step=record.step, samples=samples,
                   redone=redone)


@dataclass(frozen=True)
class RootCause:
    """The first failure of a job: where it happened and what it left (last lines, the error)."""

    node: str
    rank: int | None               # None: the node itself was lost
    exit_code: int | None
    signal: str | None
    reason: str
    oom: bool | None
    last_lines: tuple[str, ...] = ()
    # The exception the rank's ``@record`` wrote to its TORCHELASTIC_ERROR_FILE ("ValueError: ...",
    # one line) and that file's Python call stack; None / () without one.
    error: str | None = None
    traceback: tuple[str, ...] = ()

    def sentence(self) -> str:
        who = f"{self.node}:{self.rank}" if self.rank is not None else f"node {self.node}"
        return f"{who} {self.reason}" + (f": {self.error}" if self.error else "")


@dataclass(frozen=True)
class Summary:
    """The ending's figures: samples and samples/s trained against the plan's predictions."""

    elapsed_s: float
    samples: int
    samples_per_s: float | None
    predicted_samples_per_s: float | None
    ideal_samples_per_s: float | None
    accuracy: float | None
    groups: dict[str, float] = field(default_factory=dict)   # group -> samples/s
    strategy: Strategy | None = None                         # the plan's strategy
    # every strategy's prediction in the plan (allreduce, hybrid, ps, ideal): by how much the chosen
    # one was predicted to beat the synchronous all-reduce
    predictions: dict[Prediction, float] = field(default_factory=dict)
    group_predicted: dict[str, float] = field(default_factory=dict)   # group -> predicted samples/s
    group_predicted_derived: bool = False   # not from the plan: its total split by samples per step
    # rank -> its samples per second of compute over the run (waits for other members left out),
    # from its finish record; and the bench's figure for its device at its plan batch
    device_measured: dict[str, float] = field(default_factory=dict)
    device_benched: dict[str, float] = field(default_factory=dict)
    # Where the prediction came from: the job whose measured compute fitted the plan (Plan.fitted_to),
    # else the bench (a plan made by hand has neither); and whether this job's rates were kept.
    fitted_to: str | None = None
    from_bench: bool = False
    rates_stored: bool = False
    # the bench's figures were of each node's devices stepping together (Plan.bench_together)
    bench_together: bool = False
    # group -> seconds from its first worker's first step to its last worker's last step: groups
    # with a PS run the same steps each at its own pace, so one whose share of each step is small
    # for its speed finishes early and waits while the others train
    group_spans: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Typed once here, whoever built it (the metrics board, a report from a stored record).
        object.__setattr__(self, "strategy", Strategy(self.strategy) if self.strategy is not None else None)
        object.__setattr__(self, "predictions", {prediction(k): v for k, v in self.predictions.items()})


@dataclass(frozen=True)
class GroupView:
    """One group's row of the live view."""

    group: str                     # "0", "1"... or "-" for ranks outside any group
    ranks: tuple[int, ...]
    step: int | None
    loss: float | None
    samples_per_s: float | None

@dataclass(frozen=True)
class BoardView:
    """The live view: each group's row and the cluster total against the plan's prediction."""

    groups: tuple[GroupView, ...]
    samples_per_s: float | None
    predicted_samples_per_s: float | None
    ideal_samples_per_s: float | None
    accuracy: float | None

@dataclass(frozen=True)
class Progress:
    """The live metrics view, at most once a second while metrics arrive (not in --json)."""

    job_id: str
    view: BoardView


@dataclass(frozen=True)
class JobEnded:
    """The job is over (or detached): its state, exit code, root cause and summary; always the last event."""

    job_id: str
    state: JobState                # succeeded | failed | stopped | running (detached)
    exit_code: int
    root_cause: RootCause | None
    summary: Summary | None
    job_dir: str
    detached: bool = False


Event = (Stage | JobStarted | RankStarted | LogLines | Metric | Adapted | RankExited | Notice | Stopping
         | Progress | JobRestarted | NodeLost | Replanned | Regrouped | Resumed | JobEnded)

EVENT_NAMES: dict[type, str] = {
    Stage: "stage", JobStarted: "job_started", RankStarted: "rank_started", LogLines: "logs",
    Metric: "metric", Adapted: "adapt", RankExited: "rank_exited", Notice: "notice", Stopping: "stopping",
    Progress: "progress", JobRestarted: "job_restarted", NodeLost: "node_lost", Replanned: "replanned",
    Regrouped: "regrouped", Resumed: "resumed", JobEnded: "job_ended",
}


def event_dict(event: Event) -> dict[str, Any]:
    """``{"event": name, "job_id": ..., **fields}``: the --json line of an event."""
    return {"event": EVENT_NAMES[type(event)], **dataclasses.asdict(event)}
