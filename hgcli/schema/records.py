"""The metric records ranks send their launcher: one typed contract for both ends of the pipe.

A rank writes one JSON object per line on HGTRAIN_METRICS_FD (runtime/metrics.py): an envelope
(``time``, ``rank``, ``role`` and, on workers, ``group``) and the record's fields. hgtrain's own
records carry ``event``, one of ``RecordKind``, and are built as the frozen dataclasses below, so a
misspelt kind or field fails where it is written (the enum, the type checker) rather than being
dropped by a reader. ``encode`` turns one into the dict for the pipe; ``decode`` turns a rank's dict
back into a record, refusing (``InvalidRecord``) one of hgtrain's kinds whose fields are not what
the kind says. Rank output is untrusted: every number must be finite and below 2^63, every list and
string is bounded. What only the plan can tell (does the rank lead that group?) is checked by the
launcher's readers (launch/events.py).

Everything else a script logs with ``ctx.log(**fields)`` is a ``UserRecord``: a training step when
it has no ``event`` and numbers for ``step`` and ``samples``; else the script's own event (an eval,
a final accuracy). A script cannot log an ``event`` named like one of hgtrain's kinds (``reserved``).

Standard library only: ranks import it without the controller, the controller without torch.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, TypedDict, Union

from .stages import Strategy

# Numbers in rank records beyond this magnitude are treated as missing: steps and versions become
# int64 in TensorBoard files, and a 400-digit integer does not even convert to a float.
LARGEST = float(2 ** 63)
MAX_ITEMS = 4096      # entries in a record's list (ranks, groups, batches): far more than any plan has
MAX_TEXT = 256        # characters in a record's string field

EVENT = "event"       # the envelope key that names a record's kind
ADAPT_KIND = "kind"   # in an ``adapt`` record: which re-split it was


class RecordKind(str, enum.Enum):
    """The ``event`` of every record hgtrain's runtime or launcher writes into a job's metrics."""

    FINISH = "finish"          # a worker finished training: its totals
    RATES = "rates"            # a worker's measured compute rate so far (each timing window)
    SKIP = "skip"              # a group skipped a step (the GradScaler found inf/NaN)
    SNAPSHOT = "snapshot"      # an all-reduce worker's snapshot is on disk
    RESUMED = "resumed"        # training continued from a snapshot or a PS checkpoint
    SYNC = "sync"              # a group's leader exchanged with the parameter servers
    PS_READY = "ps_ready"      # a PS shard joined the job
    PS_PUSH = "ps_push"        # a PS shard applied a group's push
    PS_END = "ps_end"          # a PS shard is done
    ADAPT = "adapt"            # a batch re-split or a re-grouping (``kind``: AdaptKind)


class AdaptKind(str, enum.Enum):
    """Which adaptation an ``adapt`` record reports."""

    REBALANCE = "rebalance"    # a group re-split its batch among its members (runtime/adapt/rebalance.py)
    SHARES = "shares"          # PS shard 0 re-split the global batch across groups (runtime/adapt/shares.py)
    REGROUP = "regroup"        # the launcher re-grouped a straggling all-reduce job (launch/adapt.py)


class SavedState(str, enum.Enum):
    """What a restarted attempt's training continues from."""

    SNAPSHOT = "snapshot"          # all-reduce: the first worker's training-state snapshot
    CHECKPOINT = "checkpoint"      # PS ranks: the shards' last complete checkpoint


class InvalidRecord(ValueError):
    """A record of one of hgtrain's kinds whose fields are not what the kind says."""

    def __init__(self, kind: RecordKind, reason: str) -> None:
        super().__init__(f"{kind.value} record: {reason}")
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class _Record:
    """The common base: each kind names itself (``KIND``) and the fields that cannot be negative."""

    KIND: ClassVar[RecordKind]
    ADAPT: ClassVar[AdaptKind | None] = None
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ()

    def problem(self) -> str | None:
        """What is wrong across fields (decode checks each field's type and sign before)."""
        return None


class FinishMemory(TypedDict):
    """A worker's memory figures in its ``finish`` record (runtime/memory.py), in MiB."""

    accounted_peak_mib: float | None       # largest step counted from its tensors (CPU devices)
    peak_rss_growth_mib: float | None      # the process's peak RSS less its RSS when the runtime began
    cuda_max_allocated_mib: float | None   # torch.cuda.max_memory_allocated (a real GPU)


