"""The agent's frames as the controller reads them: decoded once, where the agent link reads them,
into frozen values the controller dispatches on by type (``loop.JobController.HANDLERS``).

A frame is the agent's JSON: untrusted in shape (another hgtrain version, a broken node). Each
decoder checks the fields its value needs and raises ``FrameError`` naming the field otherwise; the
link hands on a ``Malformed`` instead, which the controller reports and drops, so a bad frame is a
notice, never a traceback in the controller. Optional fields an older agent may leave out get
their defaults. The field names and meanings are the protocol's (``hgcli.node.protocol``,
docs/agent.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

from ..node.protocol import FrameType
from ..schema.states import NodeJobState, RankState


class FrameError(ValueError):
    """A frame lacks a field its type needs, or has one of the wrong type."""


def _field(frame: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str,
           optional: bool = False) -> Any:
    value = frame.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise FrameError(f"{key}: expected {what}, got {value!r}"[:200])
    return value


def _int(frame: Mapping[str, Any], key: str) -> int:
    value: int = _field(frame, key, int, "an integer")
    return value


def _opt_int(frame: Mapping[str, Any], key: str) -> int | None:
    value: int | None = _field(frame, key, int, "an integer or null", optional=True)
    return value


def _opt_str(frame: Mapping[str, Any], key: str) -> str | None:
    value: str | None = _field(frame, key, str, "a string or null", optional=True)
    return value


def _flag(frame: Mapping[str, Any], key: str) -> bool | None:
    """A true/false field; None when absent (the agent's "not known")."""
    value: bool | None = _field(frame, key, bool, "true, false or null", optional=True)
    return value


@dataclass(frozen=True, slots=True)
class Started:
    """A rank's process started."""

    rank: int
    pid: int

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Started:
        return cls(_int(frame, "rank"), _int(frame, "pid"))


STREAMS = ("out", "err")


@dataclass(frozen=True, slots=True)
class Logs:
    """A batch of one stream's lines, as raw bytes (the link reads the frame's payload undecoded)."""

    rank: int
    stream: str                    # "out" | "err"
    data: bytes
    partial: bool                  # its last line continues in the next batch

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Logs:
        stream = frame.get("stream")
        if stream not in STREAMS:
            raise FrameError(f"stream: expected 'out' or 'err', got {stream!r}"[:200])
        data: bytes = _field(frame, "data", bytes, "the batch's bytes")
        return cls(_int(frame, "rank"), stream, data, bool(frame.get("partial")))


@dataclass(frozen=True, slots=True)
class MetricRecord:
    """One JSON object a rank wrote to its metrics descriptor: the rank's own keys and values, which
    the metrics board checks (``launch.metrics.clean_record``)."""

    rank: int
    data: dict[str, Any]

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> MetricRecord:
        data: dict[str, Any] = _field(frame, "data", dict, "an object")
        return cls(_int(frame, "rank"), data)


@dataclass(frozen=True, slots=True)
class AgentWarning:
    message: str
    rank: int | None               # a rank's bad metrics line; None for the agent's own

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> AgentWarning:
        return cls(str(frame.get("message", "")), _opt_int(frame, "rank"))


@dataclass(frozen=True, slots=True)
class AgentStopping:
    """The agent stops its ranks on its own."""

    reason: str | None
    failed: bool                   # its own part failed (the job's store): a root cause
    requested: bool                # 'hgtrain stop' asked for it

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> AgentStopping:
        return cls(_opt_str(frame, "reason") or None, bool(_flag(frame, "failed")), bool(_flag(frame, "requested")))


@dataclass(frozen=True, slots=True)
class RecordedError:
    """The exception a failed rank's ``@record`` wrote (``protocol.RankError``), as the rank wrote it."""

    message: str
    traceback: str                 # "" when the file had none

    @classmethod
    def decode(cls, value: object) -> RecordedError | None:
        """None for anything but an object with a string message: the file is the rank's, and a
        rank's error file of another shape says nothing the exit itself does not."""
        if not isinstance(value, dict) or not isinstance(value.get("message"), str):
            return None
        stack = value.get("traceback")
        return cls(value["message"], stack if isinstance(stack, str) else "")


@dataclass(frozen=True, slots=True)
class Exited:
    """One rank ended."""

    rank: int
    code: int | None
    signal: int | None
    signal_name: str | None        # "SIGKILL"...
    state: RankState
    reason: str | None             # a sentence: "exited with code 3", "killed by SIGKILL: ..."
    oom: bool | None               # the OOM killer's verdict; None when not readable
    error: RecordedError | None

    @property
    def exit_code(self) -> int | None:
        """The code a shell would show: the exit code, or 128 + the signal number."""
        return 128 + self.signal if self.signal is not None else self.code

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Exited:
        return cls(rank=_int(frame, "rank"), code=_opt_int(frame, "code"), signal=_opt_int(frame, "signal"),
                   signal_name=_opt_str(frame, "signal_name"), state=RankState.parse(frame.get("state")),
                   reason=_opt_str(frame, "reason") or None, oom=_flag(frame, "oom"),
                   error=RecordedError.decode(frame.get("error")))


@dataclass(frozen=True, slots=True)
class Ended:
    """The last frame of the job on the node."""

    state: NodeJobState
    reason: str | None
    logs_complete: bool            # False: some lines were only kept in the node-local files

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Ended:
        return cls(NodeJobState.parse(frame.get("state")), _opt_str(frame, "reason"),
                   _flag(frame, "logs_complete") is not False)


@dataclass(frozen=True, slots=True)
class Detached:
    """The agent went on in the background (``launch --detach``)."""

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Detached:
        return cls()


@dataclass(frozen=True, slots=True)
class AgentError:
    """The agent refused the job (or the prepare) and exits having started nothing."""

    message: str

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> AgentError:
        return cls(str(frame.get("message")))


@dataclass(frozen=True, slots=True)
class Prepared:
    """The answer to ``prepare``: where the plan went on the node, the port found there, and on a
    restart the saved states listed there."""

    job_dir: str
    plan: str                      # the plan file's path on the node
    port: int | None
    checkpoints: dict[str, list[int]] | None   # PS shard -> checkpoint versions
    snapshots: list[int] | None    # steps of the all-reduce snapshots

    @classmethod
    def decode(cls, frame: Mapping[str, Any]) -> Prepared:
        checkpoints = _field(frame, "checkpoints", dict, "an object or null", optional=True)
        if checkpoints is not None and not all(_ints(v) for v in checkpoints.values()):
            raise FrameError("checkpoints: expected lists of integers")
        snapshots = _field(frame, "snapshots", list, "a list or null", optional=True)
        if snapshots is not None and not _ints(snapshots):
            raise FrameError("snapshots: expected a list of integers")
        return cls(_field(frame, "job_dir", str, "a string"), _field(frame, "plan", str, "a string"),
                   _opt_int(frame, "port"),
                   {str(k): list(v) for k, v in checkpoints.items()} if checkpoints is not None else None,
                   list(snapshots) if snapshots is not None else None)


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A frame that did not decode: reported and dropped."""

    type: FrameType
    why: str


# What the controller acts on; the other frames (heartbeat, agent, stopping notes...) are only heard.
Frame = Union[Started, Logs, MetricRecord, AgentWarning, AgentStopping, Exited, Ended, Detached, AgentError,
              Prepared, Malformed]

DECODERS: dict[FrameType, Callable[[Mapping[str, Any]], Frame]] = {
    FrameType.STARTED: Started.decode, FrameType.LOGS: Logs.decode, FrameType.METRIC: MetricRecord.decode,
    FrameType.WARNING: AgentWarning.decode, FrameType.STOPPING: AgentStopping.decode,
    FrameType.EXIT: Exited.decode, FrameType.END: Ended.decode, FrameType.DETACHED: Detached.decode,
    FrameType.ERROR: AgentError.decode, FrameType.PREPARED: Prepared.decode,
}


def decode(kind: FrameType | None, frame: Mapping[str, Any]) -> Frame | None:
    """``frame`` (of type ``kind``) as its value; None for a frame the controller only hears; a
    ``Malformed`` for one whose fields are not what its type needs."""
    decoder = DECODERS.get(kind) if kind is not None else None
    if decoder is None or kind is None:
        return None
    try:
        return decoder(frame)
    except FrameError as exc:
        return Malformed(kind, str(exc))
