"""The agent protocol: every frame type and state name that node programs and the controller share.

This module is their single definition (docs/agent.md). On the wire a frame is a JSON object with a
``"type"`` (``hgcli.node.frames``); on the node it stays a plain dict, so nothing is built per frame
and a log batch costs what it did. The launcher decodes each frame it acts on once, into a typed
value (``hgcli.launch.inbound``). The names live here:

- ``FrameType``: the ``"type"`` of every frame, both ways, of the agent and of the other node
  programs (probe, bench, the package shipper). A member is a ``str`` equal to its wire name and
  hashes like it, so a decoded frame's plain string compares and looks up against members directly.
  ``frame_type(frame)`` gives the member of a decoded frame (None for noise or a type this version
  does not know); dispatch on that, through a table of handlers.
- ``RankState`` (one rank) and ``NodeJobState`` (a job on one node) with their predicates, defined in
  ``hgcli.schema.states`` and re-exported here. The agent keeps these members in its record and
  frames; the controller's job record uses the same ``RankState``.
- TypedDicts naming each agent frame's fields, in wire order, for writers and the type checker:
  every frame the agent writes is built as one (``hgcli.node.agent.outbound`` builds its own).
  The controller's requests (prepare, spec, stop) are checked field by field where the agent
  reads them (``agent.prelaunch``, ``agent.spec``). They are annotations only: a frame read from
  JSON is the ``dict`` JSON made, with plain strings where a state is; a reader checks its fields
  (``hgcli.launch.inbound``) or turns states into members with ``RankState.parse`` /
  ``NodeJobState.parse``.

Standard library only, and light: the agent imports it on start-up, which every launch waits for.
Never format a member directly (``f"{state}"`` gives ``RankState.FAILED`` on Python 3.11): use
``.value``.
"""
from __future__ import annotations

import enum
from typing import Any, Iterable, Literal, Mapping, TypedDict

# The states are the job record's as well as the agent's: defined beside the other stage values.
from ..schema.states import NodeJobState as NodeJobState, RankState as RankState


class FrameType(str, enum.Enum):
    """The ``"type"`` of a frame."""

    # controller -> agent (stdin)
    PREPARE = "prepare"        # first, optional: the plan file and a free port (fields: agent/prelaunch.py)
    SPEC = "spec"              # the job (hgcli.node.agent.spec.AgentSpec)
    HEARTBEAT = "heartbeat"    # both ways: the controller's carries nothing, the agent's its "time"
    STOP = "stop"              # stop the job; frames keep coming until `end`
    # agent -> controller (stdout)
    AGENT = "agent"
    PREPARED = "prepared"
    STARTED = "started"
    LOGS = "logs"
    METRIC = "metric"
    WARNING = "warning"
    STOPPING = "stopping"
    EXIT = "exit"
    END = "end"
    DETACHED = "detached"
    ERROR = "error"            # from every node program: {"message"}
    # the agent's --status, --stop, --tail
    STATUS = "status"
    STOPPED = "stopped"
    TAIL_END = "tail_end"
    # the other node programs
    PROBE = "probe"            # node/probe.py: {"node": NodeInfo as a dict}
    MODEL = "model"            # node/bench: {"name", "parameters"} of the benched model
    PROFILE = "profile"        # node/bench: {"profile": DeviceProfile as a dict}
    PROGRESS = "progress"      # node/bench: {"node", "device", "stage"}
    NOTE = "note"              # node/bench: {"node", "device", "message"}
    LISTENING = "listening"    # node/bench/link.py rank 0: {"port"} of its store
    LINK = "link"              # node/bench/link.py: the measurements
    TOGETHER = "together"      # node/bench/together.py: {"node", "devices": {device: TogetherProfile}}
    SHIP = "ship"              # remote/ship.py's scripts: {"state": present|missing|shipped, "root"}


_BY_WIRE = {member.value: member for member in FrameType}


def frame_type(frame: Mapping[str, Any] | None) -> FrameType | None:
    """The type of a decoded frame; None for None (a noise line) or a type this version does not know."""
    if frame is None:
        return None
    kind = frame.get("type")
    return _BY_WIRE.get(kind) if isinstance(kind, str) else None


def first(frames: Iterable[dict[str, Any] | None], kind: FrameType) -> dict[str, Any] | None:
    """The first frame of type ``kind`` among decoded ones (None entries, noise lines, skipped)."""
    return next((f for f in frames if f is not None and frame_type(f) is kind), None)


# ---- the agent's frames, field by field (docs/agent.md) -------------------------------------------
# Each class is one frame's object in wire order. "type" is the FrameType member when built, its
# plain string when decoded; so are the states (``str`` here: turn them into members with parse).