@dataclass(frozen=True)
class FinishRecord(_Record):
    """A worker's totals when it leaves the job: the next plan is fitted to its compute rate; its
    memory peaks (``FinishMemory``'s fields) are held against the plan's prediction."""

    KIND = RecordKind.FINISH
    NON_NEGATIVE = ("samples", "steps", "compute_s", "emulated_sleep_s", "emulated_step_s", "sync_s",
                    "skipped_steps", "compute_samples_per_s", "compute_noise", "accounted_peak_mib",
                    "peak_rss_growth_mib", "cuda_max_allocated_mib")
    samples: float                       # samples this worker trained on
    steps: int                           # its optimizer steps
    compute_s: float | None              # seconds of its compute (None: not measured)
    emulated_sleep_s: float              # seconds slept to emulate a slower device
    emulated_step_s: float               # seconds its emulated steps were stretched to, summed
    sync_s: float | None = None          # seconds waiting on the group and the PS (ctx.wrap only)
    skipped_steps: int | None = None     # steps skipped for inf/NaN gradients (ctx.wrap only)
    compute_samples_per_s: float | None = None   # samples per second of compute, waits left out
    compute_noise: float | None = None   # how uneven its steps were (0: even)
    accounted_peak_mib: float | None = None      # FinishMemory's fields; None: not measured
    peak_rss_growth_mib: float | None = None
    cuda_max_allocated_mib: float | None = None


@dataclass(frozen=True)
class RatesRecord(_Record):
    """A worker's figures so far, each timing window: the launcher re-groups a running job on them."""

    KIND = RecordKind.RATES
    NON_NEGATIVE = ("step", "samples", "steps", "compute_samples_per_s", "compute_noise",
                    "recent_samples_per_s", "recent_noise")
    group: int
    step: int                            # the worker's local step
    compute_samples_per_s: float | None  # samples per second of compute over the run
    samples: float                       # samples trained so far
    steps: int                           # steps so far
    compute_noise: float | None = None   # how uneven its steps are
    recent_samples_per_s: float | None = None   # the same over its last windows
    recent_noise: float | None = None


@dataclass(frozen=True)
class SkipRecord(_Record):
    """A group's step that nobody took: some member's GradScaler found inf/NaN in the gradient."""

    KIND = RecordKind.SKIP
    NON_NEGATIVE = ("step", "version")
    group: int
    step: int                            # the local step skipped
    version: int                         # the PS version the group holds (0 without PS)


@dataclass(frozen=True)
class SnapshotRecord(_Record):
    """An all-reduce worker's snapshot of step ``step`` is complete on disk (re-grouping needs one)."""

    KIND = RecordKind.SNAPSHOT
    NON_NEGATIVE = ("step",)
    step: int                            # optimizer steps in the snapshot


@dataclass(frozen=True)
class ResumedRecord(_Record):
    """Training continued from a saved state: the first worker's snapshot or PS shard 0's checkpoint."""

    KIND = RecordKind.RESUMED
    NON_NEGATIVE = ("step", "samples")
    source: SavedState
    step: int                            # snapshot: optimizer steps; checkpoint: the PS version
    samples: int | None                  # samples trained when it was taken (None: not counted)


@dataclass(frozen=True)
class SyncRecord(_Record):
    """A group leader's exchange with the parameter servers: one per push."""

    KIND = RecordKind.SYNC
    NON_NEGATIVE = ("version", "samples", "allreduce_s", "push_s", "broadcast_s")
    group: int
    version: int                         # the PS version the group got back
    samples: float                       # samples in the pushed gradient
    allreduce_s: float                   # seconds in the group's all-reduce before the push
    push_s: float                        # seconds from the push to the answer
    broadcast_s: float                   # seconds spreading the answer over the group


@dataclass(frozen=True)
class PsReadyRecord(_Record):
    """A PS shard joined the job, holding nothing yet: its memory and threads before the model."""

    KIND = RecordKind.PS_READY
    NON_NEGATIVE = ("shard", "rss_kb", "threads")
    shard: int
    rss_kb: int | None                   # resident memory, KiB (None: not on Linux)
    threads: int                         # torch's intra-op threads


@dataclass(frozen=True)
class PsPushRecord(_Record):
    """A PS shard applied a group's push."""

    KIND = RecordKind.PS_PUSH
    NON_NEGATIVE = ("shard", "group", "version", "staleness", "delay", "scale", "update_s")
    shard: int
    group: int                           # the group that pushed
    version: int                         # the shard's version after it
    staleness: int                       # versions between the group's base and this one
    delay: int                           # the staleness its update was damped by
    scale: float                         # the factor the gradient was scaled by
    update_s: float                      # seconds in the optimizer step


