"""The agent's frames as the controller reads them: decoded once, where the agent link reads them,
into frozen values the controller dispatches on by type (``frame_handlers.FrameHandlers.HANDLERS``).

A frame is the agent's JSON: untrusted in shape (another hgtrain version, a broken node). Each
decoder checks the fields its value needs and raises ``FrameError`` naming the field otherwise; the
link hands on a ``Malformed`` instead, which the controller reports and drops, so a bad frame is a
notice, never a traceback in the controller. Optional fields an older agent may leave out get
their defaults. The field names and meanings are the protocol's (``hgcli.node.protocol``,
docs/agent.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Union

from ..node.protocol import FrameType, Stream
from ..schema.states import NodeJobState, RankState


class FrameError(ValueError):
    """A frame lacks a field its type needs, or has one of the wrong type."""


# A frame as JSON made it: every value is checked before it is used.
Raw = Mapping[str, object]


def _wrong(key: str, what: str, value: object) -> FrameError:
    return FrameError(f"{key}: expected {what}, got {value!r}"[:200])


def _int(frame: Raw, key: str) -> int:
    value = frame.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _wrong(key, "an integer", value)


def _opt_int(frame: Raw, key: str) -> int | None:
    return None if frame.get(key) is None else _int(frame, key)


def _str(frame: Raw, key: str) -> str:
    value = frame.get(key)
    if isinstance(value, str):
        return value
    raise _wrong(key, "a string", value)


def _opt_str(frame: Raw, key: str) -> str | None:
    return None if frame.get(key) is None else _str(frame, key)


def _flag(frame: Raw, key: str) -> bool | None:
    """A true/false field; None when absent (the agent's "not known")."""
    value = frame.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise _wrong(key, "true, false or null", value)


def _ints(value: object) -> tuple[int, ...] | None:
    """``value``, a list of integers, as a tuple; None when it is not one."""
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


@dataclass(frozen=True, slots=True)
class Started:
    """A rank's process started."""

    rank: int
    pid: int

    @classmethod
    def decode(cls, frame: Raw) -> Started:
        return cls(_int(frame, "rank"), _int(frame, "pid"))


@dataclass(frozen=True, slots=True)
class Logs:
    """A batch of one stream's lines, as raw bytes (the link reads the frame's payload undecoded)."""

    rank: int
    stream: Stream
    data: bytes
    partial: bool                  # its last line continues in the next batch

    @classmethod
    def decode(cls, frame: Raw) -> Logs:
        stream, data = frame.get("stream"), frame.get("data")
        if stream != "out" and stream != "err":
            raise _wrong("stream", "'out' or 'err'", stream)
        if not isinstance(data, bytes):
            raise _wrong("data", "the batch's bytes", data)
        return cls(_int(frame, "rank"), "out" if stream == "out" else "err", data, bool(frame.get("partial")))


@dataclass(frozen=True, slots=True)
class MetricRecord:
    """One JSON object a rank wrote to its metrics descriptor: the rank's own keys and values, which
    the controller checks on the way in (``launch.metrics.RecordIntake``)."""

    rank: int
    data: dict[str, Any]

    @classmethod
    def decode(cls, frame: Raw) -> MetricRecord:
        data = frame.get("data")
        if not isinstance(data, dict):
            raise _wrong("data", "an object", data)
        return cls(_int(frame, "rank"), data)


@dataclass(frozen=True, slots=True)
class AgentWarning:
    """A warning frame from a node agent (a rank's unreadable metrics line, or the agent's own):
    shown to the user, never fatal."""

    message: str
    rank: int | None               # a rank's bad metrics line; None for the agent's own

    @classmethod
    def decode(cls, frame: Raw) -> AgentWarning:
        return cls(str(frame.get("message", "")), _opt_int(frame, "rank"))


@dataclass(frozen=True, slots=True)
class AgentStopping:
    """The agent stops its ranks on its own."""

    reason: str | None
    failed: bool                   # its own part failed (the job's store): a root cause
    requested: bool                # 'hgtrain stop' asked for it

    @classmethod
    def decode(cls, frame: Raw) -> AgentStopping:
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
    def decode(cls, frame: Raw) -> Exited:
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
    def decode(cls, frame: Raw) -> Ended:
        return cls(NodeJobState.parse(frame.get("state")), _opt_str(frame, "reason"),
                   _flag(frame, "logs_complete") is not False)


@dataclass(frozen=True, slots=True)
class Detached:
    """The agent went on in the background (``launch --detach``)."""

    @classmethod
    def decode(cls, frame: Raw) -> Detached:
        return cls()


@dataclass(frozen=True, slots=True)
class AgentError:
    """The agent refused the job (or the prepare) and exits having started nothing."""

    message: str

    @classmethod
    def decode(cls, frame: Raw) -> AgentError:
        return cls(str(frame.get("message")))


@dataclass(frozen=True, slots=True)
class Prepared:
    """The answer to ``prepare``: where the plan went on the node, the port found there, and on a
    restart the saved states listed there."""

    job_dir: str
    plan: str                      # the plan file's path on the node
    port: int | None
    checkpoints: Mapping[str, tuple[int, ...]] | None   # PS shard -> checkpoint versions
    snapshots: tuple[int, ...] | None   # steps of the all-reduce snapshots

    @classmethod
    def decode(cls, frame: Raw) -> Prepared:
        listed, snapshots = frame.get("checkpoints"), frame.get("snapshots")
        checkpoints: Mapping[str, tuple[int, ...]] | None = None
        if listed is not None:
            versions = {str(k): _ints(v) for k, v in listed.items()} if isinstance(listed, dict) else None
            if versions is None or any(v is None for v in versions.values()):
                raise _wrong("checkpoints", "an object of lists of integers, or null", listed)
            checkpoints = MappingProxyType({k: v for k, v in versions.items() if v is not None})
        steps = _ints(snapshots) if snapshots is not None else None
        if snapshots is not None and steps is None:
            raise _wrong("snapshots", "a list of integers or null", snapshots)
        return cls(_str(frame, "job_dir"), _str(frame, "plan"), _opt_int(frame, "port"), checkpoints, steps)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A frame that did not decode: reported and dropped."""

    type: FrameType
    why: str


# What the controller acts on; the other frames (heartbeat, agent, stopping notes...) are only heard.
Frame = Union[Started, Logs, MetricRecord, AgentWarning, AgentStopping, Exited, Ended, Detached, AgentError,
              Prepared, Malformed]

DECODERS: dict[FrameType, Callable[[Raw], Frame]] = {
    FrameType.STARTED: Started.decode, FrameType.LOGS: Logs.decode, FrameType.METRIC: MetricRecord.decode,
    FrameType.WARNING: AgentWarning.decode, FrameType.STOPPING: AgentStopping.decode,
    FrameType.EXIT: Exited.decode, FrameType.END: Ended.decode, FrameType.DETACHED: Detached.decode,
    FrameType.ERROR: AgentError.decode, FrameType.PREPARED: Prepared.decode,
}


def decode(kind: FrameType | None, frame: Raw) -> Frame | None:
    """``frame`` (of type ``kind``) as its value; None for a frame the controller only hears; a
    ``Malformed`` for one whose fields are not what its type needs."""
    decoder = DECODERS.get(kind) if kind is not None else None
    if decoder is None or kind is None:
        return None
    try:
        return decoder(frame)
    except FrameError as exc:
        return Malformed(kind, str(exc))
