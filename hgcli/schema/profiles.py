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


# Units a sharded (FSDP2) rank holds unsharded at once: the one it computes and the next one it
# prefetches (in backward, the unit's unsharded gradients take the prefetched one's place).
GATHERED_UNITS = 2


@dataclass(frozen=True)
class ActivationSample:
    """The peak bytes of a training step's activations (what autograd keeps for backward, and the
    batch) at one batch size."""

    batch_size: int
    bytes: int


@dataclass(frozen=True)
class MemoryProfile:
    """What the user's model needs in device memory, apart from the device's speed: the planner's
    memory model (docs/planning.md, "Memory") prices each engine's rank from it."""

    parameter_bytes: int           # measured: every parameter's elements x element size
    # Computed, not measured: parameters + gradients + AdamW's two moments (4 x parameter_bytes), the
    # state of the optimizer most training scripts use (the bench itself steps SGD with momentum).
    state_bytes: int
    # The largest FSDP2 unit's parameters (one child of an nn.ModuleList, or what the root keeps for
    # itself): a sharded rank holds it unsharded while it computes that unit.
    largest_unit_bytes: int
    # Measured at the bench's batch sizes: the step's peak less the state it stepped with.
    activations: tuple[ActivationSample, ...] = ()

    def activation_bytes(self, batch: float) -> float:
        """Activations at ``batch``: on the line through the smallest and the largest batch measured
        (activations grow linearly with the batch), never below 0; proportional to the batch with
        one measurement, 0 with none."""
        points = sorted((a.batch_size, a.bytes) for a in self.activations if a.batch_size > 0)
        if not points:
            return 0.0
        (b0, y0), (b1, y1) = points[0], points[-1]
        if b1 == b0:
            return max(0.0, y0 * batch / b0)
        slope = max(0.0, (y1 - y0) / (b1 - b0))
        return max(0.0, y0 + slope * (batch - b0))

    def least_bytes(self) -> float:
        """The least device memory a training rank of this model needs: one sample's activations and
        the gathered units, its state sharded and offloaded to host memory (FSDP2 with CPU offload)."""
        return self.activation_bytes(1) + GATHERED_UNITS * self.largest_unit_bytes


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
    # The benched model's memory needs (with --model); None in older profiles, whose devices the
    # planner caps by the steps' memory alone, as before (every rank a DDP replica).
    memory: MemoryProfile | None = None

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