@dataclass(frozen=True)
class PsEndRecord(_Record):
    """A PS shard's totals when every group is done."""

    KIND = RecordKind.PS_END
    NON_NEGATIVE = ("shard", "version", "update_s", "peak_rss_kb")
    shard: int
    version: int                         # its last version
    update_s: float                      # seconds in optimizer steps, summed
    peak_rss_kb: int | None              # peak resident memory, KiB (None: not on Linux)
    impl: str                            # the optimizer's implementation (foreach, fused, ...)


@dataclass(frozen=True)
class _Split(_Record):
    """A batch re-split: ``before`` and ``batches`` have one entry per member (or group), in order."""

    KIND = RecordKind.ADAPT
    NON_NEGATIVE = ("step", "data_step", "step_before_s", "step_after_s")
    step: int                            # the step (shares: shard 0's check) that decided it
    data_step: int                       # the first data step cut the new way
    before: tuple[int, ...]              # batches before
    batches: tuple[int, ...]             # batches from data_step on
    rates: tuple[float, ...]             # measured samples per compute second of each
    step_before_s: float                 # the slowest one's step at the old split, predicted
    step_after_s: float                  # ... and at the new one

    def members(self) -> tuple[int, ...]:
        raise NotImplementedError

    def problem(self) -> str | None:
        n = len(self.members())
        if not all(len(v) == n for v in (self.before, self.batches, self.rates)):
            return f"before, batches and rates need {n} entries each"
        if not all(b > 0 for b in self.before + self.batches) or not all(r > 0 for r in self.rates):
            return "batches and rates must be positive"
        if sum(self.before) != sum(self.batches):
            return "a re-split keeps the total batch"
        return None


@dataclass(frozen=True)
class RebalanceRecord(_Split):
    """A group re-split its batch among its members (written by its leader, ``ranks[0]``)."""

    ADAPT = AdaptKind.REBALANCE
    group: int
    ranks: tuple[int, ...]               # the group's members, in order

    def members(self) -> tuple[int, ...]:
        return self.ranks


@dataclass(frozen=True)
class SharesRecord(_Split):
    """PS shard 0 re-split the global batch across groups (``batches``: each group's total)."""

    ADAPT = AdaptKind.SHARES
    groups: tuple[int, ...]              # the group ids, in block order

    def members(self) -> tuple[int, ...]:
        return self.groups


@dataclass(frozen=True)
class RegroupRecord(_Record):
    """The launcher re-grouped a straggling all-reduce job (written by the launcher itself)."""

    KIND = RecordKind.ADAPT
    ADAPT = AdaptKind.REGROUP
    NON_NEGATIVE = ("attempt", "predicted_before", "predicted_after")
    attempt: int                         # the attempt that runs the new plan
    strategy: Strategy                   # the new plan's
    groups: tuple[tuple[int, ...], ...]  # the new plan's groups (ranks)
    predicted_before: float              # samples/s of the old plan, fitted to the measured rates
    predicted_after: float               # samples/s of the new plan


RuntimeRecord = Union[FinishRecord, RatesRecord, SkipRecord, SnapshotRecord, ResumedRecord, SyncRecord,
                      PsReadyRecord, PsPushRecord, PsEndRecord, RebalanceRecord, SharesRecord, RegroupRecord]
RECORD_TYPES: tuple[type[_Record], ...] = typing.get_args(RuntimeRecord)
_BY_KIND: dict[tuple[RecordKind, AdaptKind | None], type[_Record]] = {(c.KIND, c.ADAPT): c for c in RECORD_TYPES}


@dataclass(frozen=True)
class UserRecord:
    """What a script logged with ``ctx.log``: a training step, its own event, or other figures."""

    event: str | None                    # the script's event (eval, final...); None: none
    step: int | None
    samples: float | None
    loss: float | None
    accuracy: float | None

    @property
    def is_training_step(self) -> bool:
        """A step that trained: no event, and numbers for ``step`` and ``samples``."""
        return self.event is None and self.step is not None and self.samples is not None


Entry = Union[RuntimeRecord, UserRecord]


