"""The Profiles stage's values: what ``bench`` measured of each device and link, and the rates a
job of a script measured (for the next plan of that script)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .base import SCHEMA_VERSION, Device, as_device, frozen_map, settle


@dataclass(frozen=True)
class Measurement:
    """A repeated measurement: median and spread, so noisy figures are visible as such."""

    median: float
    min: float
    max: float
    repeats: int


@dataclass(frozen=True)
class StepSample:
    """One device's timed training step at one batch size: the points the planner's time(batch)
    fit is made of."""

    batch_size: int
    seconds: Measurement           # forward + backward + optimizer step
    memory_mib: int | None = None  # peak device memory at that batch size


@dataclass(frozen=True)
class ExchangeProfile:
    """One parameter-server push on a node, measured over loopback (hgcli/node/bench/exchange.py)."""

    bytes: int                     # gradient pushed (the benched model's parameters x 4)
    round_trip_s: Measurement      # push, PS update, fresh parameters back, as the runtime does it
    latency_s: Measurement         # the same for a one-element push: the fixed cost
    service_s: Measurement         # the PS's own busy time per push (it serves pushes one at a time)


@dataclass(frozen=True)
class GroupSyncProfile:
    """A synchronous step of every emulated device of a node, measured as training runs it
    (hgcli/node/bench/group.py): the all-reduce, waits included, and how much more CPU the ranks'
    own compute took in the synchronous group than running free."""

    ranks: int                     # the node's emulated devices, each a process of the group
    bytes: int                     # the all-reduce buffer (the benched model's parameters x 4, + slots)
    step_s: float                  # the emulated step the ranks ran (rank 0's, free), seconds
    seconds: Measurement           # per synchronous step, inside the all-reduce
    batch: int = 0                 # the benched model's batch each rank ran (0: profiles before it)
    speed: float = 0.0             # the emulated speed each rank ran at
    # CPU per step of the ranks' compute, synchronous over free; None in profiles before it (1.0)
    compute_ratio: Measurement | None = None


@dataclass(frozen=True)
class TogetherStep:
    """A device's training steps at one batch while every device of its node stepped at once, each
    in its own process, over one common window (hgcli/node/bench/together.py)."""

    batch_size: int
    seconds: Measurement           # wall seconds of each step wholly inside the window
    mean_s: float                  # the window's mean step: what throughput follows


@dataclass(frozen=True)
class TogetherProfile:
    """How a device steps beside its neighbours, as it will train: the contention for the node's
    CPU, caches and buses is in these figures and not in ``DeviceProfile.steps`` (alone)."""

    devices: int                   # devices of the node that stepped at once, this one included
    steps: tuple[TogetherStep, ...]


@dataclass(frozen=True)
class DeviceProfile:
    """What the bench measured of one device (step times per batch, alone and beside its node's
    other devices): the planner's figure of its speed and memory."""

    node: str
    device: Device                 # "gpu0", "gpu1", ... or "cpu"
    name: str                      # model name, e.g. "NVIDIA A100-SXM4-40GB"
    emulated: bool
    speed: float                   # emulated relative speed (1.0 for real devices)
    memory_total_mib: int | None
    matmul_tflops: Mapping[str, Measurement] = field(default_factory=dict)   # dtype -> TFLOP/s
    mem_bandwidth_gbs: Measurement | None = None
    h2d_bandwidth_gbs: Measurement | None = None
    steps: tuple[StepSample, ...] = ()
    error: str | None = None       # "out of memory", driver error...; the rest of the run continues
    torch_version: str | None = None
    driver_version: str | None = None
    exchange: ExchangeProfile | None = None   # PS push cost on this device's node (with --model)
    group_sync: GroupSyncProfile | None = None   # emulated nodes: their devices' synchronous step
    # Nodes of two or more devices: this device's steps with all of them stepping at once. Additive:
    # None in profiles of one-device nodes, of a together bench that failed, and of older benches
    # (the planner then costs the device from ``steps`` alone, as before).
    together: TogetherProfile | None = None

    def __post_init__(self) -> None:
        settle(self, device=as_device(self.device), matmul_tflops=frozen_map(self.matmul_tflops))


@dataclass(frozen=True)
class LinkProfile:
    """The measured bandwidth and latency between two nodes, or why they could not be measured:
    what prices the exchange across them."""

    a: str                         # node names
    b: str
    backend: str                   # "gloo" | "nccl"
    bandwidth_gbs: Measurement | None = None
    latency_s: Measurement | None = None
    error: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of the user's model: its size (traffic) and a label."""

    name: str
    parameters: int
    bytes_per_parameter: int = 4


@dataclass(frozen=True)
class Profiles:
    """The bench stage's value: every device and link profile of one cluster fingerprint, and the
    model they were timed on."""

    cluster: str                   # Cluster.fingerprint()
    devices: tuple[DeviceProfile, ...]
    links: tuple[LinkProfile, ...] = ()
    model: ModelSpec | None = None
    measured_at: float = 0.0
    version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class MeasuredRate:
    """One worker device's compute while a job trained: its finish record's samples per second of
    compute (waits for other members left out) at its mean batch over the run."""

    node: str
    device: Device                 # "gpu0"... or "cpu", as in the profiles
    batch_size: float              # the device's samples per step, on average (rebalancing moves it)
    samples_per_s: float
    # How uneven its steps were: mean per-sample compute over its 10th percentile, less one (the
    # planner's Device.noise, which prices a synchronous group's wait for its slowest member).
    noise: float | None = None

    def __post_init__(self) -> None:
        settle(self, device=as_device(self.device))


@dataclass(frozen=True)
class ScriptRates:
    """What one job of a script measured, stored for the next plan of the same script
    (``clusters/<fingerprint>/scripts/``, hgcli/bench/rates.py): a bench times a model, not the
    user's script with its data loading and its devices' contention for a node's CPU."""

    cluster: str                   # Cluster.fingerprint()
    script: str                    # bench.rates.script_identity: "module pkg.train" or "script train.py"
    job_id: str
    measured_at: float
    bench_measured_at: float       # Profiles.measured_at the job planned from: a new bench drops these
    rates: tuple[MeasuredRate, ...]
    version: int = SCHEMA_VERSION