class PreparedFrame(TypedDict):
    """The answer to ``prepare``."""

    type: str
    job_dir: str
    plan: str                      # the plan file's path on the node
    port: int | None
    checkpoints: dict[Any, list[int]] | None   # PS shard -> checkpoint versions (keys: str on the wire)
    snapshots: list[int] | None    # the steps of the all-reduce snapshots there (runtime/snapshot.py)


class AgentFrame(TypedDict):
    """First frame of a job."""

    type: str
    job_id: str
    node: str
    pid: int
    job_dir: str
    detached: bool


class StartedFrame(TypedDict):
    """A rank's process started; it leads its own process group."""

    type: str
    rank: int
    pid: int
    pgid: int


class _LogsFrame(TypedDict):
    type: str
    rank: int
    stream: str                    # "out" | "err"
    offset: int                    # the node-local file's bytes [offset, end)
    end: int


class LogsFrame(_LogsFrame, total=False):
    """A batch of one stream's lines (hgcli.node.agent.logs)."""

    text: str                      # the bytes, decoded (the text form; read_stream gives it back)
    partial: bool                  # the last line continues in the next frame
    size: int                      # raw form on the wire: this many bytes follow the frame's line
    payload: bytes                 # the agent, before writing: the raw bytes (frames.encode_raw)
    data: bytes                    # read_stream(raw=True): the raw bytes, undecoded


class MetricFrame(TypedDict):
    """One metrics record of a rank."""

    type: str
    rank: int
    data: dict[str, Any]           # one JSON object the rank wrote to HGTRAIN_METRICS_FD


class _WarningFrame(TypedDict):
    type: str
    message: str


class WarningFrame(_WarningFrame, total=False):
    """Something the controller should show but that stops nothing."""

    rank: int                      # a rank's bad metrics line; absent for the agent's own


class HeartbeatFrame(TypedDict):
    """The agent's heartbeat; the controller's carries only its ``type``."""

    type: str
    time: float


class StoppingFrame(TypedDict):
    """The agent stops its ranks on its own, and why."""

    type: str
    reason: str
    failed: bool                   # the agent's own part failed (the job's store): the root cause
    requested: bool                # 'hgtrain stop' asked for it (a launch does not restart the job)


class RankError(TypedDict):
    """The exception a failed rank's ``@record`` wrote to its ``TORCHELASTIC_ERROR_FILE``."""

    message: str                   # "ValueError: bad batch"
    traceback: str                 # the Python call stack, "" when the file had none


class ExitFrame(TypedDict):
    """One rank ended."""

    type: str
    rank: int
    code: int | None
    signal: int | None
    signal_name: str | None
    state: str                     # a RankState: succeeded, failed, stopped, unknown
    reason: str                    # a sentence: "exited with code 3", "killed by SIGKILL: ..."
    oom: bool | None               # the OOM killer's verdict; None when not readable
    error: RankError | None        # a failed rank's @record error file; None without one


class EndFrame(TypedDict):
    """The last frame of a job."""

    type: str
    job_id: str
    node: str
    state: str                     # a NodeJobState: succeeded, failed, stopped
    reason: str | None             # why the agent stopped the job
    first_failure: ExitFrame | None   # the root cause's exit frame
    logs_complete: bool
    bytes_dropped: int


class DetachedFrame(TypedDict):
    """The agent goes on in the background (``launch --detach``): its last frame on the connection."""

    type: str
    job_id: str
    node: str
    pid: int


class ErrorFrame(TypedDict):
    """A node program refuses its request, having started nothing."""

    type: str
    message: str


class StatusRank(TypedDict):
    """One rank in a ``--status`` frame."""

    rank: int
    state: str                     # a RankState
    pid: int | None
    code: int | None
    signal: int | None
    reason: str | None
    oom: bool | None
    metrics: dict[str, Any] | None    # the rank's last metrics line


class StatusFrame(TypedDict):
    """``--status``: one per node of the job on the host."""

    type: str
    job_id: str | None
    node: str | None
    state: str                     # a NodeJobState
    agent_alive: bool
    reason: str | None
    first_failure: int | None      # the first failing rank
    started_at: float | None
    ended_at: float | None
    ranks: list[StatusRank]


Stream = Literal["out", "err"]   # a rank's stdout or stderr, as log frames and log files name it

AgentOutcome = Literal["stopped", "gone", "not responding"]   # --stop: what became of the job's agent


class StoppedFrame(TypedDict):
    """``--stop``: one per node of the job on the host."""

    type: str
    job_id: str | None
    node: str | None
    agent: AgentOutcome
    killed: list[int]              # pids the command signalled itself
    left: list[int]                # pids still there
    state: str | None              # the node's NodeJobState afterwards


class TailEndFrame(TypedDict):
    """``--tail``: after the log frames of one node."""

    type: str
    job_id: str | None             # None: the agent has not written its record yet
    node: str | None
    complete: bool                 # the job has ended there: nothing more will come
    offsets: str                   # RANK:STREAM=BYTES,... for --from
