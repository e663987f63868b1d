"""Frozen dataclasses and str-Enums passed between the stages.

cluster.toml -> Cluster -> (probe) Inventory -> (bench) Profiles -> (plan) Plan -> (launch) Job.
Every value here serialises to plain JSON with ``to_dict`` and back with ``from_dict``; the ``--json``
output of a stage is exactly that, so scripts can chain stages. This module imports only the standard
library because it is shipped to nodes with the node-side code.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, TypeVar, Union

# The generic JSON conversion, re-exported: stages import it from here with the classes. Its own
# module so node programs that parse only their own dataclasses need not create these.
from . import codec
# The states, re-exported: a rank's state is the same member on the node and in the job record.
from .states import JobState as JobState, RankState as RankState

to_dict, to_json, from_dict = codec.to_dict, codec.to_json, codec.from_dict

# Bumped when a stored JSON shape changes incompatibly; readers refuse other versions.
SCHEMA_VERSION = 1


class Wire(str, enum.Enum):
    """Number format of a hybrid plan's pushes and pulls (Plan.wire): the cost model prices the PS
    traffic with its ``bytes`` per parameter and the runtime sends tensors of that dtype."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def bytes(self) -> int:
        return 2 if self is Wire.BF16 else 4

    @classmethod
    def _missing_(cls, value: object) -> Wire:
        raise ValueError(f"wire format must be one of {', '.join(w.value for w in cls)}, got {value!r}")


class Device(str):
    """A device of a node, as profiles, plans and measured rates name it: ``gpuN`` is the node's CUDA
    device N, ``cpu`` its processor; other names are devices hgtrain does not run ranks on by index
    (an emulated local rank's ``emuN``, an imported profile's). A ``str``, so its JSON form and its
    comparisons are the name's; checked once, where it is made (a ``gpu`` name needs its index)."""

    def __new__(cls, name: str) -> Device:
        if not isinstance(name, str) or not name or (name.startswith("gpu") and not name[3:].isdigit()):
            raise ValueError(f"device must be gpuN, cpu or another non-empty name, got {name!r}")
        return super().__new__(cls, name)

    @classmethod
    def gpu(cls, index: int) -> Device:
        return cls(f"gpu{index}")

    @property
    def gpu_index(self) -> int | None:
        """N of ``gpuN``; None for every other device."""
        return int(self[3:]) if self.startswith("gpu") else None

    @property
    def is_gpu(self) -> bool:
        return self.startswith("gpu")


CPU = Device("cpu")


_K = TypeVar("_K")
_V = TypeVar("_V")