def number(value: Any) -> float | None:
    """A record's number as a float: None for anything else, and for numbers that are not finite
    or beyond LARGEST (rank output is untrusted: Infinity, NaN and huge integers parse as JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) and abs(f) < LARGEST else None


def clean_record(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with every number that ``number`` would refuse (in lists and nested objects too)
    replaced by None, and the keys where that happened: what is stored, shown and aggregated of a
    rank's record, so that --json stays JSON and no reader trips over it."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if number(value) is None:
                bad.append(key)
                return None
            return value
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        return value

    out = clean(data, "")
    return out, sorted(set(bad))


def encode(record: RuntimeRecord) -> dict[str, Any]:
    """The record as the pipe carries it: ``event`` (and an adapt record's ``kind``) first, then its
    fields (tuples as lists, enums as their values; None as null: every kind has all its keys)."""
    out: dict[str, Any] = {EVENT: record.KIND.value}
    if record.ADAPT is not None:
        out[ADAPT_KIND] = record.ADAPT.value
    for f in dataclasses.fields(record):
        out[f.name] = _plain(getattr(record, f.name))
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def runtime_kind(data: Mapping[str, Any]) -> RecordKind | None:
    """The hgtrain kind ``data``'s ``event`` names; None for a script's own record."""
    event = data.get(EVENT)
    if not isinstance(event, str):
        return None
    try:
        return RecordKind(event)
    except ValueError:
        return None


def decode(data: Mapping[str, Any]) -> Entry:
    """What a rank's record is: one of hgtrain's records, checked field by field, or a UserRecord.
    Raises InvalidRecord for a record of hgtrain's kinds that is not what its kind says."""
    kind = runtime_kind(data)
    if kind is None:
        return _user(data)
    adapt: AdaptKind | None = None
    if kind is RecordKind.ADAPT:
        try:
            adapt = AdaptKind(data.get(ADAPT_KIND))
        except ValueError:
            raise InvalidRecord(kind, f"'kind' must be one of {', '.join(k.value for k in AdaptKind)}") from None
    cls = _BY_KIND[(kind, adapt)]
    values = {}
    for name, (tp, required) in _FIELD_TYPES[cls].items():
        if name not in data:
            if required:
                raise InvalidRecord(kind, f"no '{name}'")
            continue
        try:
            values[name] = _convert(tp, data[name])
        except ValueError as exc:
            raise InvalidRecord(kind, f"'{name}' {exc}") from None
        if name in cls.NON_NEGATIVE and _negative(values[name]):
            raise InvalidRecord(kind, f"'{name}' must not be negative")
    record = cls(**values)
    problem = record.problem()
    if problem is not None:
        raise InvalidRecord(kind, problem)
    return typing.cast(RuntimeRecord, record)


def parse(data: Mapping[str, Any]) -> Entry | None:
    """``decode`` for a reader that does not report refusals (the launcher's intake does): None for
    an invalid record of hgtrain's kinds."""
    try:
        return decode(data)
    except InvalidRecord:
        return None


def reserved(fields: Mapping[str, Any]) -> str | None:
    """Why a script may not log ``fields`` (its ``event`` is one of hgtrain's kinds); None: it may."""
    kind = runtime_kind(fields)
    if kind is None:
        return None
    return (f"ctx.log(event={kind.value!r}): the 'event' field value {kind.value!r} is reserved for "
            f"hgtrain's own records ({', '.join(k.value for k in RecordKind)}); name your event otherwise")


def _user(data: Mapping[str, Any]) -> UserRecord:
    event = data.get(EVENT)
    step = number(data.get("step"))
    return UserRecord(event=None if event is None else str(event)[:MAX_TEXT],
                      step=None if step is None else int(step), samples=number(data.get("samples")),
                      loss=number(data.get("loss")), accuracy=number(data.get("accuracy")))


def _fields(cls: type[_Record]) -> dict[str, tuple[Any, bool]]:
    """Each field's type and whether a record must have it (fields added later have defaults, so
    a job's metrics written by an older hgtrain still read)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING) for f in dataclasses.fields(cls)}


def _convert(tp: Any, value: Any) -> Any:
    """``value`` (decoded JSON) as type ``tp``; ValueError saying what it must be."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) > MAX_ITEMS:
            raise ValueError(f"must be a list of at most {MAX_ITEMS} entries")
        return tuple(_convert(args[0], v) for v in value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ValueError(f"must be one of {', '.join(str(m.value) for m in tp)}") from None
    if tp is str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ValueError(f"must be a string of at most {MAX_TEXT} characters")
        return value
    if number(value) is None or (tp is int and not isinstance(value, int)):
        raise ValueError(f"must be {'an integer' if tp is int else 'a number'}, finite and below 2^63")
    return value


def _negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and value < 0


_FIELD_TYPES = {cls: _fields(cls) for cls in RECORD_TYPES}   # resolved once (get_type_hints is slow)