def frozen_map(value: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only copy of ``value`` for a frozen dataclass's field (one already read-only is kept)."""
    return value if isinstance(value, MappingProxyType) else MappingProxyType(dict(value))


def _settle(obj: object, **values: object) -> None:
    """Set fields of a frozen dataclass in its ``__post_init__``: the typed form of what it was given."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def _device(value: str) -> Device:
    """``value`` as a Device, parsed only if it is not one already (a dataclass built from plain text)."""
    return value if isinstance(value, Device) else Device(value)


def digest(value: object) -> str:
    """Stable short hash of a value's JSON form (cluster identity, plan identity)."""
    import hashlib  # here, not at the top: node programs import this module and never hash

    blob = json.dumps(to_dict(value), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Cluster (from the cluster file, a hostfile, Slurm, or the embedded default)
# ---------------------------------------------------------------------------------------------

class HostKeyPolicy(str, enum.Enum):
    """What to do with an unknown or changed SSH host key, in OpenSSH's StrictHostKeyChecking
    values so the cluster file reads like ssh_config."""

    YES = "yes"                # unknown key: refuse, show fingerprint (the default)
    ACCEPT_NEW = "accept-new"  # unknown key: add to known_hosts; changed key: refuse
    NO = "no"                  # accept anything (never overwrites a changed key either)


@dataclass(frozen=True)
class SshSettings:
    """The cluster file's ``[ssh]`` table: what every SSH connection to the nodes uses."""

    known_hosts: str = "~/.ssh/known_hosts"
    strict_host_key_checking: HostKeyPolicy = HostKeyPolicy.YES
    connect_timeout: float = 10.0
    config: str = "~/.ssh/config"


@dataclass(frozen=True)
class SrunSettings:
    """The Slurm allocation whose nodes are reached as job steps (``--transport srun``), not over SSH."""

    job_id: str                    # SLURM_JOB_ID: ``srun --jobid`` works from inside and outside the job
    srun: str = "srun"             # the srun (and beside it squeue, scancel) on the controller's PATH
    # A heterogeneous job: (host, component) of each node; a step there is ``--het-group=N``.
    het_groups: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Slowdown:
    """An emulated device that slows down while it trains: from ``after_s`` seconds after its rank
    joined the job (``hg.init()``) its declared speed is divided by ``factor`` (1: back to it)."""

    device: int                    # index in the node's emulated devices
    after_s: float
    factor: float


@dataclass(frozen=True)
class EmulateSpec:
    """Devices a node pretends to have; they run on its CPU at ``speed`` relative to the fastest."""

    devices: tuple[str, ...]
    speed: tuple[float, ...]
    memory_mib: tuple[int, ...]
    # Applied by the runtime only: the probe and the bench see the declared speeds.
    slowdown: tuple[Slowdown, ...] = ()

    def identity(self) -> dict[str, list[str] | list[float] | list[int]]:
        """What the cluster's fingerprint hashes: the devices, not their slowdowns (a slowdown
        changes no probe or bench result, so it must not make them stale)."""
        return {"devices": list(self.devices), "speed": list(self.speed), "memory_mib": list(self.memory_mib)}


@dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster, as it is reached (address, SSH options with ssh config applied) and
    run on (its Python, its emulated devices)."""

    name: str
    host: str                      # as written: an address or an ssh-config alias
    hostname: str | None = None    # resolved address (ssh config HostName), None = host
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None  # "[user@]host[:port][,...]" as written (cluster file or ssh config)
    jump: NodeSpec | None = None   # proxy_jump resolved: the last hop, its own ``jump`` the hop before
    python: str = "python3"
    gpus: tuple[int, ...] | None = None   # visible subset of GPU indices; None = all
    emulate: EmulateSpec | None = None
    slots: int | None = None       # from a hostfile ("host slots=N")
    source: str | None = None      # "file:line" where the node was declared, for error messages

    @property
    def is_local(self) -> bool:
        return self.host in ("localhost", "local")

    @property
    def address(self) -> str:
        return self.hostname or self.host


@dataclass(frozen=True)
class Cluster:
    """The config stage's value: the nodes and how to reach them; its fingerprint keys the stored
    probe, bench and plans."""

    nodes: tuple[NodeSpec, ...]
    ssh: SshSettings = field(default_factory=SshSettings)
    source: str | None = None      # path of the cluster file; None for the embedded default
    # Set: every node is a node of this Slurm allocation, reached by srun (remote/srun.py); None: SSH
    # (and local subprocesses for localhost). Not in the fingerprint: how nodes are reached changes
    # no probe or bench result.
    srun: SrunSettings | None = None

    def fingerprint(self) -> str:
        """Identity used to key cached inventory/profiles and to refuse a plan from another cluster."""
        return digest([(n.name, n.address, n.port, n.gpus, n.emulate and n.emulate.identity())
                       for n in self.nodes])

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Inventory (probe)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuInfo:
    """One device as a node's probe found it, or as the cluster file emulates it."""

    index: int
    name: str
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_capability: str | None = None
    driver_version: str | None = None
    emulated: bool = False
    speed: float | None = None     # declared relative speed of an emulated device




@dataclass(frozen=True)
class PythonRuntime:
    """What the node's Python can run, found by importing in a child process (hgcli/node/probe.py).
    A check is None when it is not known (the child timed out): unknown never refuses a plan."""

    executable: str                # the node's Python (``sys.executable`` there)
    torch: bool | None = None      # ``import torch`` works
    gloo: bool | None = None       # torch.distributed with the gloo backend (every plan)
    rpc: bool | None = None        # torch.distributed.rpc (TensorPipe): plans with PS ranks
    numpy: bool | None = None      # numpy imports and torch converts tensors with it: plans with PS ranks
    numpy_version: str | None = None
    why: Mapping[str, str] = field(default_factory=dict)   # check -> why it is False or unknown

    def __post_init__(self) -> None:
        _settle(self, why=frozen_map(self.why))

    def lacking(self, needs: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``needs`` this Python is known not to have; only torch when torch is missing (the
        others are torch's or need it, so torch is what to install)."""
        lacking = tuple(n for n in needs if getattr(self, n) is False)
        return ("torch",) if "torch" in lacking else lacking


@dataclass(frozen=True)
class NodeInfo:
    """One node's probe: devices, CPU, memory, Python and torch, or the error that kept it from
    answering (``ok=False``), so one bad node does not hide the rest."""

    name: str
    host: str
    ok: bool
    error: str | None = None
    emulated: bool = False
    gpus: tuple[GpuInfo, ...] = ()
    cpu_model: str | None = None
    cpu_cores: int | None = None
    memory_total_mib: int | None = None
    os: str | None = None
    python_version: str | None = None
    torch_version: str | None = None   # None when torch is not installed on the node
    torch_cuda: str | None = None
    elapsed_s: float | None = None
    runtime: PythonRuntime | None = None   # None: a failed node, or an inventory of an older hgtrain


@dataclass(frozen=True)
class Inventory:
    """The probe stage's value: every node's probe for one cluster fingerprint, stored for bench
    and plan."""

    cluster: str                   # Cluster.fingerprint()
    nodes: tuple[NodeInfo, ...]
    probed_at: float = 0.0
    version: int = SCHEMA_VERSION

    @property
    def succeeded(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.ok)

    @property
    def failed(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if not n.ok)


# ---------------------------------------------------------------------------------------------
# Profiles (bench)
# ---------------------------------------------------------------------------------------------

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
        _settle(self, device=_device(self.device), matmul_tflops=frozen_map(self.matmul_tflops))


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
        _settle(self, device=_device(self.device))


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


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------

class Strategy(str, enum.Enum):
    """How a plan aggregates gradients: one all-reduce group, groups that exchange through parameter
    servers (hybrid), every device pushing to them (ps), or the planner's choice (auto)."""

    AUTO = "auto"
    ALLREDUCE = "allreduce"
    HYBRID = "hybrid"
    PS = "ps"


class Ideal(str, enum.Enum):
    """The key of a plan's bound beside its strategies' predictions: every worker device alone at its
    batch, nothing exchanged and nobody waited for (``Plan.ideal_samples_per_s``)."""

    IDEAL = "ideal"


# A key of Plan.predicted_samples_per_s: a strategy, or the ideal bound.
Prediction = Union[Strategy, Ideal]


def prediction(key: str) -> Prediction:
    """The key its JSON name (or the key itself) stands for; ValueError for another name."""
    if isinstance(key, (Strategy, Ideal)):
        return key
    return Ideal.IDEAL if key == Ideal.IDEAL.value else Strategy(key)


# The modules every rank of a kind of plan needs on its node (checked by the node probe, enforced by
# ``plan`` and ``launch``). With parameter-server ranks every rank starts torch.distributed.rpc, whose
# TensorPipe set-up converts tensors with numpy (``dist.all_gather_object``).
_PS_NEEDS = ("torch", "gloo", "rpc", "numpy")
PLAN_NEEDS: Mapping[Strategy, tuple[str, ...]] = MappingProxyType(
    {Strategy.ALLREDUCE: ("torch", "gloo"), Strategy.HYBRID: _PS_NEEDS, Strategy.PS: _PS_NEEDS})


class Role(str, enum.Enum):
    """What a rank of a plan does: train (worker) or hold a parameter-server shard (ps)."""

    WORKER = "worker"
    PS = "ps"


@dataclass(frozen=True)
class JobSpec:
    """What the user asks the planner for; every field but the strategy may be left to the planner."""

    strategy: Strategy = Strategy.AUTO
    global_batch: int | None = None   # samples per step over all workers; None = 32 per worker device
    ps_ranks: int | None = None       # number of parameter-server ranks; None = chosen by the cost model
    staleness: int | None = None      # staleness bound; None = the planner's rule (docs/planning.md)
    model: ModelSpec | None = None    # overrides Profiles.model (size of the parameters to exchange)
    # Hybrid communication (docs/runtime-reference.md, "Overlap" and "Wire format"); None = the planner's default.
    overlap: bool | None = None       # a leader's PS exchange runs while its group computes the next step
    wire: Wire = Wire.FP32            # number format of pushes and pulls on the wire

    def __post_init__(self) -> None:
        _settle(self, wire=Wire(self.wire))


@dataclass(frozen=True)
class GroupPlan:
    """A synchronous group of a plan: its ranks, and the local steps it accumulates before each push."""

    id: int
    ranks: tuple[int, ...]
    accumulate: int = 1            # local steps accumulated before the group pushes to the PS


@dataclass(frozen=True)
class RankPlan:
    """One rank of a plan: role, node, device, group and batch, and the emulated speed the runtime
    applies."""

    rank: int
    role: Role
    node: str
    device: Device                 # "gpu0"... for workers; "cpu" for PS ranks
    group: int | None = None
    batch_size: int | None = None
    local_rank: int = 0            # among the ranks of its node
    emulated: bool = False
    speed: float = 1.0             # emulated relative speed applied by the runtime
    slowdown: tuple[Slowdown, ...] = ()   # the emulated device's slowdowns (the cluster file's)
    # The planner's samples/s of this device at its batch (compute only): the bench's, fitted to the
    # script's measured rates when the plan is (Plan.fitted_to). For the summary's per-device line;
    # None: not from a bench (hand-made plans, older files).
    benched_samples_per_s: float | None = None

    def __post_init__(self) -> None:
        _settle(self, device=_device(self.device))


@dataclass(frozen=True)
class Plan:
    """The plan stage's value and what ``launch`` runs: groups, ranks and batches, each strategy's
    predicted samples/s, and why this strategy was chosen."""

    strategy: Strategy
    world_size: int
    groups: tuple[GroupPlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted_samples_per_s: Mapping[Prediction, float]   # per strategy, plus the ideal bound
    global_batch: int
    cluster: str                   # Cluster.fingerprint(): a plan from another cluster is refused
    reason: str = ""               # why this strategy was chosen
    staleness_bound: int = 0       # max versions a group may run ahead (0 for allreduce)
    ps_shards: tuple[int, ...] = ()  # PS ranks, in shard order
    model: ModelSpec | None = None
    version: int = SCHEMA_VERSION
    # The cost model's samples/s of each group of the chosen layout while that group runs, by group
    # id ("0", "1", ...); groups whose steps are shorter wait at the end, so these can sum to more
    # than the strategy's figure in predicted_samples_per_s. Optional and additive: plans that do not carry it (older files, a planner that does not fill
    # it) get a figure derived from the total in the launch summary (hgcli/launch/metrics.py).
    predicted_group_samples_per_s: Mapping[str, float] = field(default_factory=dict)
    # Hybrid communication, read by the runtime (docs/runtime-reference.md). Additive: older plans have neither
    # and run as before (no overlap, fp32 on the wire).
    overlap: bool = False          # a leader's PS exchange overlaps its group's next step
    wire: Wire = Wire.FP32         # format of pushes and pulls (the PS keeps fp32)
    # The job whose measured compute rates fitted the devices' costs (ScriptRates.job_id); None: the
    # costs are the bench's alone, of the model it timed (``model``).
    fitted_to: str | None = None
    # The devices' costs include their nodes' contention as measured with every device of a node
    # stepping at once (DeviceProfile.together); False: alone figures (older profiles, one device).
    bench_together: bool = False

    def __post_init__(self) -> None:
        predicted = self.predicted_samples_per_s
        if not isinstance(predicted, MappingProxyType):   # made here, not read: keys may be names
            predicted = MappingProxyType({prediction(k): v for k, v in predicted.items()})
        _settle(self, wire=Wire(self.wire), predicted_samples_per_s=predicted,
                predicted_group_samples_per_s=frozen_map(self.predicted_group_samples_per_s))

    def predicted(self, strategy: Strategy | None = None) -> float | None:
        """The samples/s predicted for ``strategy`` (default: the plan's own); None when not predicted."""
        return self.predicted_samples_per_s.get(strategy or self.strategy)

    @property
    def ideal_samples_per_s(self) -> float | None:
        return self.predicted_samples_per_s.get(Ideal.IDEAL)

    @property
    def workers(self) -> tuple[RankPlan, ...]:
        return tuple(r for r in self.ranks if r.role is Role.WORKER)

    def rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]


# ---------------------------------------------------------------------------------------------
# Jobs (launch / status)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankRecord:
    """A rank as a job record keeps it: where it ran, its state and exit, and its last metrics."""

    rank: int
    node: str
    role: Role
    state: RankState = RankState.PENDING
    exit_code: int | None = None
    signal: int | None = None
    last_metrics: Mapping[str, Any] = field(default_factory=dict)   # the rank's last record: JSON

    def __post_init__(self) -> None:
        _settle(self, last_metrics=frozen_map(self.last_metrics))


@dataclass(frozen=True)
class JobRecord:
    """What `status` shows and `stop` needs; written atomically to the state dir. No secret values."""

    id: str
    cluster: str                   # Cluster.fingerprint()
    cluster_source: str | None     # the cluster file, None for the embedded default
    command: tuple[str, ...]
    plan: Plan
    state: JobState = JobState.STARTING
    ranks: tuple[RankRecord, ...] = ()
    started_at: float = 0.0
    ended_at: float | None = None
    exit_code: int | None = None
    root_cause: str | None = None  # first failing rank, host, code/signal, in words
    detached: bool = False
    restarts: tuple[str, ...] = ()  # reason of each restart, in order
    # The Slurm job whose steps run the agents (launched with --transport srun): status, logs and
    # stop reach the nodes as steps of it again, from inside or outside the allocation.
    slurm_job: str | None = None
    version: int = SCHEMA_VERSION
